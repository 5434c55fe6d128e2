"""CompressedCache: generate() unchanged, padding, GQA/MQA/sliding, bytes, no materialisation,
and the decode-faithful simulation equal to a real token-by-token decode."""

from __future__ import annotations

import pytest
import torch

from kvcalib.errors import KvcalibError
from kvcalib.models import model_info
from kvcalib.layout import LayerConfig, layer_bytes
from kvcalib.recipe import Recipe
from kvcalib.runtime.cache import CompressedCache, _reachable_tensors
from kvcalib.simulate import simulated_logits
from tests.conftest import TINY_ARCHS, tiny_model

SMALL = LayerConfig(k_bits=2, v_bits=2, k_group=8, v_group=8, window=8, sinks=2)
PER_TOKEN = LayerConfig(k_bits=4, v_bits=2, k_axis="token", k_group=8, v_group=16, window=0)
THREE_BIT = LayerConfig(k_bits=3, v_bits=3, k_group=8, v_group=8, window=8, sinks=2)  # the 2-bit + 1-bit planes


def recipe(cfg: LayerConfig) -> Recipe:
    return Recipe(name="test", default_layer=cfg)


def decode_logits(model, ids, rec, prompt_len, prompt_logits: int = 0):
    """Prefill ``prompt_len`` tokens, then feed the rest one by one; logits (B, T, V), or with
    ``prompt_logits`` N > 0 only the prompt's last N positions' (B, N + T - prompt_len, V): a 4k
    prompt's logits over the whole vocabulary are 1.6 GB in float64, and a test reads the last one."""
    cache = CompressedCache.from_recipe(model, rec)
    outs = []
    with torch.no_grad():
        outs.append(model(input_ids=ids[:, :prompt_len], past_key_values=cache,
                          logits_to_keep=prompt_logits).logits.float())
        for i in range(prompt_len, ids.shape[1]):
            outs.append(model(input_ids=ids[:, i:i + 1], past_key_values=cache).logits.float())
    return torch.cat(outs, 1), cache


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_fp16_preset_generates_exactly_like_dynamic_cache(arch):
    model = tiny_model(arch)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    ref = model.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    cache = CompressedCache.from_recipe(model, "fp16")
    out = model.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False, past_key_values=cache)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize("cfg", [SMALL, PER_TOKEN, THREE_BIT], ids=["kivi-like", "per-token", "3-bit"])
@pytest.mark.parametrize("prompt_len", [1, 21])
def test_simulation_matches_token_by_token_decode(arch, cfg, prompt_len):
    model = tiny_model(arch)
    ids = torch.randint(0, 128, (1, 70), generator=torch.Generator().manual_seed(1))
    dec, _ = decode_logits(model, ids, recipe(cfg), prompt_len)
    sim = simulated_logits(model, ids, [cfg] * 2, prompt_len=prompt_len)
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        full = model(input_ids=ids).logits.float()
    effect = (sim - full).abs().max()
    assert effect > 1e-2, "the recipe must change the logits, or the test proves nothing"
    assert float((sim - dec).abs().max()) < 1e-3 * max(1.0, float(effect)), "simulation == real decode"


@pytest.mark.parametrize("prompt_len", [1, 30])
def test_simulation_matches_decode_when_the_window_cuts_a_block(prompt_len):
    """A sliding window (12 tokens) shorter than the pending window plus a block (8 + 8): a block
    is flushed when part of it has left the window and the rest is still visible, so how its
    scales are fitted shows in the logits; the runtime must fit them over the whole block, as the
    simulation does (the window-hidden tokens are not padding)."""
    model = tiny_model("gemma3", sliding_window=12)
    ids = torch.randint(0, 128, (1, 70), generator=torch.Generator().manual_seed(2))
    dec, cache = decode_logits(model, ids, recipe(SMALL), prompt_len)
    assert cache.layers[0].is_sliding and cache.layers[0].sinks_dropped
    sim = simulated_logits(model, ids, [SMALL] * 2, prompt_len=prompt_len)
    assert float((sim - dec).abs().max()) < 1e-3 * max(1.0, float(sim.abs().max())), "simulation == real decode"


def test_prompt_attention_is_full_precision():
    """The prompt's own logits must not see any quantization (HF QuantizedCache's bug)."""
    model = tiny_model("llama")
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(2))
    ref = model(input_ids=ids).logits
    cache = CompressedCache.from_recipe(model, recipe(SMALL))
    with torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache).logits
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert cache.layers[0].n_packed == (40 - 2 - 8) // 8 * 8  # compressed only after attending


