"""Static (CUDA-graph) decode steps: the same answers as ordinary decoding.

On CPU the static steps run eagerly (``capture=False``) through Triton's interpreter: that checks
the static data path (fixed pending buffer, device position, visibility mask, deferred flushes)
against the dynamic cache step by step. On CUDA (device tool) the captured graphs are checked
against the same steps run eagerly, and the bf16 ``StaticCache`` baseline of the benchmark
against transformers' own decoding.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.kernels.triton_setup import kernel_modules

DEVICE, INTERPRET, _ = kernel_modules("kvcalib_kernels.decode_attention")  # before any kernel import

from kvcalib.errors import KvcalibError  # noqa: E402
from kvcalib.layout import LayerConfig
from kvcalib.recipe import Recipe  # noqa: E402
from kvcalib.runtime.cache import CompressedCache  # noqa: E402
from kvcalib.runtime.graphs import GraphDecoder  # noqa: E402
from tests.conftest import tiny_model  # noqa: E402

requires_cuda = pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device (run through the device tool)")
RECIPE = Recipe(name="t", default_layer=LayerConfig(k_bits=2, v_bits=4, k_group=16, v_group=32, window=16, sinks=2))
LAYERS = 2  # tiny_model's layers
# The interpreter-run tests (CPU) give a case a second layer only where its layers differ: a fitted
# recipe's bits per layer (K2/V4, then K4/V2), a 16-bit layer beside a kernel one, Gemma 3's sliding
# layer beside its global one. Why: every decode step runs each layer's kernels in Triton's
# interpreter, most of these tests' time (CI: 2 cores), and a second layer alike the first adds only
# what those two-layer cases (padded too: sliding-left-padding) already cover: each layer's own
# static state, one device position and mask for all layers.
TWO_LAYER_CASES = ("fitted", "sliding", "mixed")
PATS_AGE_CPU = 28  # the interpreter tests' PATS age (_pats_recipe): tier moves at contexts 46 and 62


def _case_layers(case: str) -> int:
    """The tiny model's layers for a CPU test case (see TWO_LAYER_CASES)."""
    return LAYERS if case.split("-")[0] in TWO_LAYER_CASES else 1


def _ott_recipe(pool: int = 4, layers: int = LAYERS) -> Recipe:
    """RECIPE with an OTT outlier pool on every one of ``layers`` layers."""
    return Recipe(name="ott", default_layer=RECIPE.default_layer,
                  tensors={f"layers.{i}.kv.outlier_pool": torch.tensor(pool) for i in range(layers)})


def _pats_recipe(ages=(40,), layers: int = LAYERS) -> Recipe:
    """4-bit K/V halved to 2 bits from age 40 (on each of ``layers`` layers): with blocks of 16
    after a 16-token window and 2 sinks, a block [s, s + 16) is flushed at context s + 32 and reaches
    that age at s + 56, 8 steps after the next flush (a tier move between flushes); at age
    PATS_AGE_CPU (28), at s + 44: 12 steps after its own flush, 4 before the next (fewer steps
    in the interpreter for the same moves)."""
    from kvcalib.methods.schedule import Schedule

    cfg = LayerConfig(k_bits=4, v_bits=4, k_group=16, v_group=16, window=16, sinks=2)
    tiers = Schedule.from_layer(cfg, ages).to_tensor()
    return Recipe(name="pats", default_layer=cfg, tensors={f"layers.{i}.kv.schedule": tiers for i in range(layers)})


def _case_recipe(case: str, layers: int, pats_age: int = PATS_AGE_CPU) -> Recipe:
    """The recipe of a test case (its first word: ott, pats, fitted, or RECIPE) for ``layers``
    layers (:func:`_case_layers` on CPU)."""
    return {"ott": lambda: _ott_recipe(layers=layers), "pats": lambda: _pats_recipe((pats_age,), layers),
            "fitted": _fitted_recipe}.get(case.split("-")[0], lambda: RECIPE)()


def _units(layer):
    """The layers holding a cache layer's tokens: itself, or one per row of a padded batch."""
    return layer.rows if layer.ragged else [layer]


def _stored_views(layer):
    """Each PATS store's packed view (one for an untiered layer), row after row when padded."""
    return [store.view() for unit in _units(layer) for store in unit.packed.stores]


