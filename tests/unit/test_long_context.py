"""Long-context scoring stays exact while its memory stays linear in the context (issue 33).

- the decode-faithful simulation in query chunks equals one chunk, in float64, for sinks, OTT
  pools, PATS tiers and sliding-window layers;
- position_nll (the decoder's hidden states, the head applied a chunk at a time) equals the
  cross-entropy of the model's own full logits, Gemma's final softcapping included;
- position buckets average exactly the tokens they hold.
"""

from __future__ import annotations

import math

import pytest
import torch

import kvcalib.simulate as simulate
from kvcalib.eval import perplexity
from kvcalib.eval.perplexity import position_buckets, position_nll, position_nll_windows, scored_slice
from kvcalib.layout import LayerConfig
from kvcalib.recipe import Recipe
from tests.conftest import tiny_model

CFG = LayerConfig(k_bits=4, v_bits=2, k_group=8, v_group=8, window=8, sinks=2)


def _recipe(n: int) -> Recipe:
    tiers = torch.tensor([[0, 16, 16], [8, 4, 2], [24, 2, 2]])  # (N, 3): blocks change tiers within 60 tokens
    tensors = {}
    for i in range(n):
        tensors[f"layers.{i}.kv.outlier_pool"] = torch.tensor(2)
        tensors[f"layers.{i}.kv.schedule"] = tiers
    return Recipe(name="long", layers=[CFG] * n, tensors=tensors)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_chunked_simulation_equals_one_chunk_in_float64(arch, monkeypatch):
    model = tiny_model(arch).double()
    rec = _recipe(2)
    ids = torch.randint(0, 128, (2, 60), generator=torch.Generator().manual_seed(2))
    codecs = rec.codecs(num_layers=2, head_dim=16)
    whole = simulate.simulated_logits(model, ids, rec.layers, codecs, prompt_len=5)
    monkeypatch.setattr(simulate, "SCORE_BUDGET", 2 * 4 * 60 * 7)  # chunks of 7 queries, the last one short
    chunked = simulate.simulated_logits(model, ids, rec.layers, codecs, prompt_len=5)
    assert float((chunked - whole).abs().max()) <= 1e-12 * float(whole.abs().max())
    plain = simulate.simulated_logits(model, ids, [LayerConfig()] * 2, prompt_len=5)
    assert float((plain - whole).abs().max()) > 1e-3, "the recipe must change the logits for this test to bite"


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_position_nll_equals_full_logits(arch, monkeypatch):
    model = tiny_model(arch)
    if arch == "gemma3":
        model.config.final_logit_softcapping = 3.0  # exercise the softcap branch: logits reach ~10 here
    ids = torch.randint(0, 128, (2, 37), generator=torch.Generator().manual_seed(4))
    monkeypatch.setattr(perplexity, "LOGIT_CHUNK", 5)
    got = position_nll(model, ids)  # (2, 36)
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits.float()  # (2, 37, V)
    want = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
    assert got.shape == (2, 36) and torch.allclose(got, want.double(), atol=1e-5, rtol=1e-5)
    # decode-faithful through a recipe: the same NLL as the simulated full logits
    rec = _recipe(2)
    codecs = rec.codecs(num_layers=2, head_dim=16)
    sim = simulate.simulated_logits(model, ids, rec.layers, codecs, prompt_len=1)
    want = torch.nn.functional.cross_entropy(sim[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
    assert torch.allclose(position_nll(model, ids, rec.layers, codecs), want.double(), atol=1e-4, rtol=1e-4)


def test_position_nll_refuses_a_head_it_cannot_reproduce():
    from kvcalib.errors import KvcalibError

    model = tiny_model("llama")
    head = model.get_output_embeddings()
    forward = model.forward

    def scaled(*args, **kwargs):  # a model whose own logits are scaled after the head (Cohere-like)
        out = forward(*args, **kwargs)
        out.logits = out.logits * 2.0
        return out

    model.forward = scaled
    with pytest.raises(KvcalibError, match="post-processes its logits"):
        position_nll(model, torch.randint(0, 128, (1, 12)))
    assert head is model.get_output_embeddings()


def test_windows_and_buckets():
    model = tiny_model("llama")
    ids = torch.randint(0, 128, (3, 40), generator=torch.Generator().manual_seed(5))
    per = position_nll_windows(model, ids, prompt_len=4, batch_size=2)  # (3, S)
    span = scored_slice(40, 4)
    assert per.shape == (3, span.stop - span.start)
    buckets = position_buckets(per, span.start, [0, 10, 20, 64])
    assert [b["tokens"] for b in buckets] == [3 * 6, 3 * 10, 3 * 20]  # tokens 4..9, 10..19, 20..39
    assert math.isclose(sum(b["nll"] * b["tokens"] for b in buckets) / per.numel(), float(per.mean()), rel_tol=1e-12)


def test_objective_scores_the_last_positions_after_a_compressed_prompt():
    """score_last = N: the window's first T - N tokens are a prompt (full precision by themselves,
    then compressed) and the KL averages the last N positions, from kept logits only; it equals the
    full-logits objective with prompt_len = T - N."""
    from kvcalib.models import model_info
    from kvcalib.optimize.objective import SearchObjective
    from kvcalib.optimize.space import Point

    model = tiny_model("llama")
    info = model_info(model.config, "tiny")
    ids = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(6))
    point = Point(8, 8, 2, (2, 4), (2, 2), ((), ()))
    long = SearchObjective(model, info, None, ids, context=256, score_last=16)
    full = SearchObjective(model, info, None, ids, context=256, prompt_len=48)
    assert long.reference(0).shape[0] == 16 and full.reference(0).shape[0] == 64
    a, b = long.kl(point), full.kl(point)
    assert a > 0 and math.isclose(a, b, rel_tol=1e-4)
    with pytest.raises(ValueError, match="score_last"):
        SearchObjective(model, info, None, ids, score_last=64)


def test_search_config_checks_long_scoring(tmp_path):
    from kvcalib.errors import KvcalibError
    from kvcalib.optimize import SearchConfig

    cfg = SearchConfig(out=tmp_path / "r", seq_len=256, score_seq_len=8192, score_last=1024, context=8192)
    assert cfg.scoring_length == 8192
    with pytest.raises(KvcalibError, match="--score-last"):
        SearchConfig(out=tmp_path / "r", seq_len=256, score_last=256)


def _prefill_case(arch: str, padded: bool, seed: int):
    """A float64 tiny model, a 2-bit recipe with sinks and a window, 2 x 40 token ids, and their
    attention mask (row 1 left-padded by 7 when ``padded``)."""
    model = tiny_model(arch).double()
    rec = Recipe(name="p", default_layer=LayerConfig(k_bits=2, v_bits=2, k_group=8, v_group=8, window=8, sinks=3))
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(seed))  # (2, 40)
    mask = torch.ones_like(ids)  # (2, 40)
    if padded:
        mask[1, :7] = 0
    return model, rec, ids, mask


