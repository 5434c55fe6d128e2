"""Collection records exactly what the cache stores, without padding, with bounded memory."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from kvcalib.collection import collect_stats, left_pad
from tests.conftest import tiny_model


def _cache_contents(model, seqs):
    """Reference: run each sequence alone through a plain DynamicCache and read what it stores."""
    per_layer_k, per_layer_v = None, None
    for seq in seqs:
        cache = DynamicCache()
        with torch.no_grad():
            model(input_ids=seq[None], past_key_values=cache, use_cache=True)
        ks = [layer.keys[0].transpose(0, 1) for layer in cache.layers]  # each (T, H, D)
        vs = [layer.values[0].transpose(0, 1) for layer in cache.layers]
        if per_layer_k is None:
            per_layer_k, per_layer_v = [[k] for k in ks], [[v] for v in vs]
        else:
            for i, (k, v) in enumerate(zip(ks, vs)):
                per_layer_k[i].append(k)
                per_layer_v[i].append(v)
    return [torch.cat(x) for x in per_layer_k], [torch.cat(x) for x in per_layer_v]


def test_statistics_equal_direct_computation(tiny_arch_model):
    arch, model = tiny_arch_model
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 128, (n,), generator=g) for n in (24, 17, 24, 9, 20)]
    stats = collect_stats(model, seqs, batch_size=2, reservoir_blocks=3, block_len=8, progress=False)
    ref_k, ref_v = _cache_contents(model, seqs)
    assert stats.model.num_layers == 2
    for i, layer in enumerate(stats.layers):
        for name, ref in (("k", ref_k[i]), ("v", ref_v[i])):  # ref (N, H, D)
            got = getattr(layer, name)
            ref64 = ref.double()
            assert int(got["count"]) == ref.shape[0] == sum(s.numel() for s in seqs)
            # batching changes float summation order slightly: compare with a tight tolerance
            torch.testing.assert_close(got["min"], ref64.amin(0).float(), atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(got["max"], ref64.amax(0).float(), atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(got["mean"], ref64.mean(0).float(), atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(got["sq_mean"], (ref64**2).mean(0).float(), atol=1e-3, rtol=1e-4)
            torch.testing.assert_close(got["absmax"], ref64.abs().amax(0).float(), atol=1e-4, rtol=1e-4)


def test_padding_never_enters_statistics():
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 128, (n,), generator=g) for n in (30, 6)]
    batched = collect_stats(model, seqs, batch_size=2, reservoir_blocks=0, progress=False)
    alone = collect_stats(model, seqs, batch_size=1, reservoir_blocks=0, progress=False)
    for a, b in zip(batched.layers, alone.layers):
        assert int(a.k["count"]) == 36
        for key in ("min", "max", "mean", "sq_mean"):
            torch.testing.assert_close(a.k[key], b.k[key], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(a.v[key], b.v[key], atol=1e-4, rtol=1e-4)


def test_reservoir_holds_real_consecutive_blocks():
    model = tiny_model("qwen2")
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 128, (32,), generator=g) for _ in range(6)]
    stats = collect_stats(model, seqs, batch_size=3, reservoir_blocks=4, block_len=16, progress=False)
    assert stats.filled_blocks == 4
    ref_k, _ = _cache_contents(model, seqs)  # (N, H, D) per layer, sequences back to back
    blocks = ref_k[0].reshape(-1, 16, *ref_k[0].shape[1:])  # every aligned block of 16 tokens
    for block in stats.layers[0].reservoir_k:  # (BL, H, D) fp16
        err = (blocks.half().float() - block.float()).abs().amax(dim=(1, 2, 3))
        assert float(err.min()) < 1e-2, "each reservoir block is one real block of consecutive keys"
    q = stats.layers[0].reservoir_q
    assert q.shape == (4, 16, 4, 16) and torch.isfinite(q.float()).all()


def test_bf16_model_collects():
    model = tiny_model("mistral").to(torch.bfloat16)
    seqs = [torch.arange(20) % 128]
    stats = collect_stats(model, seqs, reservoir_blocks=1, block_len=8, progress=False)
    assert int(stats.layers[1].v["count"]) == 20
    assert torch.isfinite(stats.layers[1].k["sq_mean"]).all()


def test_attention_implementation_restored_after_error():
    model = tiny_model("llama")
    before = model.config._attn_implementation
    bad = [torch.tensor([1, 2, 999999])]  # out-of-vocabulary id -> the forward fails
    try:
        collect_stats(model, bad, reservoir_blocks=0, progress=False)
    except Exception:
        pass
    assert model.config._attn_implementation == before


def test_left_pad_shapes():
    ids, mask = left_pad([torch.tensor([5, 6, 7]), torch.tensor([9])], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 9]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
