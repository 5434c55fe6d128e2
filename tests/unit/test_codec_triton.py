"""The Triton encode path of LayerCodec / CompressedCache stores exactly the reference's bytes.

``KVCALIB_BACKEND=triton`` forces :mod:`kvcalib_kernels.quant_pack` on the codec's flushes (on
CPU through Triton's interpreter, ``TRITON_INTERPRET=1``, set here before any kernel module is
imported); ``KVCALIB_BACKEND=reference`` forces PyTorch. The same K/V fed to two caches must give
the same stored bits: codes, scales, zeros, means, OTT masks and pools. Cases: a whole prompt
flushed after prefill, then group-by-group flushes during decode; ragged padding; SKVQ
permutation and clip; TaDA centering (8- and 16-bit means); OTT pools; per-token keys; PATS
tiers (first encode and requantization at each tier move on the kernel). Shapes are small: the
interpreter runs every program in Python.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
pytest.importorskip("triton")
if not HAS_CUDA and not INTERPRET:
    pytest.skip("no CUDA and TRITON_INTERPRET=0: Triton kernels cannot run here", allow_module_level=True)
qp = importlib.import_module("kvcalib_kernels.quant_pack")
if INTERPRET and type(qp._quant_keys_kernel).__name__ != "InterpretedFunction":
    qp = importlib.reload(qp)  # imported earlier without the interpreter

from kvcalib.methods.schedule import Schedule  # noqa: E402
from kvcalib.errors import KvcalibError  # noqa: E402
from kvcalib.layout import LayerConfig  # noqa: E402
from kvcalib.runtime.cache import CompressedLayer  # noqa: E402
from kvcalib.codec import LayerCodec, use_triton_encode  # noqa: E402

# the cache-level tests below feed CPU tensors: the kernels run on them only through the interpreter
# (on a CUDA machine, which runs without it, the GPU-marked test at the end covers the same ground)
needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="CPU tensors reach the kernels only under TRITON_INTERPRET=1")

B, H, D = 2, 3, 32  # 3 kv heads: a mean over heads that is not a power of two
CHANNEL = LayerConfig(k_bits=2, v_bits=4, k_group=8, v_group=16, window=8, sinks=2)
TOKEN_K = LayerConfig(k_bits=4, v_bits=8, k_axis="token", k_group=8, v_group=32, window=0, sinks=1)


def _kv(t: int, seed: int, dtype=torch.bfloat16, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, H, t, D, generator=g) * 3 + torch.randn(1, 1, 1, D, generator=g) * 4  # channel offsets
    v = torch.randn(B, H, t, D, generator=g)
    k[:, :, 5::7] *= 0.01  # tiny-norm tokens: OTT pool entrants
    return k.to(dtype).to(device), v.to(dtype).to(device)


def _state(seed: int = 0, center: int = 0) -> dict:
    """Fitted state of a recipe: per-head permutations, clip tensors (per head, per channel for
    keys), centering bits."""
    g = torch.Generator().manual_seed(seed + 100)
    perm = lambda: torch.stack([torch.randperm(D, generator=g) for _ in range(H)])  # noqa: E731
    return dict(k_perm=perm(), v_perm=perm(), k_clip=torch.rand(H, D, generator=g)[None, :, None] * 0.4 + 0.6,
                v_clip=0.9, k_center=center, v_center=center)


class _Spy:
    """Counts the kernel entry points the codec calls (proves the Triton path ran)."""

    def __init__(self, monkeypatch) -> None:
        self.calls = 0
        self.key_tokens = 0  # tokens the key kernel encoded (a flush encodes all due groups at once)
        for name in ("quantize_pack_keys", "quantize_pack_values", "center_pack"):
            fn = getattr(qp, name)

            def wrapped(*a, _fn=fn, _name=name, **kw):
                self.calls += 1
                if _name == "quantize_pack_keys":
                    self.key_tokens += a[0].shape[-2]
                return _fn(*a, **kw)

            monkeypatch.setattr(qp, name, wrapped)


def _run(monkeypatch, backend: str, cfg: LayerConfig, steps, *, pool: int = 0, schedule=None,
         pad: int = 0, device: str = "cpu", **state) -> CompressedLayer:
    """Feed ``steps`` (list of (k, v) chunks) to a fresh layer under ``backend``: update, mark
    padding (row 1 left-padded by ``pad`` tokens), flush, as the attention does."""
    monkeypatch.setenv("KVCALIB_BACKEND", backend)
    layer = CompressedLayer(cfg, LayerCodec(cfg, outlier_pool=pool, schedule=schedule, **state))
    for k, v in steps:
        layer.update(k, v)
        if pad:
            seen = torch.arange(layer.n_seen, device=device)[None, :]  # (1, n_seen)
            layer.mark_padding(seen >= torch.tensor([[0], [pad]], device=device))  # (B, n_seen)
        layer.flush()
    return layer


def _bits(t: torch.Tensor | None):
    """The stored bits of ``t`` (floats as integers: -0.0 and +0.0 differ) on the CPU."""
    if t is None:
        return None
    t = t.detach().cpu().contiguous()
    if t.is_floating_point():
        t = t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def assert_same_storage(a: CompressedLayer, r: CompressedLayer) -> None:
    assert a.ragged == r.ragged
    if r.ragged:  # a padded batch: one unpadded layer per row
        for ra, rr in zip(a.rows, r.rows, strict=True):
            assert_same_storage(ra, rr)
        return
    assert a.n_packed == r.n_packed and a.n_packed > 0
    assert len(a.packed.stores) == len(r.packed.stores)
    for sa, sr in zip(a.packed.stores, r.packed.stores):
        assert (sa.start, sa.n) == (sr.start, sr.n)
        for name in sr.parts:
            x, y = _bits(sa.parts[name].view()), _bits(sr.parts[name].view())
            assert (x is None) == (y is None), name
            if y is not None:
                assert x.dtype == y.dtype and x.shape == y.shape, name
                assert torch.equal(x, y), f"{name}: {(x != y).sum().item()} of {y.numel()} differ"
    assert (a.outliers.state is None) == (r.outliers.state is None)
    if r.outliers.state is not None:
        for f in ("pool_k", "pool_v", "pool_pos", "extra_k", "extra_v", "extra_pos"):
            assert torch.equal(_bits(getattr(a.outliers.state, f)), _bits(getattr(r.outliers.state, f))), f
    assert torch.equal(_bits(a.pend_k), _bits(r.pend_k)) and a.pend_start == r.pend_start


def _prompt_then_decode(prompt: int, decode: int, seed: int, **kw):
    """A prompt of ``prompt`` tokens in one update (flushed whole after prefill), then ``decode``
    single tokens (a group flushed whenever one is due)."""
    k, v = _kv(prompt + decode, seed, **kw)
    return [(k[:, :, :prompt], v[:, :, :prompt])] + [(k[:, :, i:i + 1], v[:, :, i:i + 1])
                                                    for i in range(prompt, prompt + decode)]


CASES = {
    "plain": dict(),
    "perm+clip": _state(0),
    "center16+perm+clip": _state(1, center=16),
    "center8+perm+clip": _state(2, center=8),
}


@needs_interpreter
@pytest.mark.parametrize("case", list(CASES))
def test_cache_stores_reference_bytes(monkeypatch, case):
    """Prompt of 45 tokens (4 groups flushed at once), 17 decode steps (2 more group flushes), a
    row left-padded by 11 tokens (held apart: its groups start at its first real token)."""
    steps = _prompt_then_decode(45, 17, seed=len(case))
    ref = _run(monkeypatch, "reference", CHANNEL, steps, pad=11, **CASES[case])
    spy = _Spy(monkeypatch)
    tri = _run(monkeypatch, "triton", CHANNEL, steps, pad=11, **CASES[case])
    assert spy.key_tokens >= tri.n_packed, "every flushed token went through the kernels"
    assert_same_storage(tri, ref)


@needs_interpreter
@pytest.mark.parametrize("case", ["plain", "center16+perm+clip"])
def test_three_bit_cache_stores_reference_bytes(monkeypatch, case):
    """3-bit codes (a 2-bit part then a 1-bit part per token) through the quantize-and-pack kernels."""
    three = LayerConfig(k_bits=3, v_bits=3, k_group=8, v_group=16, window=8, sinks=2)
    steps = _prompt_then_decode(45, 17, seed=11)
    ref = _run(monkeypatch, "reference", three, steps, pad=11, **CASES[case])
    spy = _Spy(monkeypatch)
    tri = _run(monkeypatch, "triton", three, steps, pad=11, **CASES[case])
    assert spy.key_tokens >= tri.n_packed, "every flushed token went through the kernels"
    assert_same_storage(tri, ref)


@needs_interpreter
def test_cache_with_outlier_pools_stores_reference_bytes(monkeypatch):
    """OTT: pool entrants are left out of their group's ranges (``keep``), padding never enters."""
    steps = _prompt_then_decode(37, 9, seed=7)
    ref = _run(monkeypatch, "reference", CHANNEL, steps, pool=3, pad=5, **CASES["center8+perm+clip"])
    tri = _run(monkeypatch, "triton", CHANNEL, steps, pool=3, pad=5, **CASES["center8+perm+clip"])
    assert tri.ragged and any(not bool(row.packed.stores[0].keep(0, row.n_packed).all()) for row in tri.rows), \
        "some token went to the pool"
    assert_same_storage(tri, ref)


