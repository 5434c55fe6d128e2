"""Quantize-and-pack kernels vs kvcalib.quant.uniform (+ packing): bit-exact (torch.equal).

Runs on CPU through Triton's interpreter (``TRITON_INTERPRET=1``, set here before any kernel
module is imported) and on CUDA as is; the full-size grid is marked ``gpu``.
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
DEVICE = "cuda" if HAS_CUDA and not INTERPRET else "cpu"
triton = pytest.importorskip("triton")
if not HAS_CUDA and not INTERPRET:
    pytest.skip("no CUDA and TRITON_INTERPRET=0: Triton kernels cannot run here", allow_module_level=True)
qp = importlib.import_module("kvcalib_kernels.quant_pack")
if INTERPRET and type(qp._quant_keys_kernel).__name__ != "InterpretedFunction":
    qp = importlib.reload(qp)  # imported earlier without the interpreter

from kvcalib_kernels.reference import quantize_pack_keys_reference, quantize_pack_values_reference  # noqa: E402

requires_cuda = pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device (run through the device tool)")


def _x(b, h, t, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, h, t, d, generator=g) * 3 + torch.randn(1, 1, 1, d, generator=g) * 2
    # exact halves and repeated values: rounding ties and constant groups
    x[..., :3] = torch.randint(-6, 7, (b, h, t, 3), generator=g).float() * 0.5
    x[..., 3] = 1.25
    return x.to(dtype).to(DEVICE)


def assert_same(a, r):
    """Kernel result ``a`` vs reference ``r``; both compared on CPU. Callers compute the reference
    from CPU inputs: on CUDA, torch divides by the Python scalar ``qmax`` through its reciprocal,
    so ``kvcalib.quant.uniform.fit_params`` itself gives a few scales one float16 ulp away from
    its documented IEEE division (the CPU result)."""
    assert a.bits == r.bits and a.group == r.group and a.axis == r.axis
    for name in ("codes", "scale", "zero"):
        x, y = getattr(a, name).cpu(), getattr(r, name).cpu()
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x, y), f"{name}: {(x != y).sum().item()} of {x.numel()} differ"


@pytest.mark.parametrize("bits", [2, 4, 8], ids=lambda b: f"{b}b")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("d,group", [(64, 16), (128, 32), (64, 12)], ids=lambda x: str(x))
def test_keys_bit_exact(bits, dtype, d, group):
    x = _x(2, 3, 2 * group, d, dtype, seed=bits + d)
    assert_same(qp.quantize_pack_keys(x, bits, group), quantize_pack_keys_reference(x.cpu(), bits, group))


@pytest.mark.parametrize("bits", [2, 4, 8], ids=lambda b: f"{b}b")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("d,group", [(64, 16), (64, 64), (128, 128), (128, 32)], ids=lambda x: str(x))
def test_values_bit_exact(bits, dtype, d, group):
    x = _x(2, 2, 37, d, dtype, seed=bits * d + group)  # 37 tokens: a tail block
    assert_same(qp.quantize_pack_values(x, bits, group), quantize_pack_values_reference(x.cpu(), bits, group))


@pytest.mark.parametrize("clip", [0.8, "tensor"], ids=["scalar", "tensor"])
def test_clip_and_padding_bit_exact(clip):
    x = _x(2, 2, 32, 64, torch.float32, seed=5)
    valid = torch.rand(2, 1, 32, generator=torch.Generator().manual_seed(1)) > 0.4
    valid[1, :, :16] = False  # an empty key group: zero scale and zero
    valid = valid.to(DEVICE)
    g = torch.Generator().manual_seed(2)
    kclip = torch.rand(1, 2, 1, 64, generator=g) * 0.5 + 0.5 if clip == "tensor" else clip
    vclip = torch.rand(1, 2, 1, 1, generator=g) * 0.5 + 0.5 if clip == "tensor" else clip
    if isinstance(kclip, torch.Tensor):
        kclip[..., :4] = 1.0  # alpha == 1 exactly: the unclipped range, no drift
        kclip, vclip = kclip.to(DEVICE), vclip.to(DEVICE)
    cpu = (lambda t: t.cpu() if isinstance(t, torch.Tensor) else t)  # noqa: E731
    for bits in (2, 4):
        assert_same(qp.quantize_pack_keys(x, bits, 16, clip=kclip, valid=valid),
                    quantize_pack_keys_reference(x.cpu(), bits, 16, clip=cpu(kclip), valid=valid.cpu()))
        assert_same(qp.quantize_pack_values(x, bits, 32, clip=vclip, valid=valid),
                    quantize_pack_values_reference(x.cpu(), bits, 32, clip=cpu(vclip), valid=valid.cpu()))


def test_non_contiguous_input_and_untouched_source():
    big = _x(1, 2, 48, 128, torch.float32, seed=9)
    x = big[:, :, 8:40]  # a view into a larger buffer (the cache's pending window)
    before = big.clone()
    assert_same(qp.quantize_pack_keys(x, 2, 32), quantize_pack_keys_reference(x.cpu(), 2, 32))
    assert_same(qp.quantize_pack_values(x, 4, 64), quantize_pack_values_reference(x.cpu(), 4, 64))
    assert torch.equal(big, before)


def test_rejects_bad_input():
    x = _x(1, 1, 32, 64, torch.float32, seed=0)
    with pytest.raises(ValueError, match="multiple of group"):
        qp.quantize_pack_keys(x, 2, 24)
    with pytest.raises(ValueError, match="bits"):
        qp.quantize_pack_values(x, 3, 32)
    bad = x.clone()
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        qp.quantize_pack_keys(bad, 2, 32)
    with pytest.raises(ValueError, match="clip"):
        qp.quantize_pack_keys(x, 2, 32, clip=1.5)


def test_lean_import_of_the_package():
    """``import kvcalib_kernels`` and its reference module import no triton (STYLE habit 5)."""
    import subprocess
    import sys

    code = ("import sys, kvcalib_kernels, kvcalib_kernels.reference, kvcalib; "
            "assert 'triton' not in sys.modules, 'triton imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("bits", [2, 4, 8], ids=lambda b: f"{b}b")
@pytest.mark.parametrize("d", [64, 128, 256], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_full_size_bit_exact(bits, d, dtype):
    """Against the reference on CPU, the specification (see assert_same)."""
    x = _x(4, 8, 1024, d, dtype, seed=bits + d)
    xc = x.cpu()
    for group in (32, 128):
        assert_same(qp.quantize_pack_keys(x, bits, group), quantize_pack_keys_reference(xc, bits, group))
        if d % group == 0:
            assert_same(qp.quantize_pack_values(x, bits, group), quantize_pack_values_reference(xc, bits, group))
    clip = torch.rand(1, 8, 1, d) * 0.5 + 0.5
    assert_same(qp.quantize_pack_keys(x, bits, 128, clip=clip.to(DEVICE)),
                quantize_pack_keys_reference(xc, bits, 128, clip=clip))
