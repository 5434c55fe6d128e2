"""Quantize-and-pack a block of K or V in one pass: bit-exact with kvcalib.quant.uniform.

The specification is :func:`kvcalib.quant.uniform.quantize_keys` /
:func:`~kvcalib.quant.uniform.quantize_values` followed by
:func:`kvcalib.quant.packing.pack_codes` (re-exported as
:func:`kvcalib_kernels.reference.quantize_pack_keys_reference` / ``..._values_reference``):
same codes, same float16 scale and zero, bit for bit (the tests use ``torch.equal``). With the
fitted state of a recipe (what :meth:`kvcalib.codec.LayerCodec.encode_keys` does) the
specification is :func:`kvcalib.codec.quantize_reference` (SKVQ channel permutation
``perm``, TaDA deviations from a stored mean ``mean``) and
:func:`kvcalib.codec.center_reference` (the stored mean itself, :func:`center_pack`).

How bit-exactness is kept (the reference's "Arithmetic" notes):

- min/max are exact; ``scale16 = f16(div_rn(hi - lo, qmax))``, ``zero16 = f16(lo)``
  (round-to-nearest casts, like torch);
- ``t = div_rn(x - zero16, scale16)``: IEEE division (Triton's default ``/`` is approximate);
- ``round`` is half-to-even like ``torch.round``: after clamping ``t`` to ``[0, qmax]``
  (clamping first is equivalent: the bounds are integers), ``(t + 1.5 * 2**23) - 1.5 * 2**23``
  rounds to the nearest integer, ties to even, in float32;
- the clip arithmetic ``c - alpha * (c - lo)`` must not become a fused multiply-add (torch
  rounds the product): the kernels launch with ``enable_fp_fusion=False``;
- a permutation is a gather: stored channel ``j`` of head ``h`` loads input channel
  ``perm[h, j]`` (no arithmetic, so nothing to round);
- centering: ``dev = x - mean_hat`` is one float32 subtraction, as in torch. The mean over kv
  heads must be summed in torch's CPU order to be bit-exact: ``sum`` over a non-innermost dim
  (``SumKernel.cpp``'s cascade, ``multi_row_sum``) adds the heads one by one from 0 within chunks
  of 16, adds the chunk sums one by one from 0 into a second accumulator, and returns
  ``tail + chunks``; ``mean`` is that sum divided by H (IEEE division on CPU). Past 255 heads the
  cascade gains a third level, which :func:`center_pack` does not reproduce (it refuses). On
  CUDA, torch's own ``mean`` multiplies by ``1/H`` and sums in another order, so the kernel
  matches the CPU specification, not torch-on-CUDA (like ``fit_params`` before it divided
  tensor by tensor).

Keys (per channel over groups of ``group`` tokens): grid ``(B * H, T / group, cdiv(P, PB))``; a
program loads, for each of the ``8 / bits`` planes, the ``(group, PB)`` tile of that plane's
channels, reduces over tokens, and ORs the plane's codes into one ``(group, PB)`` byte tile.
Values (per token over groups of ``group`` channels): grid ``(B * H, cdiv(T, TB))``; each plane is
a ``(TB, P / W, W)`` tile, ``W = min(group, P)``, so each group is a reduction over the last axis
(a group wider than a plane is reduced from its own ``(TB, group)`` tile).
Centre (mean over kv heads): grid ``(B, cdiv(T, TB))``; a program sums its ``(TB, D)`` tile over
the heads and writes the stored mean (float16, or 8-bit codes over one group of D channels) and
the float32 ``mean_hat`` the quantize kernels subtract.

Padding and OTT: ``valid`` (bool, broadcastable to ``(B, H, T)``) is the reference's range mask:
False tokens are left out of their group's min/max but still encoded (keys; clamped into the
group's range), and a value token that is False has empty groups (scale = zero = 0, codes 0).
The codec passes ``padding & keep`` (OTT pool entrants are False), exactly as the reference.

Not checked by the kernels: the reference raises on NaN/inf inputs and on float16 overflow of a
parameter; here ``validate=True`` (default) checks finiteness first (one device sync), else
non-finite inputs give unspecified codes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcalib.quant.packing import SUPPORTED_BITS, length_multiple, packed_width
from kvcalib.quant.uniform import QuantizedTensor

__all__ = ["MAX_CENTER_HEADS", "center_pack", "quantize_pack_keys", "quantize_pack_values", "supports"]

# torch.sum over the kv-head dim (CPU) adds a third cascade level from 256 heads on (module doc)
MAX_CENTER_HEADS = 255


@triton.jit
def _fit(lo, hi, alpha, QMAX: tl.constexpr, HAS_CLIP: tl.constexpr):
    """Group range -> (scale16, zero16) as float32 values of float16 numbers (fit_params)."""
    if HAS_CLIP:
        c = (hi + lo) * 0.5
        lo_c = c - alpha * (c - lo)
        hi_c = c + alpha * (hi - c)
        lo = tl.where(alpha == 1.0, lo, lo_c)
        hi = tl.where(alpha == 1.0, hi, hi_c)
    scale16 = tl.math.div_rn(hi - lo, QMAX * 1.0).to(tl.float16)
    zero16 = lo.to(tl.float16)
    return scale16, zero16


@triton.jit
def _encode(x, s32, z32, QMAX: tl.constexpr):
    """clamp(round_half_even((x - z) / s), 0, QMAX) as uint8; 0 where s == 0 (encode)."""
    nz = s32 > 0
    t = tl.math.div_rn(x - z32, tl.where(nz, s32, 1.0))
    t = tl.minimum(tl.maximum(t, 0.0), QMAX * 1.0)
    r = (t + 12582912.0) - 12582912.0
    return tl.where(nz, r, 0.0).to(tl.uint8)


@triton.jit
def _load_dev(x_ptrs, m_ptrs, cols, mask, perm_row, D: tl.constexpr, HAS_PERM: tl.constexpr,
              HAS_MEAN: tl.constexpr):
    """Stored channels ``cols`` of a tile, float32: ``x[.., perm[cols]] - mean_hat[.., perm[cols]]``.

    ``x_ptrs``/``m_ptrs``: row pointers broadcastable against ``cols`` (the input and the mean);
    ``perm_row``: this head's permutation (int32, D entries). The permutation is applied to the
    deviations, as the reference permutes after centering: a gather, no arithmetic."""
    if HAS_PERM:
        src = tl.load(perm_row + cols, mask=cols < D, other=0)
    else:
        src = cols
    x = tl.load(x_ptrs + src, mask=mask, other=0.0).to(tl.float32)
    if HAS_MEAN:
        x = x - tl.load(m_ptrs + src, mask=mask, other=0.0)
    return x


@triton.jit
def _pack3(code, s: tl.constexpr, even, odd, high):
    """3-bit codes of 1-bit plane ``s`` (channels ``[s * D/8, (s+1) * D/8)``) into the layout of
    kvcalib.quant.packing: their low 2 bits sit in 2-bit plane ``s // 2`` of the bytes
    ``[(s % 2) * D/8, ...)`` (``even`` for even s, ``odd`` for odd s: the first and second D/8 bytes
    of the 2-bit part), their high bit in bit ``s`` of the 1-bit part (``high``)."""
    low = (code & 3) << (2 * (s // 2))
    if s % 2 == 0:
        even = even | low
    else:
        odd = odd | low
    high = high | ((code >> 2) << s)
    return even, odd, high


@triton.jit
def _quant_keys_kernel(
    # input (B, H, T, D) float, last dim contiguous
    X, stride_xb, stride_xh, stride_xt,
    # valid tokens (B, H, T) uint8 (expanded: strides may be 0), used when HAS_VALID
    VALID, stride_vb, stride_vh, stride_vt,
    # clip alpha (B, H, T/GROUP, D) float32 (expanded), used when HAS_CLIP
    CLIP, stride_cb, stride_ch, stride_cg, stride_cd,
    # channel permutation (H, D) int32 contiguous, used when HAS_PERM;
    # mean_hat (B, T, D) float32 contiguous, used when HAS_MEAN
    PERM, MEAN,
    # outputs: codes (B, H, T, ROW) uint8; scale/zero (B, H, T/GROUP, D) float16; all contiguous
    CODES, SCALE, ZERO, T, H,
    D: tl.constexpr, P: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr,
    PB: tl.constexpr, HAS_VALID: tl.constexpr, HAS_CLIP: tl.constexpr, HAS_PERM: tl.constexpr,
    HAS_MEAN: tl.constexpr, ROW: tl.constexpr,
):
    """P: channels per plane (D / (8 // BITS); D / 8 at 3 bits, whose 8 one-bit planes set the
    stride); ROW: code bytes per token (P, or 3 * P at 3 bits: see _pack3)."""
    pid_bh = tl.program_id(0)
    g = tl.program_id(1)  # token group
    pb0 = tl.program_id(2) * PB  # first byte column of this program
    b = pid_bh // H
    h = pid_bh % H
    QMAX: tl.constexpr = (1 << BITS) - 1
    PER: tl.constexpr = 8 if BITS == 3 else 8 // BITS
    offs_t = g * GROUP + tl.arange(0, G_PAD)  # (G_PAD,) tokens
    t_ok = tl.arange(0, G_PAD) < GROUP
    offs_p = pb0 + tl.arange(0, PB)  # (PB,) byte columns
    p_ok = offs_p < P
    ok = t_ok
    if HAS_VALID:
        v = tl.load(VALID + b * stride_vb + h * stride_vh + offs_t * stride_vt, mask=t_ok, other=0)
        ok = ok & (v != 0)
    any_ok = tl.max(ok.to(tl.int32), axis=0) > 0
    x_rows = X + b.to(tl.int64) * stride_xb + h.to(tl.int64) * stride_xh + offs_t.to(tl.int64) * stride_xt
    m_rows = MEAN + (b.to(tl.int64) * T + offs_t) * D  # (G_PAD,) mean_hat rows (HAS_MEAN)
    perm_row = PERM + h * D
    prow = (pid_bh.to(tl.int64) * (T // GROUP) + g) * D  # scale/zero row of this group
    packed = tl.zeros([G_PAD, PB], tl.uint8)  # 3 bits: the low bits of the even 1-bit planes
    packed_odd = tl.zeros([G_PAD, PB], tl.uint8)  # 3 bits: the low bits of the odd ones
    packed_high = tl.zeros([G_PAD, PB], tl.uint8)  # 3 bits: the high bits
    for s in tl.static_range(PER):
        cols = s * P + offs_p  # (PB,) stored channels of plane s
        x = _load_dev(x_rows[:, None], m_rows[:, None], cols[None, :], t_ok[:, None] & p_ok[None, :], perm_row,
                      D, HAS_PERM, HAS_MEAN)  # (G_PAD, PB)
        lo = tl.min(tl.where(ok[:, None], x, float("inf")), axis=0)  # (PB,)
        hi = tl.max(tl.where(ok[:, None], x, float("-inf")), axis=0)
        lo = tl.where(any_ok, lo, 0.0)
        hi = tl.where(any_ok, hi, 0.0)
        alpha = lo
        if HAS_CLIP:
            alpha = tl.load(CLIP + b * stride_cb + h * stride_ch + g * stride_cg + cols * stride_cd,
                            mask=p_ok, other=1.0)
        scale16, zero16 = _fit(lo, hi, alpha, QMAX, HAS_CLIP)
        tl.store(SCALE + prow + cols, scale16, mask=p_ok)
        tl.store(ZERO + prow + cols, zero16, mask=p_ok)
        code = _encode(x, scale16.to(tl.float32)[None, :], zero16.to(tl.float32)[None, :], QMAX)
        if BITS == 3:
            packed, packed_odd, packed_high = _pack3(code, s, packed, packed_odd, packed_high)
        else:
            packed = packed | (code << (s * BITS))
    out_rows = (pid_bh.to(tl.int64) * T + offs_t) * ROW  # (G_PAD,)
    out = CODES + out_rows[:, None] + offs_p[None, :]
    tl.store(out, packed, mask=t_ok[:, None] & p_ok[None, :])
    if BITS == 3:
        tl.store(out + P, packed_odd, mask=t_ok[:, None] & p_ok[None, :])
        tl.store(out + 2 * P, packed_high, mask=t_ok[:, None] & p_ok[None, :])


@triton.jit
def _quant_values_kernel(
    # input (B, H, T, D) float, last dim contiguous
    X, stride_xb, stride_xh, stride_xt,
    # valid tokens (B, H, T) uint8 (expanded), used when HAS_VALID
    VALID, stride_vb, stride_vh, stride_vt,
    # clip alpha (B, H, T, D/GROUP) float32 (expanded), used when HAS_CLIP
    CLIP, stride_cb, stride_ch, stride_ct, stride_cg,
    # channel permutation (H, D) int32 contiguous, used when HAS_PERM;
    # mean_hat (B, T, D) float32 contiguous, used when HAS_MEAN
    PERM, MEAN,
    # outputs: codes (B, H, T, ROW) uint8; scale/zero (B, H, T, D/GROUP) float16; all contiguous
    CODES, SCALE, ZERO, T, H,
    D: tl.constexpr, P: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, W: tl.constexpr,
    TB: tl.constexpr, HAS_VALID: tl.constexpr, HAS_CLIP: tl.constexpr, HAS_PERM: tl.constexpr,
    HAS_MEAN: tl.constexpr, ROW: tl.constexpr,
):
    """P and ROW as in _quant_keys_kernel."""
    pid_bh = tl.program_id(0)
    b = pid_bh // H
    h = pid_bh % H
    QMAX: tl.constexpr = (1 << BITS) - 1
    PER: tl.constexpr = 8 if BITS == 3 else 8 // BITS
    NGP: tl.constexpr = P // W  # sub-groups of W channels per plane
    NG: tl.constexpr = D // GROUP
    offs_t = tl.program_id(1) * TB + tl.arange(0, TB)  # (TB,)
    t_ok = offs_t < T
    ok = t_ok
    if HAS_VALID:
        v = tl.load(VALID + b * stride_vb + h * stride_vh + offs_t * stride_vt, mask=t_ok, other=0)
        ok = ok & (v != 0)
    offs_g = tl.arange(0, NGP)
    offs_w = tl.arange(0, W)
    byte3 = offs_g[None, :, None] * W + offs_w[None, None, :]  # (1, NGP, W) byte column
    x_rows = X + b.to(tl.int64) * stride_xb + h.to(tl.int64) * stride_xh + offs_t.to(tl.int64) * stride_xt
    m_rows = MEAN + (b.to(tl.int64) * T + offs_t) * D  # (TB,) mean_hat rows (HAS_MEAN)
    perm_row = PERM + h * D
    prows = (pid_bh.to(tl.int64) * T + offs_t) * NG  # (TB,) scale/zero rows
    m3 = t_ok[:, None, None]
    packed = tl.zeros([TB, NGP, W], tl.uint8)  # 3 bits: as in _quant_keys_kernel
    packed_odd = tl.zeros([TB, NGP, W], tl.uint8)
    packed_high = tl.zeros([TB, NGP, W], tl.uint8)
    for s in tl.static_range(PER):
        x = _load_dev(x_rows[:, None, None], m_rows[:, None, None], s * P + byte3, m3, perm_row,
                      D, HAS_PERM, HAS_MEAN)  # (TB, NGP, W)
        gcol = (s * P + offs_g * W) // GROUP  # (NGP,) value group of each sub-group
        if GROUP <= P:
            lo = tl.min(x, axis=2)  # (TB, NGP)
            hi = tl.max(x, axis=2)
        else:
            # the group spans several planes: reduce over its own (TB, GROUP) tile
            gch = ((s * P) // GROUP) * GROUP + tl.arange(0, GROUP)
            xg = _load_dev(x_rows[:, None], m_rows[:, None], gch[None, :], t_ok[:, None], perm_row,
                           D, HAS_PERM, HAS_MEAN)  # (TB, GROUP)
            lo = tl.min(xg, axis=1)[:, None]  # (TB, 1) == (TB, NGP)
            hi = tl.max(xg, axis=1)[:, None]
        lo = tl.where(ok[:, None], lo, 0.0)  # a padding token's groups are empty: [0, 0]
        hi = tl.where(ok[:, None], hi, 0.0)
        alpha = lo
        if HAS_CLIP:
            alpha = tl.load(CLIP + b * stride_cb + h * stride_ch + offs_t[:, None] * stride_ct
                            + gcol[None, :] * stride_cg, mask=t_ok[:, None], other=1.0)
        scale16, zero16 = _fit(lo, hi, alpha, QMAX, HAS_CLIP)  # (TB, NGP)
        tl.store(SCALE + prows[:, None] + gcol[None, :], scale16, mask=t_ok[:, None])
        tl.store(ZERO + prows[:, None] + gcol[None, :], zero16, mask=t_ok[:, None])
        code = _encode(x, scale16.to(tl.float32)[:, :, None], zero16.to(tl.float32)[:, :, None], QMAX)
        if BITS == 3:
            packed, packed_odd, packed_high = _pack3(code, s, packed, packed_odd, packed_high)
        else:
            packed = packed | (code << (s * BITS))
    out = CODES + ((pid_bh.to(tl.int64) * T + offs_t) * ROW)[:, None, None] + byte3
    tl.store(out, packed, mask=m3)
    if BITS == 3:
        tl.store(out + P, packed_odd, mask=m3)
        tl.store(out + 2 * P, packed_high, mask=m3)


@triton.jit
def _center_kernel(
    # input (B, H, T, D) float, last dim contiguous
    X, stride_xb, stride_xh, stride_xt,
    # outputs, all contiguous: mean_hat (B, T, D) float32 (what the quantize kernels subtract);
    # MEAN_BITS 16: mean (B, T, D) float16; MEAN_BITS 8: codes (B, T, D) uint8, scale/zero (B, T) float16
    MEAN_HAT, MEAN16, MCODES, MSCALE, MZERO, T,
    H: tl.constexpr, D: tl.constexpr, TB: tl.constexpr, MEAN_BITS: tl.constexpr,
):
    b = tl.program_id(0)
    offs_t = tl.program_id(1) * TB + tl.arange(0, TB)  # (TB,)
    t_ok = offs_t < T
    offs_d = tl.arange(0, D)
    mask = t_ok[:, None]
    x_ptrs = (X + b.to(tl.int64) * stride_xb + offs_t.to(tl.int64)[:, None] * stride_xt
              + offs_d[None, :])  # (TB, D), head 0
    # torch's CPU order (module doc): heads one by one from 0 within chunks of 16, chunk sums one
    # by one from 0, then tail + chunks. Every add starts from +0.0, as torch's accumulators do
    # (0.0 + -0.0 is +0.0: the sign of a zero mean matches too).
    chunks = tl.zeros([TB, D], tl.float32)
    for c in tl.static_range(H // 16):
        part = tl.zeros([TB, D], tl.float32)
        for j in tl.static_range(16):
            part += tl.load(x_ptrs + (c * 16 + j) * stride_xh, mask=mask, other=0.0).to(tl.float32)
        chunks += part
    tail = tl.zeros([TB, D], tl.float32)
    for j in tl.static_range((H // 16) * 16, H):
        tail += tl.load(x_ptrs + j * stride_xh, mask=mask, other=0.0).to(tl.float32)
    mean = tl.math.div_rn(tail + chunks, H * 1.0)  # (TB, D)
    rows = (b.to(tl.int64) * T + offs_t) * D  # (TB,)
    if MEAN_BITS == 16:
        m16 = mean.to(tl.float16)
        tl.store(MEAN16 + rows[:, None] + offs_d[None, :], m16, mask=mask)
        mean_hat = m16.to(tl.float32)
    else:
        # quantize_mean: per-token 8 bits over one group of D channels, dequantized
        s16, z16 = _fit(tl.min(mean, axis=1), tl.max(mean, axis=1), mean, 255, False)  # (TB,)
        s32 = s16.to(tl.float32)[:, None]
        z32 = z16.to(tl.float32)[:, None]
        mean_hat = _encode(mean, s32, z32, 255).to(tl.float32) * s32 + z32  # (TB, D)
        # the codec stores quantize_values(mean_hat, 8, D): quantized once more, as it does
        s16, z16 = _fit(tl.min(mean_hat, axis=1), tl.max(mean_hat, axis=1), mean_hat, 255, False)
        code = _encode(mean_hat, s16.to(tl.float32)[:, None], z16.to(tl.float32)[:, None], 255)
        tl.store(MCODES + rows[:, None] + offs_d[None, :], code, mask=mask)
        tl.store(MSCALE + b.to(tl.int64) * T + offs_t, s16, mask=t_ok)
        tl.store(MZERO + b.to(tl.int64) * T + offs_t, z16, mask=t_ok)
    tl.store(MEAN_HAT + rows[:, None] + offs_d[None, :], mean_hat, mask=mask)


# ---------------------------------------------------------------- launchers

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def supports(*, shape: tuple[int, ...], dtype: torch.dtype, bits: int, group: int, per_channel: bool,
             center: int = 0, perm_heads: int | None = None) -> str | None:
    """None when these kernels encode a block of this layout, else the reason they do not.

    ``shape`` (B, H, T, D); ``per_channel``: keys per channel over groups of ``group`` tokens
    (:func:`quantize_pack_keys`), else per token over groups of ``group`` channels
    (:func:`quantize_pack_values`); ``center``: mean bits (0 off, 8 or 16); ``perm_heads``: rows of
    the permutation (None: no permutation). Cheap, no device sync.
    """
    if len(shape) != 4:
        return f"shape {tuple(shape)} is not (B, H, T, D)"
    _, h, t, d = shape
    if dtype not in _DTYPES:
        return f"dtype {dtype} is not float16, bfloat16 or float32"
    if bits not in SUPPORTED_BITS or isinstance(bits, bool):
        return f"bits {bits} is not one of {SUPPORTED_BITS}"
    if d < 8 or d & (d - 1):
        return f"head_dim {d} is not a power of two >= 8"
    if per_channel and t % group:
        return f"{t} tokens are not whole key groups of {group}"
    if not per_channel and (group < 1 or group & (group - 1) or d % group):
        return f"value group {group} is not a power of two dividing head_dim {d}"
    if center not in (0, 8, 16):
        return f"mean bits {center} is not 0, 8 or 16"
    if center and h > MAX_CENTER_HEADS:
        return f"{h} kv heads: centering sums at most {MAX_CENTER_HEADS} in torch's order"
    if perm_heads is not None and (perm_heads < 1 or h % perm_heads):
        return f"a permutation of {perm_heads} heads does not fit {h} kv heads"
    return None


def _check_input(x: torch.Tensor, name: str, bits: int, validate: bool) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or not x.is_floating_point():
        raise ValueError(f"{name} must be a float (B, H, T, D) tensor, got "
                         f"{getattr(x, 'dtype', type(x))} {tuple(getattr(x, 'shape', ()))}")
    if bits not in SUPPORTED_BITS or isinstance(bits, bool):
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")
    d = x.shape[-1]
    if d & (d - 1) or d < 8:
        raise ValueError(f"head_dim D={d} must be a power of two >= 8 for these kernels")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if validate and x.numel() and not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} contains NaN or inf; quantization needs finite inputs")
    return x


def _expand_clip(clip, shape, dev, validate: bool):
    """(tensor, strides, has_clip) for a float or tensor alpha broadcast to ``shape``."""
    if isinstance(clip, torch.Tensor):
        if not clip.is_floating_point():
            raise ValueError(f"clip must be a float or a floating tensor, got {clip.dtype}")
        try:
            a = clip.to(device=dev, dtype=torch.float32).expand(shape)
        except RuntimeError:
            raise ValueError(f"clip of shape {tuple(clip.shape)} does not broadcast to the scale shape {shape}") from None
        if validate and not bool(((a > 0) & (a <= 1)).all()):
            raise ValueError("clip values must lie in (0, 1] (1 means no clipping)")
        return a, a.stride(), True
    if isinstance(clip, bool) or not isinstance(clip, int | float) or not 0.0 < float(clip) <= 1.0:
        raise ValueError(f"clip must lie in (0, 1] (1 means no clipping), got {clip!r}")
    if float(clip) == 1.0:
        return torch.ones(1, dtype=torch.float32, device=dev), (0, 0, 0, 0), False
    a = torch.full((1,), float(clip), dtype=torch.float32, device=dev)
    return a, (0, 0, 0, 0), True


def _valid_u8(valid, b, h, t, dev):
    """(uint8 (B, H, T) expanded view, its strides, has_valid) for an optional bool mask."""
    if valid is None:
        return torch.zeros(1, dtype=torch.uint8, device=dev), (0, 0, 0), False
    if not isinstance(valid, torch.Tensor) or valid.dtype != torch.bool:
        raise ValueError(f"valid must be a bool tensor, got {getattr(valid, 'dtype', type(valid))}")
    try:
        e = valid.to(device=dev, dtype=torch.uint8).expand(b, h, t)  # a (B, T)-sized copy at most
    except RuntimeError:
        raise ValueError(f"valid of shape {tuple(valid.shape)} does not broadcast to (B, H, T) = {(b, h, t)}") from None
    return e, e.stride(), True


def _perm_i32(perm, h, d, dev, validate: bool):
    """(int32 (H, D) contiguous, has_perm) for an optional per-head permutation (H' | H rows:
    kv head ``h`` uses row ``h // (H / H')``, like :func:`kvcalib.quant.transforms.apply_perm`)."""
    if perm is None:
        return torch.zeros(1, dtype=torch.int32, device=dev), False
    if not isinstance(perm, torch.Tensor) or perm.dim() != 2 or perm.is_floating_point() or perm.dtype == torch.bool:
        raise ValueError(f"perm must be an integer (H, D) tensor, got {getattr(perm, 'dtype', type(perm))} "
                         f"{tuple(getattr(perm, 'shape', ()))}")
    if perm.shape[1] != d or perm.shape[0] < 1 or h % perm.shape[0]:
        raise ValueError(f"perm of shape {tuple(perm.shape)} does not fit H={h} kv heads and D={d} channels")
    if validate and not bool((torch.sort(perm.long(), dim=-1).values == torch.arange(d, device=perm.device)).all()):
        raise ValueError("perm must hold a permutation of 0..D-1 per head")
    p = perm.to(device=dev, dtype=torch.int32)
    if p.shape[0] != h:
        p = p.repeat_interleave(h // p.shape[0], dim=0)  # (H, D)
    return p.contiguous(), True


def _mean_f32(mean, b, t, d, dev):
    """(float32 (B, T, D) contiguous, has_mean) for an optional ``mean_hat`` (B, 1, T, D)."""
    if mean is None:
        return torch.zeros(1, dtype=torch.float32, device=dev), False
    if not isinstance(mean, torch.Tensor) or mean.dtype != torch.float32 or tuple(mean.shape) != (b, 1, t, d):
        raise ValueError(f"mean must be float32 (B, 1, T, D) = {(b, 1, t, d)}, got "
                         f"{getattr(mean, 'dtype', type(mean))} {tuple(getattr(mean, 'shape', ()))}")
    return mean.to(dev).contiguous(), True


def quantize_pack_keys(k: torch.Tensor, bits: int, group: int, clip=1.0, valid: torch.Tensor | None = None,
                       *, perm: torch.Tensor | None = None, mean: torch.Tensor | None = None,
                       validate: bool = True) -> QuantizedTensor:
    """Per-channel keys over groups of ``group`` tokens, quantized and planar-packed in one pass.

    Same arguments and result as :func:`kvcalib_kernels.reference.quantize_pack_keys_reference`:
    k ``(B, H, T, D)`` (``T % group == 0``) -> codes uint8 ``(B, H, T, D * bits / 8)``,
    scale/zero float16 ``(B, H, T / group, D)``. With ``perm`` (integer ``(H, D)``, stored channel
    ``j`` = input channel ``perm[h, j]``) and/or ``mean`` (float32 ``(B, 1, T, D)``, the stored mean
    from :func:`center_pack`) it quantizes ``apply_perm(k - mean, perm)``, as
    :func:`kvcalib.codec.quantize_reference`. ``validate`` checks finiteness, clip range
    and the permutation (device syncs); set it False to keep a flush sync-free.
    """
    k = _check_input(k, "k", bits, validate)
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise ValueError(f"group must be a positive int, got {group!r}")
    b, h, t, d = k.shape
    if t % group:
        raise ValueError(f"keys are grouped along tokens: T={t} must be a multiple of group={group}")
    dev = k.device
    # channels per plane (D / 8 at 3 bits: 8 one-bit planes) and code bytes per token
    p, row = d // length_multiple(bits), packed_width(d, bits)
    codes = torch.empty((b, h, t, row), dtype=torch.uint8, device=dev)
    scale = torch.empty((b, h, t // group, d), dtype=torch.float16, device=dev)
    zero = torch.empty_like(scale)
    if k.numel():
        vt, vs, has_valid = _valid_u8(valid, b, h, t, dev)
        ct, cs, has_clip = _expand_clip(clip, (b, h, t // group, d), dev, validate)
        pt, has_perm = _perm_i32(perm, h, d, dev, validate)
        mt, has_mean = _mean_f32(mean, b, t, d, dev)
        g_pad = triton.next_power_of_2(group)
        pb = min(triton.next_power_of_2(p), max(1, 4096 // g_pad))  # keep the (G, PB) tile ~4K elements
        _quant_keys_kernel[(b * h, t // group, triton.cdiv(p, pb))](
            k, *k.stride()[:3], vt, *vs, ct, *cs, pt, mt, codes, scale, zero, t, h,
            D=d, P=p, BITS=bits, GROUP=group, G_PAD=g_pad, PB=pb, HAS_VALID=has_valid, HAS_CLIP=has_clip,
            HAS_PERM=has_perm, HAS_MEAN=has_mean, ROW=row, num_warps=4, enable_fp_fusion=False)
    return QuantizedTensor(codes, scale, zero, bits, group, "token")


def quantize_pack_values(v: torch.Tensor, bits: int, group: int, clip=1.0, valid: torch.Tensor | None = None,
                         *, perm: torch.Tensor | None = None, mean: torch.Tensor | None = None,
                         validate: bool = True) -> QuantizedTensor:
    """Per-token values over contiguous groups of ``group`` channels, quantized and packed.

    Same arguments and result as :func:`kvcalib_kernels.reference.quantize_pack_values_reference`:
    v ``(B, H, T, D)`` (``D % group == 0``, ``group`` a power of two) -> codes uint8
    ``(B, H, T, D * bits / 8)``, scale/zero float16 ``(B, H, T, D / group)``. ``perm``, ``mean``
    and ``validate`` as in :func:`quantize_pack_keys` (also used for per-token keys).
    """
    v = _check_input(v, "v", bits, validate)
    if isinstance(group, bool) or not isinstance(group, int) or group < 1 or group & (group - 1):
        raise ValueError(f"group must be a positive power of two for this kernel, got {group!r}")
    b, h, t, d = v.shape
    if d % group:
        raise ValueError(f"values are grouped along channels: D={d} must be a multiple of group={group}")
    dev = v.device
    # channels per plane (D / 8 at 3 bits: 8 one-bit planes) and code bytes per token
    p, row = d // length_multiple(bits), packed_width(d, bits)
    codes = torch.empty((b, h, t, row), dtype=torch.uint8, device=dev)
    scale = torch.empty((b, h, t, d // group), dtype=torch.float16, device=dev)
    zero = torch.empty_like(scale)
    if v.numel():
        vt, vs, has_valid = _valid_u8(valid, b, h, t, dev)
        ct, cs, has_clip = _expand_clip(clip, (b, h, t, d // group), dev, validate)
        pt, has_perm = _perm_i32(perm, h, d, dev, validate)
        mt, has_mean = _mean_f32(mean, b, t, d, dev)
        w = min(group, p)
        tb = max(1, min(64, 4096 // d))
        tb = min(tb, triton.next_power_of_2(t))
        _quant_values_kernel[(b * h, triton.cdiv(t, tb))](
            v, *v.stride()[:3], vt, *vs, ct, *cs, pt, mt, codes, scale, zero, t, h,
            D=d, P=p, BITS=bits, GROUP=group, W=w, TB=tb, HAS_VALID=has_valid, HAS_CLIP=has_clip,
            HAS_PERM=has_perm, HAS_MEAN=has_mean, ROW=row, num_warps=4, enable_fp_fusion=False)
    return QuantizedTensor(codes, scale, zero, bits, group, "channel")


def center_pack(x: torch.Tensor, mean_bits: int, *, validate: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor | None, QuantizedTensor | None]:
    """TaDA's stored mean over kv heads, as :func:`kvcalib.codec.center_reference`.

    x ``(B, H, T, D)`` (``H <= MAX_CENTER_HEADS``) -> ``(mean_hat, mean16, mean_q)``: ``mean_hat``
    float32 ``(B, 1, T, D)``, the stored mean dequantized (subtract it through the ``mean``
    argument of the quantize functions); ``mean_bits == 16``: ``mean16`` float16 ``(B, 1, T, D)``,
    ``mean_q`` None; ``mean_bits == 8``: ``mean16`` None, ``mean_q`` the 8-bit per-token codes of
    ``mean_hat`` over one group of D channels (codes ``(B, 1, T, D)``, scale/zero ``(B, 1, T, 1)``).
    """
    x = _check_input(x, "x", 8, validate)
    if mean_bits not in (8, 16) or isinstance(mean_bits, bool):
        raise ValueError(f"mean_bits must be 8 or 16, got {mean_bits!r}")
    b, h, t, d = x.shape
    if h > MAX_CENTER_HEADS:
        raise ValueError(f"{h} kv heads: center_pack sums at most {MAX_CENTER_HEADS} heads in torch's order")
    dev = x.device
    mean_hat = torch.empty((b, 1, t, d), dtype=torch.float32, device=dev)
    dummy = torch.empty(1, dtype=torch.uint8, device=dev)
    mean16 = mcodes = mscale = mzero = None
    if mean_bits == 16:
        mean16 = torch.empty((b, 1, t, d), dtype=torch.float16, device=dev)
    else:
        mcodes = torch.empty((b, 1, t, d), dtype=torch.uint8, device=dev)
        mscale = torch.empty((b, 1, t, 1), dtype=torch.float16, device=dev)
        mzero = torch.empty_like(mscale)
    if x.numel():
        tb = max(1, min(64, 4096 // d))
        tb = min(tb, triton.next_power_of_2(t))
        _center_kernel[(b, triton.cdiv(t, tb))](
            x, *x.stride()[:3], mean_hat, *(dummy if a is None else a for a in (mean16, mcodes, mscale, mzero)), t,
            H=h, D=d, TB=tb, MEAN_BITS=mean_bits, num_warps=4, enable_fp_fusion=False)
    mean_q = None if mcodes is None else QuantizedTensor(mcodes, mscale, mzero, 8, d, "channel")
    return mean_hat, mean16, mean_q
