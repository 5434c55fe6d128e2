"""Eager decode steps with per-layer static steps and CUDA graphs (kvcalib.runtime.layer_graphs).

On CPU the per-layer static steps run without capture (``layer_graphs="eager"``) through Triton's
interpreter, against the same ``model.generate`` with them off: the same logits bit for bit, the
same tokens and the same stored bytes, across flushes and for every recipe feature static mode
covers. On CUDA (device tool) the captured graphs against the same steps with graphs off.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_setup import kernel_modules

DEVICE, INTERPRET, _ = kernel_modules("kvcalib_kernels.decode_attention")  # before any kernel import

from kvcalib.errors import KvcalibError  # noqa: E402
from kvcalib.layout import LayerConfig  # noqa: E402
from kvcalib.recipe import Recipe  # noqa: E402
from kvcalib.runtime.cache import CompressedCache  # noqa: E402
from tests.kernels.test_graph_decode import (  # noqa: E402
    LAYERS, PATS_AGE_CPU, RECIPE, _case_layers, _case_recipe, _model, _stored_views, _units)

requires_cuda = pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device (run through the device tool)")


def _recipe(case: str, layers: int = LAYERS, pats_age: int = 40) -> Recipe:
    if case == "mixed-16bit":  # layer 0 keeps 16-bit values: no kernel, so it stays dynamic
        return Recipe(name="mixed", layers=[LayerConfig(k_bits=4, v_bits=16, k_group=16, v_group=32, window=16,
                                                        sinks=2), RECIPE.default_layer])
    return _case_recipe(case, layers, pats_age)


def _inputs(case: str):
    g = torch.Generator().manual_seed(11)
    # 33 tokens: one short of the first flush (2 sinks + 16 window + a block of 16), so the decode
    # steps flush at once and every 16 steps after (the padded row 2 steps later)
    ids = torch.randint(0, 128, (2, 33), generator=g).to(DEVICE)  # (B, T)
    mask = torch.ones_like(ids)  # (B, T)
    if case.endswith("left-padding"):
        mask[1, :2] = 0
    return ids, mask


def _generate(model, recipe, ids, mask, mode: str, new: int):
    cache = CompressedCache.from_recipe(model, recipe, layer_graphs=mode)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
    return out, cache


@pytest.mark.slow
@pytest.mark.parametrize("case", ["plain", "left-padding", "fitted", "ott-left-padding", "pats-left-padding",
                                  "sliding-left-padding", "mixed-16bit"])
def test_layer_static_steps_equal_plain_generate(monkeypatch, case):
    """Plain generate with each layer's decode steps static (no capture here) gives the logits of
    plain generate with them off, bit for bit, over two flushes (and two tier moves for PATS),
    and the cache holds the same bytes and counts after it. The static steps really ran, but not
    on a 16-bit layer (it has no kernel path). One layer, or two where they differ (fitted,
    sliding, mixed: test_graph_decode.TWO_LAYER_CASES)."""
    monkeypatch.setenv("KVCALIB_BACKEND", "triton")
    layers = _case_layers(case)
    model = _model(sliding=case.startswith("sliding"), layers=layers)
    recipe = _recipe(case, layers, PATS_AGE_CPU)
    ids, mask = _inputs(case)
    new = 32 if case.startswith("pats") else 22  # flushes at contexts 34 and 50 (PATS: tier moves at 46, 62)
    ref, ref_cache = _generate(model, recipe, ids, mask, "off", new)
    got, cache = _generate(model, recipe, ids, mask, "eager", new)
    assert ref_cache.layer_graphs.eager_steps == 0
    static_layers = 1 if case == "mixed-16bit" else layers
    assert cache.layer_graphs.eager_steps == static_layers * (new - 1)  # every decode step of those layers
    assert cache.layer_graphs.captures == 0
    if case == "mixed-16bit":
        assert not cache.layers[0].graph_owned and cache.layers[0].graph_refused
    assert torch.equal(got.sequences, ref.sequences)
    a, b = torch.stack(got.logits), torch.stack(ref.logits)  # (steps, B, V)
    assert float(b.abs().max()) > 0
    assert torch.equal(a, b), f"layer static steps vs dynamic: {float((a - b).abs().max())}"
    for layer, ref_layer in zip(cache.layers, ref_cache.layers, strict=True):
        assert layer.n_seen == ref_layer.n_seen == ids.shape[1] + new - 1
        assert layer.get_seq_length() == ref_layer.get_seq_length()
        for ua, ub in zip(_units(layer), _units(ref_layer), strict=True):
            assert ua.pend_k.shape == ub.pend_k.shape and torch.equal(ua.pend_k, ub.pend_k)
    for x, y in zip(_stored_views(cache.layers[-1]), _stored_views(ref_cache.layers[-1]), strict=True):
        assert x.n == y.n and torch.equal(x.k_codes, y.k_codes) and torch.equal(x.v_codes, y.v_codes)
    assert cache.nbytes() == ref_cache.nbytes()


@pytest.mark.slow
def test_a_prompt_after_static_steps_goes_back_to_dynamic(monkeypatch):
    """A multi-token chunk after static decode steps (a chat's next turn) leaves static mode and
    is taken in as a prompt; decode steps after it go static again. Same logits as all dynamic."""
    monkeypatch.setenv("KVCALIB_BACKEND", "triton")
    model = _model()
    g = torch.Generator().manual_seed(4)
    # a flush in each static stretch: at context 34 (the first step) and 50 (after the 7-token turn)
    prompt = torch.randint(0, 128, (1, 33), generator=g).to(DEVICE)  # (1, T)
    turn = torch.randint(0, 128, (1, 7), generator=g).to(DEVICE)  # (1, 7)
    steps = torch.randint(0, 128, (1, 14), generator=g).to(DEVICE)  # (1, 14) teacher-forced tokens

    def run(mode):
        cache = CompressedCache.from_recipe(model, RECIPE, layer_graphs=mode)
        logits = []
        with torch.no_grad():
            model(input_ids=prompt, past_key_values=cache)
            for i in range(6):
                logits.append(model(input_ids=steps[:, i:i + 1], past_key_values=cache).logits[:, -1])
            logits.append(model(input_ids=turn, past_key_values=cache).logits[:, -1])
            assert not any(layer.graph_owned for layer in cache.layers)
            for i in range(6, 14):
                logits.append(model(input_ids=steps[:, i:i + 1], past_key_values=cache).logits[:, -1])
        return torch.stack(logits), cache  # (15, 1, V)

    ref, _ = run("off")
    got, cache = run("eager")
    assert cache.layer_graphs.eager_steps == 2 * 14
    assert torch.equal(got, ref)


@pytest.mark.slow
def test_static_mode_of_a_graph_decoder_takes_over_the_layers(monkeypatch):
    """GraphDecoder after plain generate on the same cache: its static mode takes every layer
    from the per-layer steps (no layer is run twice a step, nothing is written twice)."""
    from kvcalib.runtime.graphs import GraphDecoder

    monkeypatch.setenv("KVCALIB_BACKEND", "triton")
    model = _model()
    ids, mask = _inputs("plain")
    # plain generate of 22 tokens: its first 18 (two flushes) are those of an 18-token generate
    # (greedy), its last 4 what the decoder must give after them (one reference generate, not two)
    ref, _ = _generate(model, RECIPE, ids, mask, "off", 22)
    _, cache = _generate(model, RECIPE, ids, mask, "eager", 18)
    assert any(layer.graph_owned for layer in cache.layers) or cache.layer_graphs.eager_steps
    cache.make_static(torch.tensor([cache.layers[0].n_seen], device=DEVICE))
    assert not any(layer.graph_owned for layer in cache.layers)
    assert all(layer.static is not None for layer in cache.layers)
    cache.make_dynamic()
    # and decoding goes on: the GraphDecoder's own steps give plain generate's next tokens
    last = ids.shape[1] + 18  # the 18th generated token, the decoder's first input
    res = GraphDecoder(model, cache, capture=False).decode(ref.sequences[:, last - 1:last], cache.layers[0].n_seen,
                                                           torch.full((2, 1), cache.layers[0].n_seen), 4)
    assert torch.equal(res.tokens, ref.sequences[:, -4:])


def test_unknown_layer_graphs_mode_is_refused():
    with pytest.raises(KvcalibError, match="layer_graphs='fast' is not known"):
        CompressedCache.from_recipe(_model(), RECIPE, layer_graphs="fast")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("case", ["plain", "left-padding", "fitted", "ott-left-padding", "pats-left-padding",
                                  "sliding-left-padding"])
def test_captured_layer_graphs_equal_dynamic_steps(case):
    """On CUDA (bf16): captured per-layer graphs give the logits of dynamic steps bit for bit,
    replaying most layer steps (one eager step and one capture per layer and flush period)."""
    model = _model(sliding=case.startswith("sliding")).to(torch.bfloat16)
    recipe = _recipe(case)
    ids, mask = _inputs(case)
    new = 56 if case.startswith("pats") else 70
    ref, _ = _generate(model, recipe, ids, mask, "off", new)
    got, cache = _generate(model, recipe, ids, mask, "auto", new)
    graphs = cache.layer_graphs
    assert graphs.captures > 0 and graphs.replays > graphs.eager_steps, vars(graphs)
    assert torch.equal(got.sequences, ref.sequences)
    assert torch.equal(torch.stack(got.logits), torch.stack(ref.logits))


@pytest.mark.gpu
@requires_cuda
def test_captures_survive_garbage_collection():
    """Caches dropped between generate calls are freed by the garbage collector at any moment,
    captures included (the passkey evaluation hit it: a collected graph destroyed mid-capture
    invalidated the capture, and the next one found the allocator still recording). With the
    collector run at every allocation, every call still captures and replays, without a warning,
    and gives the tokens of dynamic steps."""
    import gc
    import warnings

    model = _model().to(torch.bfloat16)
    ids, mask = _inputs("plain")
    ref, _ = _generate(model, RECIPE, ids, mask, "off", 40)
    old = gc.get_threshold()
    gc.set_threshold(1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            for _ in range(4):
                got, cache = _generate(model, RECIPE, ids, mask, "auto", 40)
                assert cache.layer_graphs.captures > 0 and cache.layer_graphs.mode == "auto"
                assert torch.equal(got.sequences, ref.sequences)
                cache.self_ref = cache  # only the collector frees it and its graphs: during a capture
                del got, cache
    finally:
        gc.set_threshold(*old)