@needs_interpreter
def test_per_token_keys_and_tiers_store_reference_bytes(monkeypatch):
    """Per-token keys (a flush per token) and PATS tiers: blocks encoded by the kernels, then
    requantized by the reference as they age, hold the reference's bits in every tier."""
    steps = _prompt_then_decode(12, 6, seed=3)
    state = _state(4, center=16)
    state["k_clip"] = 0.95  # per-token keys: the clip is per (token, channel group)
    ref = _run(monkeypatch, "reference", TOKEN_K, steps, pad=3, **state)
    tri = _run(monkeypatch, "triton", TOKEN_K, steps, pad=3, **state)
    assert_same_storage(tri, ref)

    sched = Schedule.from_tensor(torch.tensor([[0, 16, 16], [8, 2, 4], [16, 2, 2]]), sinks=CHANNEL.sinks)
    steps = _prompt_then_decode(30, 12, seed=5)
    ref = _run(monkeypatch, "reference", CHANNEL, steps, schedule=sched, pool=2, **CASES["perm+clip"])
    tri = _run(monkeypatch, "triton", CHANNEL, steps, schedule=sched, pool=2, **CASES["perm+clip"])
    assert tri.packed.stores[-1].n > 0, "a block reached the last tier"
    assert_same_storage(tri, ref)


