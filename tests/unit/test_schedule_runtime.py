"""PATS tiers in the runtime: blocks requantized in packed storage as they age, the simulation
(chain of requantizations) equal to a real decode, with and without OTT, honest bytes, clear
errors for bad schedules, and the Triton path declining tiered layers."""

from __future__ import annotations

import pytest
import torch

from kvcalib.methods.schedule import Schedule, requantize, tier_token_counts
from kvcalib.errors import RecipeError
from kvcalib.models import model_info
from kvcalib.quant.uniform import quantize_keys, quantize_values
from kvcalib.layout import LayerConfig
from kvcalib.recipe import Recipe
from kvcalib.runtime.cache import CompressedCache, CompressedLayer
from kvcalib.codec import LayerCodec
from kvcalib.recipe import build_codecs
from kvcalib.simulate import simulated_logits
from tests.conftest import tiny_model
from tests.unit.test_cache import decode_logits

# small ages so that tiers change within an 80-token test sequence; K and V drop at different ages
CFG = LayerConfig(k_bits=8, v_bits=4, k_group=8, v_group=8, window=8, sinks=2)
TIERS = [[0, 16, 16], [8, 8, 4], [24, 4, 4], [48, 2, 2]]
TOKEN_K = LayerConfig(k_bits=8, v_bits=8, k_axis="token", k_group=8, v_group=8, window=8)
TOKEN_TIERS = [[0, 16, 16], [8, 8, 8], [20, 4, 2]]
# a 3-bit layer (3 bits joined the default search space, and from_layer halves 3 to 2)
THREE = LayerConfig(k_bits=3, v_bits=3, k_group=8, v_group=8, window=8, sinks=2)
THREE_TIERS = [[0, 16, 16], [8, 3, 3], [24, 2, 3], [48, 2, 2]]


def tier_recipe(cfg: LayerConfig, tiers, pools=None) -> Recipe:
    tensors = {f"layers.{i}.kv.schedule": torch.tensor(tiers) for i in range(2)}
    if pools:
        tensors.update({f"layers.{i}.kv.outlier_pool": torch.tensor(pools) for i in range(2)})
    return Recipe(name="pats", layers=[cfg, cfg], tensors=tensors)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("case", ["schedule", "schedule+outliers", "token-keys", "three-bit"])
@pytest.mark.parametrize("prompt_len", [1, 70])  # 70: a fresh block jumps straight to the last tier
def test_simulation_matches_decode_with_tiers(arch, case, prompt_len):
    cfg, tiers = {"token-keys": (TOKEN_K, TOKEN_TIERS), "three-bit": (THREE, THREE_TIERS)}.get(case, (CFG, TIERS))
    model = tiny_model(arch).double()
    ids = torch.randint(0, 128, (1, 90), generator=torch.Generator().manual_seed(1))
    rec = tier_recipe(cfg, tiers, pools=3 if case == "schedule+outliers" else None)
    dec, cache = decode_logits(model, ids, rec, prompt_len)
    sim = simulated_logits(model, ids, [cfg] * 2, build_codecs(rec, [cfg] * 2, 16), prompt_len=prompt_len)
    flat = simulated_logits(model, ids, [cfg] * 2, prompt_len=prompt_len)
    scale = float(dec.abs().max())
    assert float((sim - dec).abs().max()) <= 1e-6 * scale
    assert float((sim - flat).abs().max()) > 1e-3 * scale, "the tiers must change the logits"
    assert cache.layers[1].packed.stores[-1].n > 0, "some block reached the last tier"


def test_blocks_sit_in_their_tier_and_hold_the_requantized_chain():
    """After every step at context T each block [s, e) is in the store of block_tier(e, T), and
    its codes are exactly quantize -> requantize -> ... of its tokens (bit-exact)."""
    sched = Schedule.from_tensor(torch.tensor(TIERS), sinks=CFG.sinks)
    layer = CompressedLayer(CFG, LayerCodec(CFG, schedule=sched))
    g = torch.Generator().manual_seed(0)
    ks, vs = [], []
    for step, t_new in enumerate([13] + [1] * 70):
        k, v = torch.randn(1, 2, t_new, 16, generator=g) * 3, torch.randn(1, 2, t_new, 16, generator=g)
        ks.append(k)
        vs.append(v)
        layer.update(k, v)
        layer.flush()
        ctx = layer.n_seen
        counts = tier_token_counts(sched, ctx, CFG.k_group)["tiers"][1:]  # stored tiers only
        assert [s.n for s in layer.packed.stores] == counts, f"context {ctx}"
        for u, store in enumerate(layer.packed.stores):
            for a in range(0, store.n, 8):
                assert sched.block_tier(store.start + a + 8, ctx) - 1 == u
    k_all, v_all = torch.cat(ks, 2), torch.cat(vs, 2)  # (1, 2, 84, 16)
    last = layer.packed.stores[-1]
    assert last.n and last.bits == {"k": 2, "v": 2}
    x_k, x_v = k_all[:, :, last.start:last.start + last.n], v_all[:, :, last.start:last.start + last.n]
    want_k = requantize(requantize(quantize_keys(x_k, 8, 8), 4), 2)  # K: 8 -> 4 -> 2
    want_v = requantize(quantize_values(x_v, 4, 8), 2)  # V: 4 -> (4) -> 2
    got_k, got_v = last.block("k", 0, last.n).quantized, last.block("v", 0, last.n).quantized
    assert torch.equal(got_k.codes, want_k.codes) and torch.equal(got_k.scale, want_k.scale)
    assert torch.equal(got_v.codes, want_v.codes) and torch.equal(got_v.zero, want_v.zero)
    assert got_k.codes.shape[-1] == 16 * 2 // 8, "2-bit codes: the storage really shrank"