@pytest.mark.parametrize("arch,padded", [("llama", False), ("llama", True), ("gemma3", False)])
def test_full_precision_prefill_equals_the_reference(arch, padded, monkeypatch):
    """A prompt's own attention through SDPA (no (T, T) matrix, what makes 32k prompts fit) gives the
    online-softmax reference's logits in float64: plain, left-padded (padded rows go through
    their own layers) and with a sliding-window layer; sinks included."""
    import kvcalib.runtime.reference as ref
    from kvcalib.runtime.cache import CompressedCache

    model, rec, ids, mask = _prefill_case(arch, padded, seed=8)
    calls = []
    real = ref.full_precision_prefill

    def spy(*a, **k):
        out = real(*a, **k)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(ref, "full_precision_prefill", spy)
    with torch.no_grad():
        fast = model(input_ids=ids, attention_mask=mask, past_key_values=CompressedCache.from_recipe(model, rec)).logits
        monkeypatch.setattr(ref, "full_precision_prefill", lambda *a, **k: None)
        slow = model(input_ids=ids, attention_mask=mask, past_key_values=CompressedCache.from_recipe(model, rec)).logits
    assert any(calls)
    assert float((fast - slow).abs().max()) <= 1e-12 * float(slow.abs().max())


@pytest.mark.parametrize("arch,padded", [("llama", False), ("llama", True), ("gemma3", False)])
def test_full_precision_prefill_in_query_chunks_is_the_same(arch, padded, monkeypatch):
    """Query rows chunked to bound the score matrix (what keeps a 32k prompt's math-kernel fallback
    under PREFILL_SCORE_BYTES) give the unchunked result in float64: causal, left-padded and with a
    sliding-window layer."""
    import kvcalib.runtime.reference as ref
    from kvcalib.runtime.cache import CompressedCache

    model, rec, ids, mask = _prefill_case(arch, padded, seed=9)
    sdpa_calls = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting_sdpa(*a, **k):
        sdpa_calls.append(a[0].shape[-2])
        return real_sdpa(*a, **k)

    with torch.no_grad():
        whole = model(input_ids=ids, attention_mask=mask, past_key_values=CompressedCache.from_recipe(model, rec)).logits
        # 2 rows x 4 heads x 40 keys x 8 bytes x 7 rows: chunks of 7 query rows (as float32 on CUDA
        # would chunk them; the CPU attends a causal prompt whole)
        monkeypatch.setattr(ref, "PREFILL_SCORE_BYTES", 2 * 4 * 40 * 8 * 7)
        monkeypatch.setattr(ref, "CPU_CAUSAL_WHOLE", False)
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting_sdpa)
        chunked = model(input_ids=ids, attention_mask=mask, past_key_values=CompressedCache.from_recipe(model, rec)).logits
    assert sdpa_calls and max(sdpa_calls) < 40  # the prompt went through in chunks
    assert float((chunked - whole).abs().max()) <= 1e-12 * float(whole.abs().max())