@needs_interpreter
@pytest.mark.parametrize("src,dst", [(8, 4), (8, 2), (4, 2), (4, 3)])
def test_requantize_on_the_kernel_stores_reference_bytes(monkeypatch, src, dst):
    """A tier move (requantization to fewer bits, padding and pool entrants out of the ranges)
    through the quantize-and-pack kernel gives the reference's bytes, keys and values."""
    cfg = LayerConfig(k_bits=src, v_bits=src, k_group=8, v_group=16, window=8, sinks=CHANNEL.sinks)
    k, v = _kv(16, seed=13)
    valid = torch.arange(16)[None, :] >= torch.tensor([[0], [5]])  # (B, N): row 1 left-padded
    keep = torch.rand(k.shape[:3], generator=torch.Generator().manual_seed(2)) > 0.1  # (B, H, N)
    out = {}
    for backend in ("reference", "triton"):
        monkeypatch.setenv("KVCALIB_BACKEND", backend)
        codec = LayerCodec(cfg)
        out[backend] = [codec.requantize(side, enc(x, valid, keep), dst, valid, keep)
                        for side, enc, x in (("k", codec.encode_keys, k), ("v", codec.encode_values, v))]
    for ref, tri in zip(out["reference"], out["triton"]):
        assert tri.quantized.bits == dst
        for name in ("codes", "scale", "zero"):
            assert torch.equal(_bits(getattr(tri.quantized, name)), _bits(getattr(ref.quantized, name))), name


@needs_interpreter
def test_whole_prompt_encode_equals_group_by_group(monkeypatch):
    """One kernel call over many groups (a whole prompt) stores what per-group calls store: the
    cache may flush a prompt in one launch (per-token keys: one launch instead of one per token)."""
    monkeypatch.setenv("KVCALIB_BACKEND", "triton")
    for cfg in (CHANNEL, TOKEN_K):
        codec = LayerCodec(cfg, **{**CASES["center8+perm+clip"], "k_clip": 0.9})
        k, v = _kv(32, seed=11)
        valid = torch.arange(32)[None, :] >= torch.tensor([[0], [6]])  # (B, N)
        blk = 8
        for enc, x in ((codec.encode_keys, k), (codec.encode_values, v)):
            whole = enc(x, valid)
            parts = [enc(x[:, :, i:i + blk], valid[:, i:i + blk]) for i in range(0, 32, blk)]
            for name in ("codes", "scale", "zero"):
                cat = torch.cat([getattr(p.quantized, name) for p in parts], dim=2)
                assert torch.equal(_bits(getattr(whole.quantized, name)), _bits(cat)), name
            for name in ("codes", "scale", "zero"):
                cat = torch.cat([getattr(p.mean_q, name) for p in parts], dim=2)
                assert torch.equal(_bits(getattr(whole.mean_q, name)), _bits(cat)), name


