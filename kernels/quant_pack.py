"""Quantize-and-pack a block of K or V in one pass: bit-exact with kvcalib.quant.uniform.

The specification is :func:`kvcalib.quant.uniform.quantize_keys` /
:func:`~kvcalib.quant.uniform.quantize_values` followed by
:func:`kvcalib.quant.packing.pack_codes` (re-exported as
:func:`kvcalib_kernels.reference.quantize_pack_keys_reference` / ``..._values_reference``):
same codes, same float16 scale and zero, bit for bit (the tests use ``torch.equal``).

How bit-exactness is kept (the reference's "Arithmetic" notes):

- min/max are exact; ``scale16 = f16(div_rn(hi - lo, qmax))``, ``zero16 = f16(lo)``
  (round-to-nearest casts, like torch);
- ``t = div_rn(x - zero16, scale16)``: IEEE division (Triton's default ``/`` is approximate);
- ``round`` is half-to-even like ``torch.round``: after clamping ``t`` to ``[0, qmax]``
  (clamping first is equivalent: the bounds are integers), ``(t + 1.5 * 2**23) - 1.5 * 2**23``
  rounds to the nearest integer, ties to even, in float32;
- the clip arithmetic ``c - alpha * (c - lo)`` must not become a fused multiply-add (torch
  rounds the product): the kernels launch with ``enable_fp_fusion=False``.

Keys (per channel over groups of ``group`` tokens): grid ``(B * H, T / group, cdiv(P, PB))``; a
program loads, for each of the ``8 / bits`` planes, the ``(group, PB)`` tile of that plane's
channels, reduces over tokens, and ORs the plane's codes into one ``(group, PB)`` byte tile.
Values (per token over groups of ``group`` channels): grid ``(B * H, cdiv(T, TB))``; each plane is
a ``(TB, P / W, W)`` tile, ``W = min(group, P)``, so each group is a reduction over the last axis
(a group wider than a plane is reduced from its own ``(TB, group)`` tile).

Not checked by the kernels: the reference raises on NaN/inf inputs and on float16 overflow of a
parameter; here ``validate=True`` (default) checks finiteness first (one device sync), else
non-finite inputs give unspecified codes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcalib.quant.uniform import QuantizedTensor

__all__ = ["quantize_pack_keys", "quantize_pack_values"]



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
def _quant_keys_kernel(
    # input (B, H, T, D) float, last dim contiguous
    X, stride_xb, stride_xh, stride_xt,
    # valid tokens (B, H, T) uint8 (expanded: strides may be 0), used when HAS_VALID
    VALID, stride_vb, stride_vh, stride_vt,
    # clip alpha (B, H, T/GROUP, D) float32 (expanded), used when HAS_CLIP
    CLIP, stride_cb, stride_ch, stride_cg, stride_cd,
    # outputs: codes (B, H, T, P) uint8; scale/zero (B, H, T/GROUP, D) float16; all contiguous
    CODES, SCALE, ZERO, T, H,
    D: tl.constexpr, P: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr,
    PB: tl.constexpr, HAS_VALID: tl.constexpr, HAS_CLIP: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    g = tl.program_id(1)  # token group
    pb0 = tl.program_id(2) * PB  # first byte column of this program
    b = pid_bh // H
    h = pid_bh % H
    QMAX: tl.constexpr = (1 << BITS) - 1
    PER: tl.constexpr = 8 // BITS
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
    prow = (pid_bh.to(tl.int64) * (T // GROUP) + g) * D  # scale/zero row of this group
    packed = tl.zeros([G_PAD, PB], tl.uint8)
    for s in tl.static_range(PER):
        cols = s * P + offs_p  # (PB,) channels of plane s
        x = tl.load(x_rows[:, None] + cols[None, :], mask=t_ok[:, None] & p_ok[None, :], other=0.0).to(tl.float32)
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
        packed = packed | (code << (s * BITS))
    out_rows = (pid_bh.to(tl.int64) * T + offs_t) * P  # (G_PAD,)
    tl.store(CODES + out_rows[:, None] + offs_p[None, :], packed, mask=t_ok[:, None] & p_ok[None, :])


@triton.jit
def _quant_values_kernel(
    # input (B, H, T, D) float, last dim contiguous
    X, stride_xb, stride_xh, stride_xt,
    # valid tokens (B, H, T) uint8 (expanded), used when HAS_VALID
    VALID, stride_vb, stride_vh, stride_vt,
    # clip alpha (B, H, T, D/GROUP) float32 (expanded), used when HAS_CLIP
    CLIP, stride_cb, stride_ch, stride_ct, stride_cg,
    # outputs: codes (B, H, T, P) uint8; scale/zero (B, H, T, D/GROUP) float16; all contiguous
    CODES, SCALE, ZERO, T, H,
    D: tl.constexpr, P: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, W: tl.constexpr,
    TB: tl.constexpr, HAS_VALID: tl.constexpr, HAS_CLIP: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    b = pid_bh // H
    h = pid_bh % H
    QMAX: tl.constexpr = (1 << BITS) - 1
    PER: tl.constexpr = 8 // BITS
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
    prows = (pid_bh.to(tl.int64) * T + offs_t) * NG  # (TB,) scale/zero rows
    m3 = t_ok[:, None, None]
    packed = tl.zeros([TB, NGP, W], tl.uint8)
    for s in tl.static_range(PER):
        x = tl.load(x_rows[:, None, None] + s * P + byte3, mask=m3, other=0.0).to(tl.float32)  # (TB, NGP, W)
        gcol = (s * P + offs_g * W) // GROUP  # (NGP,) value group of each sub-group
        if GROUP <= P:
            lo = tl.min(x, axis=2)  # (TB, NGP)
            hi = tl.max(x, axis=2)
        else:
            # the group spans several planes: reduce over its own (TB, GROUP) tile
            gch = ((s * P) // GROUP) * GROUP + tl.arange(0, GROUP)
            xg = tl.load(x_rows[:, None] + gch[None, :], mask=t_ok[:, None], other=0.0).to(tl.float32)
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
        packed = packed | (code << (s * BITS))
    out = CODES + ((pid_bh.to(tl.int64) * T + offs_t) * P)[:, None, None] + byte3
    tl.store(out, packed, mask=m3)


# ---------------------------------------------------------------- launchers


def _check_input(x: torch.Tensor, name: str, bits: int, validate: bool) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or not x.is_floating_point():
        raise ValueError(f"{name} must be a float (B, H, T, D) tensor, got "
                         f"{getattr(x, 'dtype', type(x))} {tuple(getattr(x, 'shape', ()))}")
    if bits not in (2, 4, 8) or isinstance(bits, bool):
        raise ValueError(f"bits must be one of (2, 4, 8), got {bits!r}")
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


def quantize_pack_keys(k: torch.Tensor, bits: int, group: int, clip=1.0, valid: torch.Tensor | None = None,
                       *, validate: bool = True) -> QuantizedTensor:
    """Per-channel keys over groups of ``group`` tokens, quantized and planar-packed in one pass.

    Same arguments and result as :func:`kvcalib_kernels.reference.quantize_pack_keys_reference`:
    k ``(B, H, T, D)`` (``T % group == 0``) -> codes uint8 ``(B, H, T, D * bits / 8)``,
    scale/zero float16 ``(B, H, T / group, D)``. ``validate`` checks finiteness and clip range
    (one device sync); set it False to keep a flush sync-free.
    """
    k = _check_input(k, "k", bits, validate)
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise ValueError(f"group must be a positive int, got {group!r}")
    b, h, t, d = k.shape
    if t % group:
        raise ValueError(f"keys are grouped along tokens: T={t} must be a multiple of group={group}")
    dev = k.device
    per = 8 // bits
    p = d // per
    codes = torch.empty((b, h, t, p), dtype=torch.uint8, device=dev)
    scale = torch.empty((b, h, t // group, d), dtype=torch.float16, device=dev)
    zero = torch.empty_like(scale)
    if k.numel():
        vt, vs, has_valid = _valid_u8(valid, b, h, t, dev)
        ct, cs, has_clip = _expand_clip(clip, (b, h, t // group, d), dev, validate)
        g_pad = triton.next_power_of_2(group)
        pb = min(triton.next_power_of_2(p), max(1, 4096 // g_pad))  # keep the (G, PB) tile ~4K elements
        _quant_keys_kernel[(b * h, t // group, triton.cdiv(p, pb))](
            k, *k.stride()[:3], vt, *vs, ct, *cs, codes, scale, zero, t, h,
            D=d, P=p, BITS=bits, GROUP=group, G_PAD=g_pad, PB=pb, HAS_VALID=has_valid, HAS_CLIP=has_clip,
            num_warps=4, enable_fp_fusion=False)
    return QuantizedTensor(codes, scale, zero, bits, group, "token")


def quantize_pack_values(v: torch.Tensor, bits: int, group: int, clip=1.0, valid: torch.Tensor | None = None,
                         *, validate: bool = True) -> QuantizedTensor:
    """Per-token values over contiguous groups of ``group`` channels, quantized and packed.

    Same arguments and result as :func:`kvcalib_kernels.reference.quantize_pack_values_reference`:
    v ``(B, H, T, D)`` (``D % group == 0``, ``group`` a power of two) -> codes uint8
    ``(B, H, T, D * bits / 8)``, scale/zero float16 ``(B, H, T, D / group)``.
    """
    v = _check_input(v, "v", bits, validate)
    if isinstance(group, bool) or not isinstance(group, int) or group < 1 or group & (group - 1):
        raise ValueError(f"group must be a positive power of two for this kernel, got {group!r}")
    b, h, t, d = v.shape
    if d % group:
        raise ValueError(f"values are grouped along channels: D={d} must be a multiple of group={group}")
    dev = v.device
    per = 8 // bits
    p = d // per
    codes = torch.empty((b, h, t, p), dtype=torch.uint8, device=dev)
    scale = torch.empty((b, h, t, d // group), dtype=torch.float16, device=dev)
    zero = torch.empty_like(scale)
    if v.numel():
        vt, vs, has_valid = _valid_u8(valid, b, h, t, dev)
        ct, cs, has_clip = _expand_clip(clip, (b, h, t, d // group), dev, validate)
        w = min(group, p)
        tb = max(1, min(64, 4096 // d))
        tb = min(tb, triton.next_power_of_2(t))
        _quant_values_kernel[(b * h, triton.cdiv(t, tb))](
            v, *v.stride()[:3], vt, *vs, ct, *cs, codes, scale, zero, t, h,
            D=d, P=p, BITS=bits, GROUP=group, W=w, TB=tb, HAS_VALID=has_valid, HAS_CLIP=has_clip,
            num_warps=4, enable_fp_fusion=False)
    return QuantizedTensor(codes, scale, zero, bits, group, "channel")