def test_left_padded_batch_matches_rows_alone():
    model = tiny_model("qwen2")
    g = torch.Generator().manual_seed(3)
    long, short = torch.randint(1, 128, (20,), generator=g), torch.randint(1, 128, (12,), generator=g)
    cfg = LayerConfig(k_bits=4, v_bits=4, k_group=8, v_group=8, window=8, sinks=0)
    ids = torch.stack([long, torch.cat([torch.zeros(8, dtype=torch.long), short])])  # pad = one block
    mask = (torch.arange(20)[None] >= torch.tensor([[0], [8]])).long()
    batched = model.generate(ids, attention_mask=mask, max_new_tokens=16, min_new_tokens=16, do_sample=False,
                             past_key_values=CompressedCache.from_recipe(model, recipe(cfg)), pad_token_id=0)
    for row, seq in enumerate((long, short)):
        alone = model.generate(seq[None], max_new_tokens=16, min_new_tokens=16, do_sample=False,
                               past_key_values=CompressedCache.from_recipe(model, recipe(cfg)), pad_token_id=0)
        assert torch.equal(batched[row, -16:], alone[0, -16:])


def test_right_padded_prefill_ignores_padding():
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(4)
    seq = torch.randint(1, 128, (30,), generator=g)
    ids = torch.cat([seq, torch.full((10,), 7)])[None]
    mask = torch.cat([torch.ones(30), torch.zeros(10)]).long()[None]
    cache = CompressedCache.from_recipe(model, recipe(SMALL))
    with torch.no_grad():
        padded = model(input_ids=ids, attention_mask=mask, past_key_values=cache).logits[:, :30]
    model.set_attn_implementation("sdpa")
    alone = model(input_ids=seq[None]).logits
    torch.testing.assert_close(padded, alone, atol=1e-5, rtol=1e-5)
    # padding is not held: the row holds its 30 real tokens, the bytes of the prompt alone
    alone_cache = CompressedCache.from_recipe(model, recipe(SMALL))
    with torch.no_grad():
        model(input_ids=seq[None], past_key_values=alone_cache)
    assert all(layer.ragged and layer.rows[0].n_seen == 30 for layer in cache.layers)
    assert cache.nbytes() == alone_cache.nbytes()


def test_mqa_and_gqa_shapes():
    for heads, kv in ((4, 1), (6, 2), (7, 7)):
        model = tiny_model("llama", heads=heads, kv_heads=kv)
        ids = torch.randint(0, 128, (1, 40))
        out = model.generate(ids, max_new_tokens=5, do_sample=False,
                             past_key_values=CompressedCache.from_recipe(model, recipe(SMALL)))
        assert out.shape == (1, 45)


def test_sliding_layer_keeps_only_its_window():
    model = tiny_model("gemma3", sliding_window=8)
    cache = CompressedCache.from_recipe(model, recipe(SMALL))
    model.generate(torch.randint(0, 128, (1, 10)), max_new_tokens=60, min_new_tokens=60,
                   do_sample=False, past_key_values=cache)
    sliding, full = cache.layers[0], cache.layers[1]
    assert sliding.is_sliding and not full.is_sliding
    assert sliding.n_packed <= 16 and full.n_packed == (70 - 1 - 2 - 8) // 8 * 8
    assert sliding.nbytes()["k_packed"] < full.nbytes()["k_packed"]
    assert not sliding.ragged  # what the window hides is not padding (it would skew the block stats)


def test_sliding_layer_marks_only_real_padding():
    """transformers' mask of a sliding layer hides the positions out of its window: only those a
    query could see through the window tell padding apart, so the packed blocks of a padded and
    an unpadded row are quantized alike (as the decode-faithful simulation does)."""
    model = tiny_model("gemma3", sliding_window=8)
    cache = CompressedCache.from_recipe(model, recipe(SMALL))
    ids = torch.randint(0, 128, (2, 10))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    model.generate(ids, attention_mask=mask, max_new_tokens=30, min_new_tokens=30, do_sample=False,
                   past_key_values=cache)
    for layer in cache.layers:
        expected = torch.ones((2, layer.n_seen), dtype=torch.bool)
        expected[1, :3] = False
        assert torch.equal(layer.padding_mask(), expected), layer.layer_idx
        assert [row.n_seen for row in layer.rows] == [layer.n_seen, layer.n_seen - 3]