def _fitted_recipe() -> Recipe:
    """What a searched recipe adds to a preset (recipes/smollm2-135m: 4 sinks, window = key group):
    4 sinks, key groups of 16 (the flush block) and value groups of 32, mixed bits per layer (K2/V4,
    then K4/V2), clip scales per kv head, and (layer 0) an SKVQ permutation and a TaDA-centred
    value side."""
    l0 = LayerConfig(k_bits=2, v_bits=4, k_group=16, v_group=32, window=16, sinks=4)
    l1 = LayerConfig(k_bits=4, v_bits=2, k_group=16, v_group=32, window=16, sinks=4)
    g = torch.Generator().manual_seed(9)
    tensors = {f"layers.{i}.{s}.clip": torch.tensor([[0.8], [0.65]]) for i in range(LAYERS) for s in "kv"}
    tensors["layers.0.k.perm"] = torch.stack([torch.randperm(64, generator=g) for _ in range(2)])
    tensors["layers.0.v.center"] = torch.tensor(8)
    return Recipe(name="fitted", layers=[l0, l1], tensors=tensors)


def _model(sliding: bool = False, layers: int = LAYERS):
    """The tiny test model: Llama, or Gemma 3 with a 28-token sliding window on its first layer."""
    if sliding:
        return tiny_model("gemma3", head_dim=64, heads=4, kv_heads=2, sliding_window=28, layers=layers).to(DEVICE)
    return tiny_model("llama", head_dim=64, heads=4, kv_heads=2, layers=layers).to(DEVICE)


def _dynamic_logits(model, recipe, ids, mask, tokens):
    """Teacher-forced ordinary decoding: logits (steps, B, V) of the prompt's last position and of
    each of ``tokens`` (B, steps) but the last, over a fresh dynamic cache (run by the caller's
    backend). The prompt keeps its last position's logits only, as GraphDecoder.generate does (the
    same matmul: bit-for-bit comparisons)."""
    cache = CompressedCache.from_recipe(model, recipe)
    b, t = ids.shape
    full = torch.ones((b, t + tokens.shape[1]), dtype=torch.long, device=ids.device) if mask is None else \
        torch.cat([mask, mask.new_ones((b, tokens.shape[1]))], 1)  # (B, T + steps)
    pos = (full.cumsum(-1) - 1).clamp_min(0)  # (B, T + steps)
    out = []
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=None if mask is None else mask, position_ids=pos[:, :t],
                       past_key_values=cache, logits_to_keep=1).logits
        out.append(logits[:, -1].float())
        for i in range(tokens.shape[1] - 1):
            am = None if mask is None else full[:, :t + i + 1]
            logits = model(input_ids=tokens[:, i:i + 1], attention_mask=am, position_ids=pos[:, t + i:t + i + 1],
                           past_key_values=cache).logits
            out.append(logits[:, -1].float())
    return torch.stack(out), cache


@pytest.mark.slow
@pytest.mark.parametrize("case", ["plain", "left-padding", "short-prompt", "fitted", "ott-left-padding",
                                  "pats-left-padding", "sliding-left-padding"])
