"""Quantize-and-pack kernels vs kvcalib.quant.uniform (+ packing): bit-exact (torch.equal).

With a recipe's fitted state (SKVQ permutation, TaDA centering, OTT keep masks) the specification
is kvcalib.codec's ``quantize_reference`` / ``center_reference`` (what LayerCodec encodes).

Runs on CPU through Triton's interpreter (``TRITON_INTERPRET=1``, set here before any kernel
module is imported) and on CUDA as is; the full-size grid is marked ``gpu``.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_setup import kernel_modules

DEVICE, INTERPRET, (qp,) = kernel_modules("kvcalib_kernels.quant_pack")  # before any kernel import

from kvcalib.codec import quantize_reference  # noqa: E402
from kvcalib_kernels.reference import (center_pack_reference, quantize_pack_keys_reference,  # noqa: E402
                                       quantize_pack_values_reference)

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


@pytest.mark.parametrize("bits", [2, 3, 4, 8], ids=lambda b: f"{b}b")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("d,group", [(64, 16), (128, 32), (64, 12)], ids=lambda x: str(x))
def test_keys_bit_exact(bits, dtype, d, group):
    x = _x(2, 3, 2 * group, d, dtype, seed=bits + d)
    assert_same(qp.quantize_pack_keys(x, bits, group), quantize_pack_keys_reference(x.cpu(), bits, group))


@pytest.mark.parametrize("bits", [2, 3, 4, 8], ids=lambda b: f"{b}b")
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
    for bits in (2, 3, 4):
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
        qp.quantize_pack_values(x, 5, 32)
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


# ---------------------------------------------------------------- recipe state: perm, mean, keep


def _perm(h, d, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(d, generator=g) for _ in range(h)])  # (H, D) int64


def assert_center_same(a, r):
    """center_pack's (mean_hat, mean16, mean_q) vs center_reference's, bit for bit."""
    assert torch.equal(a[0].cpu(), r[0]), f"mean_hat: {(a[0].cpu() != r[0]).sum().item()} differ"
    assert (a[1] is None) == (r[1] is None) and (a[2] is None) == (r[2] is None)
    if r[1] is not None:
        assert a[1].dtype == torch.float16 and torch.equal(a[1].cpu(), r[1])
    if r[2] is not None:
        assert_same(a[2], r[2])


# (layout id, per_channel, d, group): key groups of 12 tokens (a padded tile), value groups inside
# a plane, a value group spanning planes (64 channels, 2 bits: planes of 16), per-token keys
LAYOUTS = [("keys-g12", True, 64, 12), ("values-g8", False, 64, 8), ("values-g64", False, 64, 64),
           ("token-keys-g16", False, 32, 16)]


@pytest.mark.parametrize("bits", [2, 4, 8], ids=lambda b: f"{b}b")
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x[0])
@pytest.mark.parametrize("mean_bits", [0, 8, 16], ids=lambda m: f"mean{m}")
def test_perm_mean_keep_bit_exact(bits, layout, mean_bits):
    """What LayerCodec encodes from a recipe: x - mean_hat (TaDA), channels permuted per head
    (SKVQ), ranges over ``padding & keep`` (OTT entrants excluded but still encoded), clip."""
    _, per_channel, d, group = layout
    b, h, t = 2, 3, 36
    x = _x(b, h, t, d, torch.bfloat16, seed=bits + d + mean_bits)
    g = torch.Generator().manual_seed(bits)
    valid = (torch.arange(t)[None, :] >= torch.tensor([[0], [7]]))[:, None, :]  # (B, 1, T) left padding
    keep = torch.rand(b, h, t, generator=g) > 0.2  # (B, H, T) OTT quant mask
    keep[0, 1, :12] = False  # a key group wholly in the pool: zero scale and zero
    m = valid & keep
    perm = _perm(h, d, seed=d)
    clip = (torch.rand(1, h, 1, d, generator=g) * 0.4 + 0.6) if per_channel else 0.85
    mean = None
    if mean_bits:
        mean_k, *_ = qp.center_pack(x, mean_bits)
        mean, *_ = center_pack_reference(x.cpu(), mean_bits)
        assert torch.equal(mean_k.cpu(), mean)
        mean_dev = mean_k
    fn = qp.quantize_pack_keys if per_channel else qp.quantize_pack_values
    dev = (lambda a: a.to(DEVICE) if isinstance(a, torch.Tensor) else a)  # noqa: E731
    got = fn(x, bits, group, dev(clip), dev(m), perm=dev(perm), mean=mean_dev if mean_bits else None)
    assert_same(got, quantize_reference(x.cpu(), bits, group, per_channel, clip, m, perm=perm, mean=mean))
    # one permutation row shared by every head (apply_perm's broadcast), no mask
    got = fn(x, bits, group, perm=dev(perm[:1]), validate=False)
    assert_same(got, quantize_reference(x.cpu(), bits, group, per_channel, perm=perm[:1]))


@pytest.mark.parametrize("heads", [1, 3, 7, 20], ids=lambda h: f"H{h}")
@pytest.mark.parametrize("mean_bits", [8, 16], ids=lambda m: f"mean{m}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_center_pack_bit_exact(heads, mean_bits, dtype):
    big = _x(2, heads, 45, 64, dtype, seed=heads + mean_bits)
    x = big[:, :, 3:40]  # a view into a longer buffer (the pending window), 37 tokens: a tail tile
    assert_center_same(qp.center_pack(x, mean_bits), center_pack_reference(x.cpu(), mean_bits))


@pytest.mark.parametrize("heads", [20, 33], ids=lambda h: f"H{h}")
def test_center_mean_sums_in_torch_order(heads):
    """Past 16 heads torch sums in chunks of 16 (module doc): summing the heads one by one, or
    multiplying by 1/H, changes some float32 means by an ulp, and about 1 in 5000 of those moves
    the float16 mean; 32K random means catch either."""
    x = torch.randn(1, heads, 512, 64, generator=torch.Generator().manual_seed(heads)) * 3
    assert_center_same(qp.center_pack(x.to(DEVICE), 16), center_pack_reference(x, 16))


def test_rejects_bad_perm_mean_and_heads():
    x = _x(1, 2, 16, 32, torch.float32, seed=0)
    with pytest.raises(ValueError, match="perm"):
        qp.quantize_pack_keys(x, 2, 8, perm=_perm(3, 32, 0).to(DEVICE))  # 3 rows for 2 heads
    bad = _perm(2, 32, 0)
    bad[0, 0] = bad[0, 1]
    with pytest.raises(ValueError, match="permutation"):
        qp.quantize_pack_values(x, 2, 8, perm=bad.to(DEVICE))
    with pytest.raises(ValueError, match="mean"):
        qp.quantize_pack_keys(x, 2, 8, mean=torch.zeros(1, 2, 16, 32, device=DEVICE))
    with pytest.raises(ValueError, match="mean_bits"):
        qp.center_pack(x, 4)
    with pytest.raises(ValueError, match="heads"):
        qp.center_pack(torch.zeros(1, qp.MAX_CENTER_HEADS + 1, 1, 8, device=DEVICE), 16)
    empty = qp.center_pack(x[:, :, :0], 8)
    assert empty[0].shape == (1, 1, 0, 32) and empty[2].scale.shape == (1, 1, 0, 1)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("bits", [2, 4], ids=lambda b: f"{b}b")
@pytest.mark.parametrize("mean_bits", [8, 16], ids=lambda m: f"mean{m}")
def test_gpu_full_size_recipe_state_bit_exact(bits, mean_bits):
    """Perm + centering + keep at a real shape (8 kv heads, head_dim 128, 1024 tokens) against the
    CPU specification (torch's CUDA mean rounds differently: see the module doc)."""
    b, h, t, d = 2, 8, 1024, 128
    x = _x(b, h, t, d, torch.bfloat16, seed=bits + mean_bits)
    xc = x.cpu()
    keep = torch.rand(b, h, t, generator=torch.Generator().manual_seed(0)) > 0.05
    perm = _perm(h, d, seed=1)
    mean_k, *rest = qp.center_pack(x, mean_bits, validate=False)
    ref = center_pack_reference(xc, mean_bits)
    assert_center_same((mean_k, *rest), ref)
    for per_channel, group in ((True, 128), (False, 32)):
        fn = qp.quantize_pack_keys if per_channel else qp.quantize_pack_values
        got = fn(x, bits, group, 0.9, keep.to(DEVICE), perm=perm.to(DEVICE), mean=mean_k, validate=False)
        assert_same(got, quantize_reference(xc, bits, group, per_channel, 0.9, keep, perm=perm, mean=ref[0]))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("bits", [2, 3, 4, 8], ids=lambda b: f"{b}b")
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