@needs_interpreter
def test_backend_selection(monkeypatch):
    """``reference`` forces PyTorch; ``auto`` uses the kernels on CUDA tensors only; ``triton``
    on a CPU tensor needs the interpreter; a 16-bit side or an uncovered layout falls back."""
    x = torch.zeros(1, 2, 8, 16)
    monkeypatch.setenv("KVCALIB_BACKEND", "reference")
    assert not use_triton_encode(x)
    monkeypatch.setenv("KVCALIB_BACKEND", "auto")
    assert use_triton_encode(x) == x.is_cuda
    monkeypatch.setenv("KVCALIB_BACKEND", "triton")
    assert use_triton_encode(x) is True  # the interpreter is on in this module
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert use_triton_encode(x) is False
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("KVCALIB_BACKEND", "nonsense")
    with pytest.raises(KvcalibError, match="KVCALIB_BACKEND"):
        use_triton_encode(x)

    monkeypatch.setenv("KVCALIB_BACKEND", "triton")
    spy = _Spy(monkeypatch)
    odd = LayerConfig(k_bits=2, v_bits=16, k_group=8, window=8)  # head_dim 24: not a power of two
    k, v = _kv(8, seed=0)
    codec = LayerCodec(odd)
    out = codec.encode_keys(k[..., :24])
    assert spy.calls == 0 and out.quantized is not None, "head_dim 24: the reference encodes it"
    assert codec.encode_values(v).raw is v and spy.calls == 0, "a 16-bit side is kept raw"
    assert qp.supports(shape=(1, 2, 8, 24), dtype=torch.float32, bits=2, group=8, per_channel=True) is not None
    assert qp.supports(shape=(1, 300, 8, 32), dtype=torch.float32, bits=2, group=8, per_channel=True,
                       center=8) is not None
    assert qp.supports(shape=(1, 4, 8, 32), dtype=torch.float64, bits=2, group=8, per_channel=True) is not None
    assert qp.supports(shape=(1, 4, 8, 32), dtype=torch.bfloat16, bits=2, group=8, per_channel=True,
                       center=16, perm_heads=2) is None


@needs_interpreter
def test_bad_clip_is_refused_on_the_kernel_path(monkeypatch):
    """The kernels run with validate=False: the codec checks a clip tensor once, by name."""
    monkeypatch.setenv("KVCALIB_BACKEND", "triton")
    codec = LayerCodec(CHANNEL, k_clip=torch.full((1, H, 1, D), 1.5))
    with pytest.raises(ValueError, match="clip"):
        codec.encode_keys(_kv(8, seed=0)[0])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs a CUDA device (run through the device tool)")
@pytest.mark.parametrize("case", ["perm+clip", "center16+perm+clip", "center8+perm+clip"])
def test_gpu_cache_stores_the_cpu_reference_bytes(monkeypatch, case):
    """On CUDA the default backend encodes with the kernels; the bytes are the CPU reference's
    (the specification: torch's CUDA mean over heads rounds differently, see quant_pack's doc)."""
    steps = _prompt_then_decode(45, 17, seed=1)
    ref = _run(monkeypatch, "reference", CHANNEL, steps, pad=11, **CASES[case])
    gpu_steps = [(k.cuda(), v.cuda()) for k, v in steps]
    spy = _Spy(monkeypatch)
    tri = _run(monkeypatch, "auto", CHANNEL, gpu_steps, pad=11, device="cuda", **CASES[case])
    assert spy.calls > 0
    assert_same_storage(tri, ref)
    # OTT selection runs on the cache's device: compare with the CUDA reference (no centering)
    ref = _run(monkeypatch, "reference", CHANNEL, gpu_steps, pool=3, pad=11, device="cuda", **CASES["perm+clip"])
    tri = _run(monkeypatch, "auto", CHANNEL, gpu_steps, pool=3, pad=11, device="cuda", **CASES["perm+clip"])
    assert_same_storage(tri, ref)