def test_benchmark_fill_puts_blocks_where_the_runtime_does():
    """benchmarks/e2e.py's direct cache fill (no 32k prefill: each block quantized at its tier's bits)
    gives every stored tier the tokens the runtime's flushes and tier moves give it."""
    from benchmarks.e2e import tier_ranges

    sched = Schedule.from_tensor(torch.tensor(TIERS), sinks=CFG.sinks)
    layer = CompressedLayer(CFG, LayerCodec(CFG, schedule=sched))
    g = torch.Generator().manual_seed(0)
    moved = False
    for t_new in [13] + [1] * 70:
        layer.update(torch.randn(1, 2, t_new, 16, generator=g), torch.randn(1, 2, t_new, 16, generator=g))
        layer.flush()
        got = [(s.start, s.start + s.n) for s in layer.packed.stores if s.n]
        want = [(lo, hi) for _, lo, hi in tier_ranges(layer, CFG.sinks, layer.packed.n, layer.n_seen) if hi > lo]
        assert got == want, f"context {layer.n_seen}"
        moved |= len(got) > 2
    assert moved, "blocks reached at least three tiers"
    flat = CompressedLayer(CFG, LayerCodec(CFG))
    flat.update(torch.randn(1, 2, 40, 16, generator=g), torch.randn(1, 2, 40, 16, generator=g))
    flat.flush()
    assert [(lo, hi) for _, lo, hi in tier_ranges(flat, CFG.sinks, flat.packed.n, 40)] == [(2, 2 + flat.packed.n)]


def test_bytes_match_the_accounting_with_tiers_and_outliers():
    model = tiny_model("llama").to(torch.bfloat16)  # 16-bit storage, as accounted
    info = model_info(model.config, "tiny")
    rec = tier_recipe(CFG, TIERS, pools=2)
    cache = CompressedCache.from_recipe(model, rec)
    model.generate(torch.randint(0, 128, (1, 16)), max_new_tokens=70, min_new_tokens=70,
                   do_sample=False, past_key_values=cache)
    t = cache.layers[0].n_seen
    mem = rec.memory(info, t).components
    mem.pop("recipe_state")
    held = cache.nbytes()
    held.pop("window_free")  # the window buffer's free slots: held, not in the accounting
    assert sum(held.values()) == sum(mem.values())
    assert held["k_packed"] == mem["k_codes"] and held["v_scales"] == mem["v_scales"]
    flat = Recipe(name="flat", layers=[CFG, CFG], tensors={k: v for k, v in rec.tensors.items() if "pool" in k})
    assert rec.memory(info, 4096).effective_bits < flat.memory(info, 4096).effective_bits - 1.0


@pytest.mark.parametrize("tiers, match", [
    ([[0, 16, 16], [8, 4, 4], [24, 8, 8]], "may not increase"),  # bits increasing with age
    ([[0, 16, 16], [8, 8, 4], [8, 4, 4]], "strictly increase"),  # ages not increasing
    ([[0, 16, 16], [16, 8, 4], [48, 2, 2]], "window"),  # first quantized tier at another age
    ([[0, 16, 16], [8, 4, 4], [48, 2, 2]], "k_bits"),  # first quantized tier at other bits
    ([[0.0, 16.0, 16.0], [8.0, 8.0, 4.0]], "integer"),
    ([[0, 16], [8, 8]], r"\(N, 3\)"),
])
def test_bad_schedule_tensor_is_refused_by_name(tiers, match):
    rec = Recipe(name="bad", layers=[CFG, CFG], tensors={"layers.1.kv.schedule": torch.tensor(tiers)})
    info = model_info(tiny_model("llama").config, "tiny")
    for call in (lambda: build_codecs(rec, [CFG, CFG]), lambda: rec.memory(info)):
        with pytest.raises(RecipeError, match=match) as err:
            call()
        assert "layers.1.kv.schedule" in str(err.value)


def test_schedule_sinks_come_from_the_layer_and_side_is_checked():
    no_sinks = LayerConfig(k_bits=8, v_bits=4, k_group=8, v_group=8, window=8)
    rec = tier_recipe(no_sinks, TIERS)
    codecs = build_codecs(rec, [no_sinks] * 2)
    assert codecs[0].state("schedule").schedule.sinks == 0 and codecs[0].tiers == [(8, 8, 4), (24, 4, 4), (48, 2, 2)]
    rec = Recipe(name="bad", layers=[CFG, CFG], tensors={"layers.0.v.schedule": torch.tensor(TIERS)})
    with pytest.raises(RecipeError, match=r"layers\.0\.kv\.schedule"):
        build_codecs(rec, [CFG, CFG])


def test_tiered_layers_have_no_single_packed_view():
    """One store per tier: the kernels read them one call per store (tests/kernels), never as one view."""
    sched = Schedule.from_tensor(torch.tensor(TIERS), sinks=CFG.sinks)
    layer = CompressedLayer(CFG, LayerCodec(CFG, schedule=sched))
    layer.update(torch.randn(1, 2, 60, 64), torch.randn(1, 2, 60, 64))
    layer.flush()
    assert len({s.bits["k"] for s in layer.packed.stores if s.n}) > 1
    with pytest.raises(Exception, match="tier"):
        layer.packed_view()