def test_static_steps_match_dynamic_decoding(monkeypatch, case):
    """Static steps (device position and mask, flushes between steps) and dynamic decoding make one
    computation: the same logits bit for bit at every step, the same tokens and the same stored
    bytes, across several flushes, both through the kernel -- with padding, a prompt shorter than
    the sinks (whose first steps run dynamically), a fitted recipe's sinks, window shorter than
    its groups, mixed bits per layer, clip, permutation and centring, OTT outlier pools, PATS tiers
    (blocks moving down a tier between two flushes) and a sliding-window layer (its own mask, old
    blocks and sinks dropped at flushes). The kernel against the reference: test_decode_attention.
    One layer, or two where they differ (TWO_LAYER_CASES); the checks read the last."""
    monkeypatch.setenv("KVCALIB_BACKEND", "triton")
    model = _model(sliding=case.startswith("sliding"), layers=_case_layers(case))
    assert model.config.num_hidden_layers == (LAYERS if case in ("fitted", "sliding-left-padding") else 1)
    recipe = _case_recipe(case, _case_layers(case))
    g = torch.Generator().manual_seed(5)
    if case == "short-prompt":
        ids, mask = torch.randint(0, 128, (1, 1), generator=g), None
    else:
        # 33 tokens: one short of the first flush (2 sinks + 16 window + a block of 16), so the
        # decode steps flush at once and every 16 steps after (the padded row 2 steps later)
        ids = torch.randint(0, 128, (2, 33), generator=g)
        mask = None
        if case.endswith("left-padding"):
            mask = torch.ones_like(ids)
            mask[1, :2] = 0
            mask = mask.to(DEVICE)
    ids = ids.to(DEVICE)
    # one flush (short prompt) or two on the way (blocks of 16, at contexts 34 and 50; the padded
    # row's at its own 34 and 50); PATS: tier moves at contexts 46 and 62 (a block [s, s + 16)
    # reaches age 28 at s + 44), after each flush and before the next: the second, at the padded
    # row's last step, shows in the stores only if moves happen between flushes
    steps = 34 if case == "short-prompt" else 32 if case.startswith("pats") else 22
    cache = CompressedCache.from_recipe(model, recipe)
    res = GraphDecoder(model, cache, capture=False, keep_logits=True).generate(ids, mask, max_new_tokens=steps)
    assert res.tokens.shape == (ids.shape[0], steps)
    assert cache.layers[0].static is None and cache.layers[0].n_seen == ids.shape[1] + steps - 1
    assert cache.layers[-1].n_packed == (16 if case == "short-prompt" else 32)
    first = _units(cache.layers[0])[0]  # the unpadded row
    if case.startswith("sliding"):  # 54 tokens seen through a 28-token window: one block and the sinks gone
        assert first.sinks_dropped and first.packed.start == 18
    if case.startswith("pats"):  # both blocks moved down to 2 bits, none left at 4
        assert [store.n for store in first.packed.stores] == [0, 32]
    if case.endswith("left-padding"):  # the padded row is held apart, from its first real token
        assert cache.layers[-1].ragged and cache.layers[-1].rows[1].n_seen == cache.layers[-1].n_seen - 2
    ref, ref_cache = _dynamic_logits(model, recipe, ids, mask, res.tokens)
    got = torch.stack(res.logits)  # (steps, B, V)
    assert got.shape == ref.shape and float(ref.abs().max()) > 0
    assert torch.equal(got, ref), f"static vs dynamic: {float((got - ref).abs().max())}"
    assert torch.equal(res.tokens, torch.stack([x.argmax(-1) for x in ref], 1))
    # the same bytes were stored (in the same tier stores)
    for a, b in zip(_stored_views(cache.layers[-1]), _stored_views(ref_cache.layers[-1]), strict=True):
        assert a.n == b.n and torch.equal(a.k_codes, b.k_codes) and torch.equal(a.v_codes, b.v_codes)
        assert torch.equal(a.k_scale, b.k_scale) and torch.equal(a.v_scale, b.v_scale)
    a = _stored_views(cache.layers[-1])[0]
    b = _stored_views(ref_cache.layers[-1])[0]
    if case.startswith("ott"):  # the same tokens went to the pools
        assert a.keep is not None and torch.equal(a.keep, b.keep)
        for ua, ub in zip(_units(cache.layers[-1]), _units(ref_cache.layers[-1]), strict=True):
            assert torch.equal(ua.outliers.segment(torch.float32)[2], ub.outliers.segment(torch.float32)[2])


def test_static_mode_refuses_what_it_cannot_run(monkeypatch):
    model = _model()
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    full = Recipe(name="fp", default_layer=LayerConfig(k_bits=16, v_bits=16, window=16))
    with pytest.raises(KvcalibError, match="layer 0: the layer keeps full precision"):
        GraphDecoder(model, CompressedCache.from_recipe(model, full), capture=False).generate(ids, max_new_tokens=3)
    monkeypatch.setenv("KVCALIB_BACKEND", "reference")
    with pytest.raises(KvcalibError, match="KVCALIB_BACKEND=reference"):
        GraphDecoder(model, CompressedCache.from_recipe(model, RECIPE), capture=False)
    monkeypatch.delenv("KVCALIB_BACKEND")
    if DEVICE == "cpu":
        with pytest.raises(KvcalibError, match="CUDA graphs need a CUDA model"):
            GraphDecoder(model, CompressedCache.from_recipe(model, RECIPE), capture=True)