@pytest.mark.parametrize("cfg", [SMALL, THREE_BIT], ids=["2-bit", "3-bit"])
def test_bytes_match_the_accounting(cfg):
    model = tiny_model("llama").to(torch.bfloat16)  # 16-bit storage, as accounted
    cache = CompressedCache.from_recipe(model, recipe(cfg))
    model.generate(torch.randint(0, 128, (1, 16)), max_new_tokens=50, min_new_tokens=50,
                   do_sample=False, past_key_values=cache)
    t = cache.layers[0].n_seen
    info = model_info(model.config, "tiny")
    want = sum(sum(layer_bytes(cfg, info.num_kv_heads, info.head_dim, t).values()) for _ in range(2))
    held = cache.nbytes()
    # held on top of the accounting: the pending window's fixed buffer (window + one block) has
    # free slots until its next flush (bf16 K and V)
    free = sum(2 * (layer.static_capacity - layer.pend_k.shape[-2]) * info.num_kv_heads * info.head_dim * 2
               for layer in cache.layers)
    assert held.pop("window_free") == free > 0
    assert sum(held.values()) == want
    assert cache.effective_bits() < 16


def test_attention_never_materialises_the_whole_cache(monkeypatch):
    """Dequantized tokens held at once stay at one segment, whatever the cached length."""
    from kvcalib.runtime import cache as cache_mod

    model = tiny_model("llama")
    cfg = LayerConfig(k_bits=4, v_bits=4, k_group=8, v_group=8, window=8)
    peak = {"tokens": 0}
    orig = cache_mod.CompressedLayer.segments

    def spy(self, block_tokens=64, dtype=torch.float32):
        for seg in orig(self, 64, dtype):
            if seg.positions is None and self.cfg.sinks <= seg.start < self.pend_start:  # dequantized packed run
                peak["tokens"] = max(peak["tokens"], seg.k.shape[-2])
            yield seg

    monkeypatch.setattr(cache_mod.CompressedLayer, "segments", spy)
    cache = CompressedCache.from_recipe(model, recipe(cfg))
    model.generate(torch.randint(0, 128, (1, 8)), max_new_tokens=300, min_new_tokens=300,
                   do_sample=False, past_key_values=cache)
    assert cache.layers[0].n_packed >= 280
    assert 0 < peak["tokens"] <= 64


def test_cache_refuses_non_kvcalib_attention():
    model = tiny_model("llama")
    cache = CompressedCache.from_recipe(model, recipe(SMALL))
    model.set_attn_implementation("sdpa")
    with pytest.raises(KvcalibError, match="kvcalib"):
        model.generate(torch.randint(0, 128, (1, 8)), max_new_tokens=3, past_key_values=cache)


def test_triton_path_covers_centred_permuted_and_clipped_layers(monkeypatch):
    """TaDA means, SKVQ permutations, clipping and OTT pools all run in the fused kernel (the
    kernel tests compare it with the reference; PATS tiers: tests/unit/test_outlier_runtime.py)."""
    pytest.importorskip("triton")
    from kvcalib.runtime.cache import CompressedLayer
    from kvcalib.codec import LayerCodec
    from kvcalib.runtime.triton_path import _reason_unsupported

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg = LayerConfig(k_bits=4, v_bits=4, k_group=32, v_group=32, window=32)
    perm = torch.stack([torch.randperm(64) for _ in range(2)])
    for codec in (LayerCodec(cfg, v_center=8), LayerCodec(cfg, k_center=16, v_perm=perm, k_perm=perm),
                  LayerCodec(cfg, v_clip=0.9), LayerCodec(cfg, outlier_pool=4)):
        layer = CompressedLayer(cfg, codec)
        layer.update(torch.randn(1, 2, 80, 64), torch.randn(1, 2, 80, 64))
        layer.flush()
        assert _reason_unsupported(torch.randn(1, 4, 1, 64), layer) is None


def test_three_bit_layers_run_in_the_kernel():
    """3-bit codes decode in the fused kernel (a 2-bit tile plus its high-bit tile) wherever their
    2-bit planes would: the kernel check passes at head_dim 64, and refuses 3 bits exactly where it
    refuses 2 (code planes of fewer than 16 bytes, head_dim 16 of the tiny models)."""
    pytest.importorskip("triton")
    from kvcalib.codec import LayerCodec
    from kvcalib.runtime.cache import CompressedLayer
    from kvcalib.runtime.triton_path import _check_supported

    for bits, d, supported in ((3, 64, True), (3, 16, False), (2, 16, False)):
        cfg = LayerConfig(k_bits=bits, v_bits=bits, k_group=16, v_group=16, window=16, sinks=2)
        layer = CompressedLayer(cfg, LayerCodec(cfg))
        layer.update(torch.randn(1, 2, 60, d), torch.randn(1, 2, 60, d))  # (B, H, T, D)
        layer.flush()
        why = _check_supported(torch.zeros(1, 4, 1, d), layer, interp=True)  # (B, Hq, 1, D)
        assert (why is None) == supported, why
        if not supported:
            assert "fewer than 16 bytes" in why