def test_long_context_benchmark_plots_every_recipe_of_the_merged_rows(tmp_path):
    """benchmarks/long_context.py draws one PNG per model and context from the merged rows, so a run
    that adds one recipe redraws the whole plot (not only its own recipes)."""
    from benchmarks.long_context import merge, plot

    def row(recipe, context, bits):
        return {"model": "m", "context": context, "recipe": recipe, "metric": "ppl", "effective_bits": bits,
                "ppl": 1.1, "ppl_fp": 1.0, "delta_pct": 10.0,
                "by_position": [{"start": 0, "end": 8, "delta_pct": 1.0}, {"start": 8, "end": 16, "delta_pct": 2.0}]}

    path = tmp_path / "long_context.json"
    merge([row("kivi-2", 16, 3.0), row("recipes/m/a/recipe.safetensors", 16, 2.9)], path)
    rows = merge([row("recipes/m/b/recipe.safetensors", 16, 2.8), row("kivi-2", 32, 3.0)], path)
    assert len(rows) == 4
    pngs = plot(rows, tmp_path)
    assert sorted(p.name for p in pngs) == ["long_context_m_16.png", "long_context_m_32.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)


@pytest.mark.parametrize("padded", [False, True])
def test_a_causal_prompt_on_the_cpu_is_one_call(padded, monkeypatch):
    """On the CPU a causal prompt (a padded row's too) attends in one call per row and layer even
    past PREFILL_SCORE_BYTES (the chunks' masks cost 2.5x the time there, and its flash kernel
    holds no (T, T) scores), with the chunked result in float64."""
    import kvcalib.runtime.reference as ref
    from kvcalib.runtime.cache import CompressedCache

    model, rec, ids, mask = _prefill_case("llama", padded, seed=11)
    calls = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting_sdpa(*a, **k):
        calls.append(a[0].shape[-2])
        return real_sdpa(*a, **k)

    reads = []
    real_read = ref._lower_triangular

    def counting_read(visible):
        reads.append(visible.shape[-1])
        return real_read(visible)

    monkeypatch.setattr(ref, "PREFILL_SCORE_BYTES", 2 * 4 * 40 * 8 * 7)
    monkeypatch.setattr(ref, "_lower_triangular", counting_read)
    with torch.no_grad():
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting_sdpa)
        whole = model(input_ids=ids, attention_mask=mask, past_key_values=CompressedCache.from_recipe(model, rec)).logits
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", real_sdpa)
    # the layers share the model's mask: each padded row's slice is read once per forward, not per layer
    assert sorted(reads) == ([33, 40] if padded else [])
    with torch.no_grad():
        monkeypatch.setattr(ref, "CPU_CAUSAL_WHOLE", False)
        chunked = model(input_ids=ids, attention_mask=mask, past_key_values=CompressedCache.from_recipe(model, rec)).logits
    lengths = [33, 40] if padded else [40]  # a padded batch attends row by row
    assert sorted(set(calls)) == lengths and len(calls) == len(lengths) * model.config.num_hidden_layers
    real = mask.bool()
    assert float((whole - chunked).abs()[real].max()) <= 1e-12 * float(chunked.abs()[real].max())


