"""OTT in the runtime: pools and masks in CompressedCache, the simulation equal to a real decode,
every token seen exactly once, honest bytes, clear errors, and the Triton path declining."""

from __future__ import annotations

import pytest
import torch

from kvcalib.methods.outliers import EXTRA_CAPACITY, trace_outliers
from kvcalib.errors import RecipeError
from kvcalib.models import model_info
from kvcalib.layout import LayerConfig
from kvcalib.recipe import Recipe
from kvcalib.runtime.reference import attend_compressed
from kvcalib.runtime.cache import CompressedCache, CompressedLayer
from kvcalib.codec import LayerCodec
from kvcalib.runtime.outlier_pool import pack_keep, unpack_keep
from kvcalib.recipe import build_codecs
from kvcalib.simulate import simulated_logits
from tests.conftest import tiny_model
from tests.unit.test_cache import decode_logits

CFG = LayerConfig(k_bits=2, v_bits=2, k_group=8, v_group=8, window=8, sinks=2)
TOKEN_K = LayerConfig(k_bits=4, v_bits=2, k_axis="token", k_group=8, v_group=16, window=0)


def ott_recipe(cfg: LayerConfig, pools=(3, 3)) -> Recipe:
    tensors = {f"layers.{i}.kv.outlier_pool": torch.tensor(p) for i, p in enumerate(pools)}
    return Recipe(name="ott", layers=[cfg] * len(pools), tensors=tensors)