def test_a_layer_on_the_reference_path_says_so_once(caplog, monkeypatch):
    """A layer whose layout the kernel does not read (here a 16-bit value side) still decodes (the
    reference path) and says so once, with the reason, however many steps run; a layer the kernel
    reads says nothing."""
    import logging

    pytest.importorskip("triton")
    from kvcalib.codec import LayerCodec
    from kvcalib.runtime.cache import CompressedLayer
    from kvcalib.runtime.triton_path import _reason_unsupported

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the kernel's checks as on a GPU
    for v_bits, says in ((16, True), (2, False)):
        cfg = LayerConfig(k_bits=2, v_bits=v_bits, k_group=16, v_group=16, window=16, sinks=2)
        layer = CompressedLayer(cfg, LayerCodec(cfg))
        layer.layer_idx = 5
        layer.update(torch.randn(1, 2, 60, 64), torch.randn(1, 2, 60, 64))  # (B, H, T, D)
        layer.flush()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvcalib.runtime.triton_path"):
            for steps in range(3):
                layer.__dict__.pop("_kernel_reason", None)  # a new step signature each time: checked again
                _reason_unsupported(torch.zeros(1, 4, 1, 64), layer)  # (B, Hq, 1, D), under the interpreter
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == int(says), lines
        if says:
            assert "layer 5 decodes on the PyTorch reference path" in lines[0] and "not packed" in lines[0]


def _fed_cache(configs, tokens=300, batch=2, heads=2, dim=64):
    """A cache whose layers took ``tokens`` tokens of random K/V and flushed (no model)."""
    torch.manual_seed(0)
    cache = CompressedCache(configs)
    for layer in cache.layers:
        layer.update(torch.randn(batch, heads, tokens, dim), torch.randn(batch, heads, tokens, dim))
        layer.flush()
    return cache


def test_allocated_bytes_count_each_storage_once_and_whole():
    """allocated_bytes = the live bytes nbytes() counts + the packed stores' capacity past their live
    tokens + their small device counters: the pending window (a view of its fixed buffer) is not
    counted twice, and the slack is counted."""
    cfg = LayerConfig(k_bits=2, v_bits=2, k_group=32, v_group=32, sinks=4, window=64)
    cache = _fed_cache([cfg, cfg])
    held = sum(cache.nbytes().values())
    allocated = cache.allocated_bytes()
    slack = sum((part.buf.numel() - part.view().numel()) * part.buf.element_size()
                for layer in cache.layers for store in layer.packed.stores
                for part in store.parts.values() if part.buf is not None)
    assert slack > 0  # 224 live packed tokens a layer, capacity 352 (four 32-token blocks of slack)
    assert allocated["side"] == 0  # no fitted tensors in a plain layout
    counters = allocated["kv"] - held - slack
    assert 0 <= counters <= 64, (allocated, held, slack)


def test_allocated_bytes_side_tensors_and_joined_rows():
    """A recipe's fitted tensors count as side bytes; a padded batch's rows joined in shared
    allocations (runtime/joint.py) count those allocations once, not once per row."""
    layer_cfg = LayerConfig(k_bits=2, v_bits=4, k_group=16, v_group=16, window=16, sinks=4)
    recipe = Recipe(name="clip", layers=[layer_cfg, layer_cfg],
                    tensors={f"layers.{i}.{s}.clip": torch.tensor([[0.85], [0.7]]) for i in (0, 1) for s in "kv"})
    model = tiny_model("llama", head_dim=64, heads=4, kv_heads=2)
    lens = (50, 23, 37)
    ids = torch.stack([torch.cat([torch.zeros(50 - n, dtype=torch.long), torch.arange(1, n + 1)]) for n in lens])
    mask = (torch.arange(50)[None] >= torch.tensor([[50 - n] for n in lens])).long()
    cache = CompressedCache.from_recipe(model, recipe)
    model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=2, do_sample=False)
    assert cache.allocated_bytes()["side"] > 0
    layer = cache.layers[0]
    assert layer.rows is not None
    before = cache.allocated_bytes()["kv"]  # the rows in their own allocations
    if layer.joined() is None:
        pytest.skip("these rows do not join here")
    joint = layer.joint
    assert all(row.sink_k._base is joint.sink_k and row.pend_buf_k._base is joint.pend_k for row in layer.rows)
    shared = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
              for t in _reachable_tensors(joint, set())}
    after = cache.allocated_bytes()["kv"]
    # the joint's allocations once (the rows' private ones are gone); once per row would add
    # (rows - 1) x them, far past this bound
    assert sum(shared.values()) <= after <= before + sum(shared.values())
    assert after >= sum(cache.nbytes().values())