def test_half_precision_prompt_attends_causally_in_its_dtype(monkeypatch):
    """A bfloat16 model's prompt attends over its own uncompressed K/V in bfloat16, as the model's
    SDPA attention does (float32 there took a 16k prompt off the flash kernels), in one causal call
    per row even where float32 would chunk the query rows: a left-padded row's slice of the batch's
    mask is recognised as causal, so it takes the call its prompt alone takes. The logits stay
    within bfloat16 rounding of the float32 path's."""
    import kvcalib.runtime.reference as ref
    from kvcalib.runtime.cache import CompressedCache

    model, rec, ids, mask = _prefill_case("llama", True, seed=10)
    model = model.to(torch.bfloat16)
    calls = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, is_causal=False, **kw):
        calls.append((q.dtype, q.shape[-2], attn_mask is None, is_causal))
        return real_sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)

    monkeypatch.setattr(ref, "PREFILL_SCORE_BYTES", 2 * 4 * 40 * 8 * 7)  # float32 would chunk by 7 rows
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    with torch.no_grad():
        half = model(input_ids=ids, attention_mask=mask, past_key_values=CompressedCache.from_recipe(model, rec)).logits
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", real_sdpa)
    layers = model.config.num_hidden_layers
    # per layer: row 0 (40 tokens) and row 1 (33 real tokens), each one unmasked causal call in bfloat16
    assert sorted(calls) == sorted([(torch.bfloat16, 40, True, True), (torch.bfloat16, 33, True, True)] * layers)
    monkeypatch.setattr(ref, "full_precision_prefill", lambda *a, **k: None)  # the float32 reference instead
    with torch.no_grad():
        exact = model(input_ids=ids, attention_mask=mask, past_key_values=CompressedCache.from_recipe(model, rec)).logits
    real = mask.bool()  # (2, 40): padding positions' logits are not compared
    diff = (half.float() - exact.float()).abs()[real]
    assert float(diff.max()) <= 0.05 * float(exact.float().abs()[real].max())


def test_is_causal_reads_a_slice_of_a_padded_mask():
    from kvcalib.runtime.reference import _is_causal

    tri = torch.ones(5, 5, dtype=torch.bool).tril()[None]  # (1, 5, 5)
    assert _is_causal(tri)
    leaked = tri.clone()
    leaked[0, 1, 3] = True  # a later key visible
    hidden = tri.clone()
    hidden[0, 4, 0] = False  # an earlier key hidden (a custom mask)
    assert not _is_causal(leaked) and not _is_causal(hidden)
    assert not _is_causal(torch.ones(1, 3, 5, dtype=torch.bool).tril())  # not square


def test_is_causal_in_row_chunks_is_the_same(monkeypatch):
    """Read in chunks of 2 query rows (what bounds the check's memory at long prompts), the same
    answers, including a later key visible in the last chunk's rows only."""
    import kvcalib.runtime.reference as ref

    monkeypatch.setattr(ref, "CAUSAL_CHECK_ELEMENTS", 2 * 5)
    tri = torch.ones(5, 5, dtype=torch.bool).tril()[None]  # (1, 5, 5)
    late = tri.clone()
    late[0, 3, 4] = True
    assert ref._is_causal(tri) and not ref._is_causal(late)