@pytest.mark.parametrize("g", [1, 3, 8, 13, 32])
def test_keep_masks_pack_bit_exact(g):
    keep = torch.rand(2, 3, 4 * g, generator=torch.Generator().manual_seed(g)) > 0.3  # (B, H, 4 blocks)
    packed = torch.cat([pack_keep(keep[..., i * g:(i + 1) * g]) for i in range(4)], dim=-1)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 3, 4 * ((g + 7) // 8))
    assert torch.equal(unpack_keep(packed, g), keep)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("cfg", [CFG, TOKEN_K], ids=["channel-keys", "token-keys"])
@pytest.mark.parametrize("prompt_len", [1, 37])
def test_simulation_matches_decode_with_outliers(arch, cfg, prompt_len):
    """float64: the two paths agree to the float32 rounding of the decoded logits."""
    model = tiny_model(arch).double()
    ids = torch.randint(0, 128, (1, 80), generator=torch.Generator().manual_seed(1))
    rec = ott_recipe(cfg)
    dec, cache = decode_logits(model, ids, rec, prompt_len)
    sim = simulated_logits(model, ids, [cfg] * 2, build_codecs(rec, [cfg] * 2, 16), prompt_len=prompt_len)
    plain = simulated_logits(model, ids, [cfg] * 2, prompt_len=prompt_len)
    scale = float(dec.abs().max())
    assert float((sim - dec).abs().max()) <= 1e-6 * scale
    assert float((sim - plain).abs().max()) > 1e-3 * scale, "the pools must change the logits"
    assert cache.layers[1].outliers.state is not None


def test_every_token_seen_exactly_once_and_pool_tokens_are_full_precision():
    """Per (row, kv head): sinks + packed slots with keep + pools + window partition the positions;
    a pool token's K/V is bit-identical to what the model produced."""
    g = torch.Generator().manual_seed(7)
    layer = CompressedLayer(CFG, LayerCodec(CFG, outlier_pool=3))
    ks, vs = [], []
    for t_new in [21] + [1] * 60:
        k, v = torch.randn(2, 3, t_new, 16, generator=g), torch.randn(2, 3, t_new, 16, generator=g)
        ks.append(k)
        vs.append(v)
        layer.update(k, v)
        layer.flush()
    k_all, v_all = torch.cat(ks, 2), torch.cat(vs, 2)  # (B, H, 81, D)
    n = layer.n_seen
    store = layer.packed.stores[0]
    keep = store.keep(0, store.n)  # (B, H, N)
    state = layer.outliers.state
    for b in range(2):
        for h in range(3):
            seen = list(range(CFG.sinks)) + list(range(layer.pend_start, n))
            seen += [store.start + j for j in range(store.n) if keep[b, h, j]]
            pool = [p for p in torch.cat([state.pool_pos[b, h], state.extra_pos[b, h]]).tolist() if p >= 0]
            assert sorted(seen + pool) == list(range(n)), "every token exactly once"
            assert len(pool) >= 3
            for slot, p in enumerate(state.pool_pos[b, h].tolist()):
                if p >= 0:
                    assert torch.equal(state.pool_k[b, h, slot], k_all[b, h, p])
                    assert torch.equal(state.pool_v[b, h, slot], v_all[b, h, p])
    # the runtime's selection is trace_outliers' selection (what the simulation uses)
    fp, _ = trace_outliers(k_all[:, :, CFG.sinks:CFG.sinks + store.n], CFG.flush_block, 3, EXTRA_CAPACITY,
                           start=CFG.sinks)
    assert torch.equal(~fp, keep)


def test_planted_outliers_go_to_the_pool_and_cut_attention_error():
    """Keys with a large channel and one tiny-norm token per group: the pool catches the tiny
    tokens, and attention over the cache gets closer to full precision than without the pool."""
    g = torch.Generator().manual_seed(3)
    b, h, t, d = 1, 2, 72, 16
    k = torch.randn(b, h, t, d, generator=g)
    k[..., 0] += 12.0
    planted = list(range(5, t - 8, 8))  # one per flushed group of 8 (sinks 0)
    for i, p in enumerate(planted):  # each smaller than the last: every one enters the pool (OTT
        k[:, :, p] *= 0.02 * 0.8 ** i  # keeps the P smallest seen, a larger one would be quantized)
    v = torch.randn(b, h, t, d, generator=g)
    q = torch.randn(b, 2 * h, 1, d, generator=g)
    cfg = LayerConfig(k_bits=2, v_bits=4, k_group=8, v_group=8, window=8)
    ref = torch.softmax(torch.einsum("bhd,bhtd->bht", q[:, :, 0], k.repeat_interleave(2, 1)) / 4, -1)
    ref = torch.einsum("bht,bhtd->bhd", ref, v.repeat_interleave(2, 1))  # (B, Hq, D)
    errs, scales, key_mse = {}, {}, {}
    for pool in (0, 3):
        layer = CompressedLayer(cfg, LayerCodec(cfg, outlier_pool=pool))
        layer.update(k, v)
        layer.flush()
        vis = torch.ones(1, 1, t, dtype=torch.bool)
        out = attend_compressed(q, layer, vis, 0.25)[:, 0]  # (B, Hq, D)
        errs[pool] = float((out - ref).abs().max())
        store = layer.packed.stores[0]
        scales[pool] = store.block("k", 0, 64).quantized.scale[..., 0].float()  # (B, H, 8)
        k_hat = layer.codec.decode_keys(store.block("k", 0, 64))  # (B, H, 64, D)
        keep = torch.ones(b, h, 64, dtype=torch.bool) if not pool else store.keep(0, 64)  # (B, H, 64)
        key_mse[pool] = float(((k_hat - k[:, :, :64]) ** 2)[keep].mean())  # over quantized slots
        if pool:
            kept = set(torch.cat([layer.outliers.state.pool_pos, layer.outliers.state.extra_pos], -1)[0, 0].tolist())
            assert set(planted) <= kept
    assert (scales[3] < 0.6 * scales[0]).all(), "the outlier channel's range excludes the pool tokens"
    assert key_mse[3] < 0.5 * key_mse[0], "the quantized tokens get a finer grid"
    assert errs[3] < 0.8 * errs[0], "and attention gets closer to full precision"


def test_left_padded_batch_matches_rows_alone_with_outliers():
    """Padding never enters the pool: a left-padded row decodes as it does alone."""
    model = tiny_model("qwen2")
    g = torch.Generator().manual_seed(3)
    long, short = torch.randint(1, 128, (20,), generator=g), torch.randint(1, 128, (12,), generator=g)
    cfg = LayerConfig(k_bits=4, v_bits=4, k_group=8, v_group=8, window=8, sinks=0)
    rec = ott_recipe(cfg)
    ids = torch.stack([long, torch.cat([torch.zeros(8, dtype=torch.long), short])])  # pad = one block
    mask = (torch.arange(20)[None] >= torch.tensor([[0], [8]])).long()
    cache = CompressedCache.from_recipe(model, rec)
    batched = model.generate(ids, attention_mask=mask, max_new_tokens=16, min_new_tokens=16, do_sample=False,
                             past_key_values=cache, pad_token_id=0)
    # padding is never held: row 1 is a layer of its own, its positions count from its first real token
    layer = cache.layers[0]
    assert layer.ragged and layer.row_first == [0, 8] and layer.rows[1].n_seen == 12 + 16 - 1
    assert layer.rows[1].outliers.state is not None
    for row, seq in enumerate((long, short)):
        alone = model.generate(seq[None], max_new_tokens=16, min_new_tokens=16, do_sample=False,
                               past_key_values=CompressedCache.from_recipe(model, rec), pad_token_id=0)
        assert torch.equal(batched[row, -16:], alone[0, -16:])


def test_bytes_match_the_accounting_with_outliers():
    model = tiny_model("llama").to(torch.bfloat16)  # 16-bit storage, as accounted
    rec = ott_recipe(CFG, pools=(0, 3))
    cache = CompressedCache.from_recipe(model, rec)
    model.generate(torch.randint(0, 128, (1, 16)), max_new_tokens=50, min_new_tokens=50,
                   do_sample=False, past_key_values=cache)
    t = cache.layers[0].n_seen
    held = cache.nbytes()
    held.pop("window_free")  # the window buffer's free slots: held, not in the accounting
    mem = rec.memory(model_info(model.config, "tiny"), t).components
    mem.pop("recipe_state")
    assert sum(held.values()) == sum(mem.values())
    slots = (3 + EXTRA_CAPACITY) * 2  # pool + extra slots per kv head (2 heads), layer 1 only
    assert held["outlier_pool"] == mem["outlier_pool"] == slots * 16 * 2 * 2  # K and V, bf16
    assert held["outlier_positions"] == slots * 4 + 2 * 9  # int32 positions + counters
    assert held["outlier_masks"] == (t - 2 - 8) // 8 * 2  # one byte per block of 8 per kv head


@pytest.mark.parametrize("tensor, match", [
    (torch.tensor(-1), "must be >= 0"),
    (torch.tensor(10**6), "<= 1024"),
    (torch.tensor(3.0), "integer scalar"),
    (torch.tensor([3, 3]), "integer scalar"),
])
def test_bad_pool_tensor_is_refused_by_name(tensor, match):
    rec = Recipe(name="bad", layers=[CFG, CFG], tensors={"layers.1.kv.outlier_pool": tensor})
    for call in (lambda: build_codecs(rec, [CFG, CFG]),
                 lambda: rec.memory(model_info(tiny_model("llama").config, "tiny"))):
        with pytest.raises(RecipeError, match=match) as err:
            call()
        assert "layers.1.kv.outlier_pool" in str(err.value)


def test_pool_on_a_full_precision_layer_or_wrong_side_is_refused():
    fp = LayerConfig()
    rec = Recipe(name="bad", layers=[fp, CFG], tensors={"layers.0.kv.outlier_pool": torch.tensor(3)})
    with pytest.raises(RecipeError, match="16 bits"):
        build_codecs(rec, [fp, CFG])
    rec = Recipe(name="bad", layers=[CFG, CFG], tensors={"layers.0.k.outlier_pool": torch.tensor(3)})
    with pytest.raises(RecipeError, match=r"layers\.0\.kv\.outlier_pool"):
        build_codecs(rec, [CFG, CFG])


def test_triton_path_takes_outlier_and_tiered_layers(monkeypatch):
    """The kernel reads OTT pools and quant masks, and PATS tiers (one call per store); a tier
    whose bits the kernel cannot read sends the layer to the reference. Decided before any
    triton import."""
    from kvcalib.methods.schedule import Schedule
    from kvcalib.runtime.triton_path import _reason_unsupported

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg2 = LayerConfig(k_bits=2, v_bits=2, k_group=16, v_group=16, window=16, sinks=2)  # a layout the kernel takes
    cfg4 = LayerConfig(k_bits=4, v_bits=4, k_group=16, v_group=16, window=16)
    for codec in (LayerCodec(cfg2, outlier_pool=3), LayerCodec(cfg4, schedule=Schedule.from_layer(cfg4, (64,)))):
        layer = CompressedLayer(codec.cfg, codec)
        layer.update(torch.randn(1, 2, 30, 64), torch.randn(1, 2, 30, 64))
        layer.flush()
        assert _reason_unsupported(torch.randn(1, 4, 1, 64), layer) is None
    codec = LayerCodec(cfg4, schedule=Schedule.from_layer(cfg4, (64,)))
    codec.tiers.append((128, 1, 4))  # a tier no kernel layout has (as a corrupt schedule could ask)
    layer = CompressedLayer(cfg4, codec)
    layer.update(torch.randn(1, 2, 30, 64), torch.randn(1, 2, 30, 64))
    assert "PATS tier at K1/V4" in _reason_unsupported(torch.randn(1, 4, 1, 64), layer)