def test_static_buffer_is_counted_whole():
    """Memory accounting: the pending window's fixed buffer is held whole, used or not, in both
    modes (static mode reads the very buffer dynamic decode steps write)."""
    from kvcalib.runtime.cache import CompressedLayer
    from kvcalib.runtime.static import StaticState

    layer = CompressedLayer(LayerConfig(k_bits=2, v_bits=2, k_group=16, v_group=16, window=16))
    layer.update(torch.randn(1, 2, 40, 64), torch.randn(1, 2, 40, 64))
    layer.flush()
    assert layer.pend_k.shape[-2] == 24 and layer.pend_buffered
    whole = 2 * 2 * 32 * 64 * 4  # K and V, (1, 2, 32, 64) float32

    def window(nb):
        return nb["window"] + nb["window_free"]

    assert layer.nbytes()["window"] == 2 * 2 * 24 * 64 * 4 and window(layer.nbytes()) == whole
    buffer = layer.pend_buf_k.data_ptr()
    layer.make_static(StaticState.create(torch.tensor([40]), 64))
    assert window(layer.nbytes()) == whole and layer.pend_buf_k.data_ptr() == buffer
    layer.make_dynamic()
    assert window(layer.nbytes()) == whole and layer.pend_k.data_ptr() == buffer


# ---------------------------------------------------------------- CUDA graphs (GPU)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("padded,variant", [(False, ""), (True, ""), (True, "ott"), (True, "pats"),
                                            (True, "sliding")],
                         ids=["plain", "left-padding", "ott-left-padding", "pats-left-padding", "sliding-left-padding"])
def test_captured_steps_equal_eager_static_steps(padded, variant):
    """Replayed graphs (one capture per flush period) give exactly the eager static steps, OTT
    outlier pools (they change at flushes, which start a new period), PATS tiers (a tier move
    starts one too) and a Gemma 3 sliding-window layer (its window mask refreshed inside the graph)
    included."""
    recipe = {"ott": _ott_recipe(), "pats": _pats_recipe()}.get(variant, RECIPE)
    model = _model(sliding=variant == "sliding").to(torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 128, (3, 40), generator=g).to(DEVICE)
    mask = None
    if padded:
        mask = torch.ones_like(ids)
        mask[2, :9] = 0
    runs = []
    for capture in (False, True):
        cache = CompressedCache.from_recipe(model, recipe)
        runs.append(GraphDecoder(model, cache, capture=capture, keep_logits=True).generate(ids, mask,
                                                                                           max_new_tokens=70))
    eager, graph = runs
    # 69 steps after the prompt's token; a padded row flushes (and moves tiers) at its own steps,
    # so a padded batch has about twice the flush periods (one eager step and one capture each)
    assert graph.replays + graph.eager_steps == 69
    assert graph.captures >= 4 and graph.replays >= (40 if padded else 60)
    assert torch.equal(eager.tokens, graph.tokens)
    assert float((torch.stack(eager.logits) - torch.stack(graph.logits)).abs().max()) < 1e-2


@pytest.mark.gpu
@requires_cuda
def test_static_cache_baseline_matches_transformers():
    """The benchmark's bf16 baseline (transformers StaticCache, replayed) decodes as transformers does."""
    from transformers import DynamicCache, StaticCache

    model = _model().to(torch.bfloat16)
    model.set_attn_implementation("sdpa")
    ids = torch.randint(0, 128, (2, 30), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    ref = model.generate(ids, past_key_values=DynamicCache(config=model.config), max_new_tokens=20,
                         do_sample=False, min_new_tokens=20)[:, 30:]
    cache = StaticCache(config=model.config, max_cache_len=64)
    res = GraphDecoder(model, cache, capture=True).generate(ids, max_new_tokens=20)
    assert res.replays >= 15
    assert (res.tokens == ref).float().mean() > 0.9  # bf16 SDPA over 64 slots vs the growing cache


@pytest.mark.gpu
@requires_cuda
def test_kvcalib_run_with_cuda_graphs_generates_the_eager_text(tiny_tokenizer):
    """`kvcalib run --cuda-graph`'s generation path: the same tokens as `model.generate` over
    the same recipe (float32 model: no near-ties between the two kernels' roundings)."""
    from kvcalib.runtime.generate import generate
    from tests.conftest import tiny_loaded_model

    loaded = tiny_loaded_model(tiny_tokenizer, head_dim=64)
    loaded.model.to(DEVICE)
    prompt = "The old king walked over the green stone bridge into the market of the north town in 1650."
    eager = generate(loaded, prompt, RECIPE, max_new_tokens=48)
    graph = generate(loaded, prompt, RECIPE, max_new_tokens=48, cuda_graph=True)
    assert graph.new_tokens == eager.new_tokens and graph.text == eager.text
    # a float32 model: its full-precision window (most of these 75 tokens) counts at 32 bits
    assert graph.kv_bytes > 0 and graph.effective_bits < 32


@pytest.mark.slow
@pytest.mark.parametrize("case", ["plain", "left-padding", "fitted", "cache-keyword"])
def test_generate_inside_cuda_graphs_equals_plain_generate(monkeypatch, case):
    """kvcalib.cuda_graphs(model): plain model.generate with its decode steps in static mode (on CPU
    without capture, through the interpreter) gives the logits and tokens of plain generate, bit
    for bit, across flushes; the model's forward is its own again after the block. The static
    steps really run (counted), whichever keyword the cache comes by: ``past_key_values``, or
    ``cache`` (transformers 5.2x+, which passes the cache to forward under that name either way).
    One layer, or two for the fitted recipe's per-layer bits (TWO_LAYER_CASES)."""
    from kvcalib.models import cache_kwarg
    from kvcalib.runtime import graphs
    from kvcalib.runtime.graphs import cuda_graphs

    taken = []
    real_step = graphs._GenerateSteps.step

    def counted(self, *args):
        out = real_step(self, *args)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(graphs._GenerateSteps, "step", counted)

    monkeypatch.setenv("KVCALIB_BACKEND", "triton")
    model = _model(layers=_case_layers(case))  # one layer, two for fitted (TWO_LAYER_CASES)
    recipe = _fitted_recipe() if case == "fitted" else RECIPE
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 128, (2, 33), generator=g).to(DEVICE)  # flushes at once, then every 16 steps
    mask = torch.ones_like(ids)
    if case == "left-padding":
        mask[1, :2] = 0

    keyword = cache_kwarg(model) if case == "cache-keyword" else "past_key_values"
    if case == "cache-keyword" and keyword != "cache":
        pytest.skip("this transformers takes the cache as past_key_values only")

    def run():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=22, min_new_tokens=22,
                              do_sample=False, **{keyword: CompressedCache.from_recipe(model, recipe)},
                              output_logits=True, return_dict_in_generate=True, pad_token_id=0)

    plain = run()
    assert not taken
    with cuda_graphs(model, capture=False) as same:
        assert same is model and "forward" in model.__dict__
        graphed = run()
    assert "forward" not in model.__dict__
    assert sum(taken) >= 20, taken  # the decode steps ran static (all but those before the sinks fill)
    assert torch.equal(plain.sequences, graphed.sequences)
    assert torch.equal(torch.stack(plain.logits), torch.stack(graphed.logits))


@pytest.mark.gpu
@requires_cuda
def test_generate_inside_cuda_graphs_replays_captured_steps():
    """On CUDA the steps of plain generate replay captured graphs and give the eager tokens."""
    import kvcalib

    model = _model().to(torch.bfloat16)
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    runs = []
    for graphs in (False, True):
        cache = CompressedCache.from_recipe(model, RECIPE)
        scope = kvcalib.cuda_graphs(model) if graphs else contextlib.nullcontext()
        with scope:
            # the mask says no padding: without it generate would take token 0 (pad_token_id) in
            # the random prompt for padding between real tokens, which the cache refuses
            runs.append(model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=70,
                                       min_new_tokens=70, do_sample=False, past_key_values=cache, pad_token_id=0))
    assert torch.equal(runs[0], runs[1])


def test_cuda_graphs_on_a_cpu_model_leaves_generate_as_it_is():
    """The README's one-liner runs anywhere: off CUDA the block warns and changes nothing."""
    import kvcalib

    model = _model().cpu()
    with pytest.warns(UserWarning, match="not on a CUDA device"):
        with kvcalib.cuda_graphs(model) as same:
            assert same is model and "forward" not in model.__dict__
