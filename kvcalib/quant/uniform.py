"""Asymmetric uniform quantization of K and V in the KIVI layout: the PyTorch reference.

Every quantize / dequantize kernel must reproduce these functions bit for bit (codes and
float16 parameters exactly; dequantized values exactly, see "Arithmetic" below).

Layout (KIVI):
    keys    per-channel: each group of ``group`` consecutive *tokens* shares one (scale, zero)
            per channel.  k ``(B, H, T, D)`` -> scale/zero ``(B, H, T // group, D)``,
            ``axis = "token"`` (the axis the group runs along).
    values  per-token: each token's channels are cut into contiguous groups of ``group``
            channels.  v ``(B, H, T, D)`` -> scale/zero ``(B, H, T, D // group)``,
            ``axis = "channel"``.
Codes are packed along D with :mod:`kvcalib.quant.packing` (planar layout), so both kinds
store codes as uint8 ``(B, H, T, packed_width(D, bits))``. Any number of leading dimensions
is accepted in place of ``(B, H)``.

Parameters of a group with range ``[lo, hi]`` (min/max over the group's valid elements):
    clip (SKVQ)  alpha in (0, 1]: ``c = (hi + lo) * 0.5``, ``lo' = c - alpha * (c - lo)``,
                 ``hi' = c + alpha * (hi - c)``; elements outside are clamped by the code range.
                 Where alpha == 1 exactly, ``lo' = lo`` and ``hi' = hi`` (no rounding drift).
    scale        ``scale16 = float16((hi' - lo') / (2**bits - 1))``
    zero         ``zero16  = float16(lo')``
The codes are computed from the float16-rounded parameters (cast back to float32), so that
quantize and dequantize agree exactly.

Arithmetic (all float32):
    encode  ``code = clamp(round((x - zero16) / scale16), 0, 2**bits - 1)`` with ``torch.round``,
            i.e. round half to even; where ``scale16 == 0`` (constant group, or a range too small
            for float16) the division is skipped and ``code = 0``. The subtraction and the
            division are each one IEEE round-to-nearest float32 op: a Triton kernel must use
            ``tl.math.div_rn`` (the default ``/`` on fp32 is an approximate division) to get the
            same codes.
    decode  ``x_hat = code * scale16 + zero16``. ``code * scale16`` is exact in float32 (an
            8-bit integer times an 11-bit float16 significand fits in 24 bits), so a fused
            multiply-add and a multiply followed by an add give the same bits.

Error bound (what the tests assert): for x in ``[lo', hi']``, with ``qmax = 2**bits - 1``,
``|x - x_hat| <= scale16 / 2 + max(0, zero16 - lo') + max(0, hi' - zero16 - qmax * scale16)``
plus a few float32 ulps; the two ``max`` terms are the float16 rounding of the zero and of
the scale times qmax (the extremes can fall just outside the representable grid).

Non-uniform levels (optional ``levels``, float32 ``(2**bits,)`` strictly increasing, in code
units: the uniform grid is ``levels[c] = c``): the same group parameters, then
``t = (x - zero16) / scale16`` (the same IEEE division), ``code`` = the index of the level nearest
``t``, ties to the lower level (``torch.bucketize`` on the midpoints ``(levels[c] + levels[c+1]) / 2``,
so ``t`` beyond the grid takes the end codes), ``code = 0`` where ``scale16 == 0``; decode
``x_hat = levels[code] * scale16 + zero16`` in float32 (a Lloyd-Max codebook fitted to where the
values of a group fall: :mod:`kvcalib.methods.levels`).

8-bit pairs (optional ``pair``, a :class:`~kvcalib.quant.pair8.Pair8` of calibrated tables): the
same clipped range, then the group's stored scale and zero are a uint8 exponent and an int8 zero
step on the tables (:mod:`kvcalib.quant.pair8`), the codes computed from the float32 scale and zero
those decode to; :class:`QuantizedTensor` then holds ``scale`` uint8 and ``zero`` int8, and
dequantizing needs the same tables. A group without valid elements then decodes near 0, not to
exactly 0 (its zero is the grid point nearest 0).

Padding: an optional ``valid`` bool mask, broadcastable to ``(B, H, T)`` (e.g.
``attention_mask[:, None, :]``), excludes invalid tokens from the min/max. Invalid tokens still
get codes (clamped into the range of their group). A group with no valid element gets
``scale16 = zero16 = 0`` and therefore decodes to exactly 0. For values every group lies
inside one token, so an invalid token's groups are all empty and decode to 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcalib.errors import CalibrationError
from kvcalib.quant.packing import SUPPORTED_BITS, length_multiple, pack_codes, unpack_codes, unpacked_length
from kvcalib.quant.pair8 import Pair8, pair_floats, pair_params

__all__ = [
    "QuantizedTensor",
    "fit_params",
    "encode",
    "decode",
    "quantize_keys",
    "quantize_values",
    "dequantize_keys",
    "dequantize_values",
    "dequantize",
    "quantize_dequantize_keys",
    "quantize_dequantize_values",
    "check_levels",
    "code_units",
    "quantize_fixed",
    "requantize",
]

_AXES = ("token", "channel")
ClipArg = float | torch.Tensor


@dataclass
class QuantizedTensor:
    """Packed K or V of one cache segment, with its group parameters.

    Attributes:
        codes: uint8 ``(B, H, T, packed_width(D, bits))``, planar packing along D.
        scale: float16, keys ``(B, H, T // group, D)``; values ``(B, H, T, D // group)``; or, in
            the 8-bit pair format (:attr:`pair8`), uint8 exponents on the side's tables.
        zero: float16, same shape as ``scale`` (the group's clipped minimum); or int8 zero steps
            (8-bit pairs).
        bits: 2, 3, 4 or 8.
        group: group size: tokens per group for keys, channels per group for values.
        axis: ``"token"`` (keys: groups run along T) or ``"channel"`` (values: along D).
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    group: int
    axis: str

    def __post_init__(self) -> None:
        _check_bits(self.bits)
        if self.axis not in _AXES:
            raise ValueError(f"axis must be one of {_AXES}, got {self.axis!r}")
        _check_group(self.group)
        if self.codes.dtype != torch.uint8 or self.codes.dim() < 2:
            raise ValueError(
                f"codes must be uint8 (..., T, P), got {self.codes.dtype} {tuple(self.codes.shape)}"
            )
        if self.pair8:
            if self.zero.dtype != torch.int8:
                raise ValueError(f"an 8-bit pair's zero must be int8 (its scale is uint8), got {self.zero.dtype}")
        else:
            for name in ("scale", "zero"):
                t = getattr(self, name)
                if t.dtype != torch.float16:
                    raise ValueError(f"{name} must be float16 (or uint8 / int8: an 8-bit pair), got {t.dtype}")
        if self.scale.shape != self.zero.shape:
            raise ValueError(
                f"scale {tuple(self.scale.shape)} and zero {tuple(self.zero.shape)} differ in shape"
            )
        *lead, t, d = self.shape
        if self.axis == "token":
            expected = (*lead, t // self.group, d)
        else:
            expected = (*lead, t, d // self.group)
        divisible = (t if self.axis == "token" else d) % self.group == 0
        if not divisible or tuple(self.scale.shape) != expected:
            raise ValueError(
                f"scale/zero shape {tuple(self.scale.shape)} does not fit codes of unpacked shape "
                f"{self.shape} with group {self.group} along {self.axis}; expected {expected}"
            )

    @property
    def pair8(self) -> bool:
        """Whether scale and zero are an 8-bit pair (uint8 exponent, int8 zero step) on calibrated
        tables (:mod:`kvcalib.quant.pair8`) rather than float16 numbers."""
        return self.scale.dtype == torch.uint8

    @property
    def shape(self) -> tuple[int, ...]:
        """The unpacked shape ``(B, H, T, D)``."""
        *lead, width = self.codes.shape
        return (*lead, unpacked_length(width, self.bits))

    def numel(self) -> int:
        """Number of quantized elements, ``B * H * T * D``."""
        n = 1
        for s in self.shape:
            n *= s
        return n

    def nbytes(self) -> int:
        """Bytes held: packed codes + scale + zero (float16 each, or one byte each as an 8-bit pair)."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero))

    def bits_per_element(self) -> float:
        """``8 * nbytes() / numel()``: payload plus parameter overhead, in bits per element."""
        return 8.0 * self.nbytes() / max(self.numel(), 1)


# ---------------------------------------------------------------- validation helpers


def _check_bits(bits: int) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")
    return bits


def _check_group(group: int) -> int:
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise ValueError(f"group must be a positive int, got {group!r}")
    return group


def _as_float32(x: torch.Tensor, name: str) -> torch.Tensor:
    """Validate a K/V input ``(..., T, D)`` and return it as float32 (a copy only if needed)."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if x.dim() < 2:
        raise ValueError(f"{name} must have shape (..., T, D), got {tuple(x.shape)}")
    x = x.float()
    if torch.isnan(x).any():
        raise ValueError(f"{name} contains NaN; quantization needs finite inputs")
    if torch.isinf(x).any():
        raise ValueError(f"{name} contains inf; quantization needs finite inputs")
    return x


def _check_packable(d: int, bits: int) -> None:
    if d % length_multiple(bits):
        raise ValueError(
            f"{bits}-bit codes pack in runs of {length_multiple(bits)} channels: "
            f"D={d} must be a multiple of {length_multiple(bits)}"
        )


def _check_valid(valid: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    """Return ``valid`` expanded to ``x.shape[:-1]`` = ``(..., T)``, or None."""
    if valid is None:
        return None
    if not isinstance(valid, torch.Tensor) or valid.dtype != torch.bool:
        raise ValueError(f"valid must be a bool tensor, got {getattr(valid, 'dtype', type(valid))}")
    target = tuple(x.shape[:-1])
    try:
        ok = tuple(torch.broadcast_shapes(valid.shape, target)) == target
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(
            f"valid of shape {tuple(valid.shape)} does not broadcast to (..., T) = {target}"
        )
    return valid.to(x.device).expand(target)


def _clip_tensor(
    clip: ClipArg, shape: tuple[int, ...], device: torch.device
) -> torch.Tensor | None:
    """Validate ``clip`` against the parameter shape; None means no clipping (alpha == 1)."""
    if isinstance(clip, torch.Tensor):
        if not clip.is_floating_point():
            raise ValueError(f"clip must be a float or a floating tensor, got {clip.dtype}")
        try:
            ok = tuple(torch.broadcast_shapes(clip.shape, shape)) == tuple(shape)
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(
                f"clip of shape {tuple(clip.shape)} does not broadcast to the scale shape "
                f"{tuple(shape)}"
            )
        alpha = clip.to(device=device, dtype=torch.float32)
        if not bool(((alpha > 0) & (alpha <= 1)).all()):
            raise ValueError("clip values must lie in (0, 1] (1 means no clipping)")
        return alpha
    if isinstance(clip, bool) or not isinstance(clip, int | float):
        raise ValueError(f"clip must be a float in (0, 1] or a tensor, got {clip!r}")
    if not 0.0 < float(clip) <= 1.0:
        raise ValueError(f"clip must lie in (0, 1] (1 means no clipping), got {clip!r}")
    if float(clip) == 1.0:
        return None
    return torch.tensor(float(clip), dtype=torch.float32, device=device)


# ---------------------------------------------------------------- the arithmetic


def fit_params(
    lo: torch.Tensor, hi: torch.Tensor, bits: int, clip: ClipArg = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group range -> float16 ``(scale16, zero16)`` (see the module docstring for the formulas).

    Args:
        lo, hi: float32, same shape ``S`` (the parameter shape), ``lo <= hi``.
        bits: 2, 3, 4 or 8.
        clip: alpha in (0, 1], a float or a float tensor broadcastable to ``S``.

    Returns:
        ``scale16``, ``zero16``: float16 ``S``.

    Raises ValueError if a parameter does not fit in float16.
    """
    qmax = (1 << _check_bits(bits)) - 1
    lo, hi = clipped_range(lo, hi, clip)
    # tensor / tensor: IEEE division on every device (PyTorch's CUDA tensor / Python-scalar
    # multiplies by the reciprocal, which rounds differently from the Triton kernel's div_rn)
    scale16 = ((hi - lo) / torch.full_like(hi, float(qmax))).to(torch.float16)  # (S)
    zero16 = lo.to(torch.float16)  # (S)
    if not (torch.isfinite(scale16).all() and torch.isfinite(zero16).all()):
        raise ValueError(
            "a quantization group's range does not fit in float16 (|value| or range/"
            f"(2**bits-1) above {torch.finfo(torch.float16).max}); rescale the input"
        )
    return scale16, zero16


def clipped_range(lo: torch.Tensor, hi: torch.Tensor, clip: ClipArg = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """A group range ``[lo, hi]`` (float32 ``S``) narrowed by clip ``alpha`` (module docstring);
    alpha == 1 returns the range unchanged (bit for bit)."""
    alpha = _clip_tensor(clip, tuple(lo.shape), lo.device)
    if alpha is not None:
        c = (hi + lo) * 0.5  # (S)
        lo_c = c - alpha * (c - lo)
        hi_c = c + alpha * (hi - c)
        # alpha == 1 must reproduce the unclipped range exactly, not up to rounding of c
        lo = torch.where(alpha == 1.0, lo, lo_c)
        hi = torch.where(alpha == 1.0, hi, hi_c)
    return lo, hi


def group_params(lo: torch.Tensor, hi: torch.Tensor, bits: int, clip: ClipArg = 1.0, pair: Pair8 | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A group range -> ``(stored scale, stored zero, scale, zero)``: the stored pair (float16, or
    with ``pair`` uint8 / int8) and the float32 values the codes are computed from and decode with.
    ``lo``, ``hi`` float32 ``(..., H, X, C)`` (the parameters' shape)."""
    if pair is None:
        scale16, zero16 = fit_params(lo, hi, bits, clip)
        return scale16, zero16, scale16.float(), zero16.float()
    lo_c, hi_c = clipped_range(lo, hi, clip)
    e, m = pair_params(lo_c, hi_c, _check_bits(bits), pair)
    scale, zero = pair_floats(e, m, bits, pair)
    return e, m, scale, zero


def param_floats(qt: "QuantizedTensor", pair: Pair8 | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 ``(scale, zero)`` a stored block decodes with: its float16 pair, or its 8-bit
    pair on ``pair``'s tables (a ValueError if one is given without the other)."""
    if qt.pair8:
        if pair is None:
            raise ValueError("this block stores 8-bit scale/zero pairs: dequantizing it needs the side's pair tables")
        return pair_floats(qt.scale, qt.zero, qt.bits, pair)
    if pair is not None:
        raise ValueError("pair tables were given for a block with float16 scale/zero")
    return qt.scale.float(), qt.zero.float()


def check_levels(levels: torch.Tensor | None, bits: int) -> torch.Tensor | None:
    """Validate non-uniform levels for ``bits``: float ``(2**bits,)``, finite, strictly increasing
    (module docstring). Returns them as float32, or None."""
    if levels is None:
        return None
    n = 1 << _check_bits(bits)
    if not isinstance(levels, torch.Tensor) or not levels.is_floating_point() or tuple(levels.shape) != (n,):
        raise ValueError(f"levels for {bits}-bit codes must be a float tensor ({n},), got "
                         f"{getattr(levels, 'dtype', type(levels))} {tuple(getattr(levels, 'shape', ()))}")
    lv = levels.float()
    if not bool(torch.isfinite(lv).all()) or not bool((lv[1:] > lv[:-1]).all()):
        raise ValueError("levels must be finite and strictly increasing")
    return lv


def encode(x: torch.Tensor, scale16: torch.Tensor, zero16: torch.Tensor, bits: int,
           levels: torch.Tensor | None = None) -> torch.Tensor:
    """Unpacked codes: ``clamp(round((x - zero16) / scale16), 0, 2**bits - 1)`` as uint8, or with
    ``levels`` (``(2**bits,)``) the index of the level nearest ``(x - zero16) / scale16`` (ties
    to the lower level).

    Args:
        x: float32 ``X``.
        scale16, zero16: float16 (or float32: the decoded values of an 8-bit pair), broadcastable to ``X``.
        bits: 2, 3, 4 or 8.
        levels: optional non-uniform levels in code units (module docstring).

    Returns:
        uint8 ``X``. ``torch.round`` rounds half to even. Where ``scale16 == 0`` the code is 0.
    """
    qmax = (1 << _check_bits(bits)) - 1
    s = scale16.float()
    z = zero16.float()
    nonzero = s > 0
    # guard the division: a zero scale would make 0/0 = NaN for the constant group itself
    t = (x - z) / torch.where(nonzero, s, torch.ones_like(s))
    if levels is None:
        q = torch.round(t).clamp_(0, qmax)
    else:
        lv = levels.to(device=t.device, dtype=torch.float32)
        q = torch.bucketize(t.contiguous(), (lv[1:] + lv[:-1]) * 0.5).to(t.dtype)  # nearest level, ties to the lower one
    q = torch.where(nonzero, q, torch.zeros_like(q))
    return q.to(torch.uint8)


def decode(codes: torch.Tensor, scale16: torch.Tensor, zero16: torch.Tensor,
           levels: torch.Tensor | None = None) -> torch.Tensor:
    """``codes * scale16 + zero16`` in float32, or ``levels[codes] * scale16 + zero16``.

    codes uint8 ``X``; ``scale16``, ``zero16`` float16 broadcastable to ``X``; ``levels``
    optional float ``(2**bits,)``. Returns float32 ``X``.
    """
    c = codes.float() if levels is None else levels.to(device=codes.device, dtype=torch.float32)[codes.long()]
    return c * scale16.float() + zero16.float()


def _group_range(
    xg: torch.Tensor, dim: int, valid: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """min/max of ``xg`` over ``dim``, over valid elements only; empty groups get ``[0, 0]``."""
    if valid is None:
        return xg.amin(dim=dim), xg.amax(dim=dim)
    inf = torch.tensor(float("inf"), dtype=xg.dtype, device=xg.device)
    lo = torch.where(valid, xg, inf).amin(dim=dim)
    hi = torch.where(valid, xg, -inf).amax(dim=dim)
    empty = ~valid.any(dim=dim)  # broadcastable to lo
    zero = torch.zeros((), dtype=xg.dtype, device=xg.device)
    return torch.where(empty, zero, lo), torch.where(empty, zero, hi)


def _quantize_keys_unpacked(k, bits, group, clip, valid, levels=None, pair=None):
    """Shared by the packed and the fake-quant paths: (codes (..., T, D) uint8, stored scale, stored
    zero) (float16, or uint8 / int8 with ``pair``)."""
    _check_bits(bits)
    _check_group(group)
    x = _as_float32(k, "k")  # (..., T, D)
    *lead, t, d = x.shape
    if t % group:
        raise ValueError(
            f"keys are grouped along tokens: T={t} must be a multiple of group={group}"
        )
    valid = _check_valid(valid, x)  # (..., T) or None
    xg = x.reshape(*lead, t // group, group, d)  # (..., T/G, G, D)
    vg = None if valid is None else valid.reshape(*lead, t // group, group, 1)  # (..., T/G, G, 1)
    lo, hi = _group_range(xg, -2, vg)  # (..., T/G, D)
    stored_s, stored_z, s, z = group_params(lo, hi, bits, clip, pair)  # (..., T/G, D) each
    codes = encode(xg, s.unsqueeze(-2), z.unsqueeze(-2), bits, levels)  # (..., T/G, G, D)
    return codes.reshape(*lead, t, d), stored_s, stored_z


def _quantize_values_unpacked(v, bits, group, clip, valid, levels=None, pair=None):
    """Shared by the packed and the fake-quant paths: (codes (..., T, D) uint8, stored scale, stored
    zero) (float16, or uint8 / int8 with ``pair``)."""
    _check_bits(bits)
    _check_group(group)
    x = _as_float32(v, "v")  # (..., T, D)
    *lead, t, d = x.shape
    if d % group:
        raise ValueError(
            f"values are grouped along channels: D={d} must be a multiple of group={group}"
        )
    valid = _check_valid(valid, x)  # (..., T) or None
    xg = x.reshape(*lead, t, d // group, group)  # (..., T, D/G, G)
    vg = None if valid is None else valid.reshape(*lead, t, 1, 1)  # (..., T, 1, 1)
    lo, hi = _group_range(xg, -1, vg)  # (..., T, D/G)
    stored_s, stored_z, s, z = group_params(lo, hi, bits, clip, pair)  # (..., T, D/G) each
    codes = encode(xg, s.unsqueeze(-1), z.unsqueeze(-1), bits, levels)  # (..., T, D/G, G)
    return codes.reshape(*lead, t, d), stored_s, stored_z


def code_units(x: torch.Tensor, bits: int, group: int, per_channel: bool, clip: ClipArg = 1.0
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each element of ``x (..., T, D)`` falls on its group's grid: ``t = (x - zero16) /
    scale16`` as the encoder computes it (0 where ``scale16 == 0``), float32 ``(..., T, D)``, and
    each element's ``scale16`` as float32 ``(..., T, D)``. Keys per channel over ``group`` tokens
    (``per_channel``) or per token over ``group`` channels; ``clip`` as for the quantizers. What
    non-uniform levels are fitted to (:mod:`kvcalib.methods.levels`)."""
    _check_bits(bits)
    _check_group(group)
    xf = _as_float32(x, "x")
    *lead, t, d = xf.shape
    if per_channel:
        if t % group:
            raise ValueError(f"keys are grouped along tokens: T={t} must be a multiple of group={group}")
        xg = xf.reshape(*lead, t // group, group, d)  # (..., T/G, G, D)
        lo, hi = _group_range(xg, -2, None)
        scale16, zero16 = fit_params(lo, hi, bits, clip)  # (..., T/G, D)
        s, z = scale16.float().unsqueeze(-2), zero16.float().unsqueeze(-2)
    else:
        if d % group:
            raise ValueError(f"values are grouped along channels: D={d} must be a multiple of group={group}")
        xg = xf.reshape(*lead, t, d // group, group)  # (..., T, D/G, G)
        lo, hi = _group_range(xg, -1, None)
        scale16, zero16 = fit_params(lo, hi, bits, clip)  # (..., T, D/G)
        s, z = scale16.float().unsqueeze(-1), zero16.float().unsqueeze(-1)
    nonzero = s > 0
    units = torch.where(nonzero, (xg - z) / torch.where(nonzero, s, torch.ones_like(s)), torch.zeros_like(xg))
    return units.reshape(*lead, t, d), s.expand_as(xg).reshape(*lead, t, d)


def quantize_fixed(x: torch.Tensor, bits: int, group: int, per_channel: bool, scale16: torch.Tensor,
                   zero16: torch.Tensor, levels: torch.Tensor | None = None) -> QuantizedTensor:
    """``x`` (B, H, T, D) on a grid fixed by calibration instead of each group's min/max (KVComp's
    error-bounded quantizer): ``scale16`` / ``zero16`` float16 ``(H, C)`` per kv head and parameter
    column (``C = D``: keys per channel over groups of ``group`` tokens, ``per_channel``; else
    ``C = D / group``: per token over groups of ``group`` channels). The same encode and decode
    arithmetic as the min/max quantizers (so the same stored layout, every group holding its
    column's fixed parameters, and the same dequantization); elements beyond the grid take the
    end codes."""
    _check_bits(bits)
    _check_group(group)
    xf = _as_float32(x, "x")
    b, h, t, d = xf.shape
    cols = d if per_channel else d // group
    if (d % group and not per_channel) or (t % group and per_channel):
        raise ValueError(f"x of shape {tuple(x.shape)} is not whole groups of {group}")
    for name, p in (("scale16", scale16), ("zero16", zero16)):
        if p.dtype != torch.float16 or tuple(p.shape) != (h, cols):
            raise ValueError(f"{name} must be float16 (H={h}, {cols}), got {p.dtype} {tuple(p.shape)}")
    lv = check_levels(levels, bits)
    s, z = scale16.to(xf.device), zero16.to(xf.device)
    if per_channel:
        xg = xf.reshape(b, h, t // group, group, d)  # (B, H, T/G, G, D)
        codes = encode(xg, s[None, :, None, None, :], z[None, :, None, None, :], bits, lv).reshape(b, h, t, d)
        shape = (b, h, t // group, d)
        params = (s[None, :, None, :].expand(shape), z[None, :, None, :].expand(shape))
        axis = "token"
    else:
        xg = xf.reshape(b, h, t, cols, group)  # (B, H, T, D/G, G)
        codes = encode(xg, s[None, :, None, :, None], z[None, :, None, :, None], bits, lv).reshape(b, h, t, d)
        shape = (b, h, t, cols)
        params = (s[None, :, None, :].expand(shape), z[None, :, None, :].expand(shape))
        axis = "channel"
    _check_packable(d, bits)
    return QuantizedTensor(pack_codes(codes, bits), params[0].contiguous(), params[1].contiguous(), bits, group, axis)


# ---------------------------------------------------------------- public API


def quantize_keys(
    k: torch.Tensor,
    bits: int,
    group: int,
    clip: ClipArg = 1.0,
    valid: torch.Tensor | None = None,
    levels: torch.Tensor | None = None,
    pair: Pair8 | None = None,
) -> QuantizedTensor:
    """Per-channel quantization of keys over groups of ``group`` consecutive tokens (KIVI).

    Args:
        k: float ``(B, H, T, D)`` (any float dtype; computed in float32), ``T % group == 0``.
        bits: 2, 3, 4 or 8; ``D`` must be a multiple of ``length_multiple(bits)``.
        group: tokens per group.
        clip: alpha in (0, 1], float or tensor broadcastable to ``(B, H, T // group, D)``.
        valid: optional bool, broadcastable to ``(B, H, T)``; False tokens are left out of
            their group's min/max.
        levels: optional non-uniform levels ``(2**bits,)`` (module docstring).
        pair: optional 8-bit pair tables ``(H, D)`` (module docstring).

    Returns:
        :class:`QuantizedTensor` with ``codes`` uint8 ``(B, H, T, packed_width(D, bits))`` and
        ``scale``/``zero`` float16 (uint8 / int8 with ``pair``) ``(B, H, T // group, D)``, ``axis="token"``.

    Raises ValueError on NaN/inf, bad shapes, bits, group, clip, mask or levels.
    """
    codes, scale16, zero16 = _quantize_keys_unpacked(k, bits, group, clip, valid, check_levels(levels, bits), pair)
    _check_packable(codes.shape[-1], bits)
    return QuantizedTensor(pack_codes(codes, bits), scale16, zero16, bits, group, "token")


def quantize_values(
    v: torch.Tensor,
    bits: int,
    group: int,
    clip: ClipArg = 1.0,
    valid: torch.Tensor | None = None,
    levels: torch.Tensor | None = None,
    pair: Pair8 | None = None,
) -> QuantizedTensor:
    """Per-token quantization of values over contiguous groups of ``group`` channels (KIVI).

    Args:
        v: float ``(B, H, T, D)``, ``D % group == 0``.
        bits: 2, 3, 4 or 8; ``D`` must be a multiple of ``length_multiple(bits)``.
        group: channels per group.
        clip: alpha in (0, 1], float or tensor broadcastable to ``(B, H, T, D // group)``.
        valid: optional bool, broadcastable to ``(B, H, T)``; False tokens get zero parameters
            (their groups hold no valid element) and decode to 0.
        levels: optional non-uniform levels ``(2**bits,)`` (module docstring).
        pair: optional 8-bit pair tables ``(H, D // group)`` (module docstring).

    Returns:
        :class:`QuantizedTensor` with ``codes`` uint8 ``(B, H, T, packed_width(D, bits))`` and
        ``scale``/``zero`` float16 (uint8 / int8 with ``pair``) ``(B, H, T, D // group)``, ``axis="channel"``.

    Raises ValueError on NaN/inf, bad shapes, bits, group, clip, mask or levels.
    """
    codes, scale16, zero16 = _quantize_values_unpacked(v, bits, group, clip, valid, check_levels(levels, bits), pair)
    _check_packable(codes.shape[-1], bits)
    return QuantizedTensor(pack_codes(codes, bits), scale16, zero16, bits, group, "channel")


def dequantize_keys(qt: QuantizedTensor, levels: torch.Tensor | None = None, pair: Pair8 | None = None
                    ) -> torch.Tensor:
    """Keys back to float32 ``(B, H, T, D)``: ``code * scale16 + zero16`` (``levels[code]`` with
    non-uniform levels; an 8-bit pair's scale and zero from ``pair``'s tables).

    One (scale16, zero16) per (token group, channel).
    """
    if qt.axis != "token":
        raise ValueError(f"dequantize_keys needs axis='token' (keys), got axis={qt.axis!r}")
    *lead, t, d = qt.shape
    codes = unpack_codes(qt.codes, qt.bits)  # (..., T, D)
    codes = codes.reshape(*lead, t // qt.group, qt.group, d)  # (..., T/G, G, D)
    s, z = param_floats(qt, pair)  # (..., T/G, D) each
    x = decode(codes, s.unsqueeze(-2), z.unsqueeze(-2), check_levels(levels, qt.bits))  # (..., T/G, G, D)
    return x.reshape(*lead, t, d)


def dequantize_values(qt: QuantizedTensor, levels: torch.Tensor | None = None, pair: Pair8 | None = None
                      ) -> torch.Tensor:
    """Values back to float32 ``(B, H, T, D)``: ``code * scale16 + zero16`` (``levels[code]``
    with non-uniform levels; an 8-bit pair's scale and zero from ``pair``'s tables).

    One (scale16, zero16) per (token, channel group).
    """
    if qt.axis != "channel":
        raise ValueError(f"dequantize_values needs axis='channel' (values), got axis={qt.axis!r}")
    *lead, t, d = qt.shape
    codes = unpack_codes(qt.codes, qt.bits)  # (..., T, D)
    codes = codes.reshape(*lead, t, d // qt.group, qt.group)  # (..., T, D/G, G)
    s, z = param_floats(qt, pair)  # (..., T, D/G) each
    x = decode(codes, s.unsqueeze(-1), z.unsqueeze(-1), check_levels(levels, qt.bits))  # (..., T, D/G, G)
    return x.reshape(*lead, t, d)


def dequantize(qt: QuantizedTensor, levels: torch.Tensor | None = None, pair: Pair8 | None = None) -> torch.Tensor:
    """Dispatch on ``qt.axis``: float32 ``(B, H, T, D)``."""
    return dequantize_keys(qt, levels, pair) if qt.axis == "token" else dequantize_values(qt, levels, pair)


def requantize(qt: QuantizedTensor, bits: int, valid: torch.Tensor | None = None) -> QuantizedTensor:
    """A packed block at ``qt.bits`` -> the same block at fewer ``bits``, same layout and group.

    Dequantize (``code * scale16 + zero16``), then quantize with :mod:`kvcalib.quant.uniform` at
    ``bits`` over the same groups: keys (``axis="token"``) per channel over the same token groups,
    values (``axis="channel"``) per token over the same channel groups. No clipping (the range is
    the dequantized range, already clipped at the first quantization). Values that are exactly on
    the new grid come back exactly (e.g. 4-bit codes that are multiples of 5 -> 2 bits).

    Args:
        qt: the block, codes ``(B, H, T, D * qt.bits / 8)``.
        bits: 2, 3 or 4, ``bits < qt.bits``.
        valid: optional mask as for ``quantize_keys`` (tokens excluded from the ranges).

    Returns a new :class:`QuantizedTensor` with codes ``(B, H, T, D * bits / 8)`` and scale/zero
    of the same shape as ``qt``'s.
    """
    if not isinstance(qt, QuantizedTensor):
        raise CalibrationError(f"requantize needs a QuantizedTensor, got {type(qt).__name__}")
    if isinstance(bits, bool) or bits not in SUPPORTED_BITS or bits >= qt.bits:
        raise CalibrationError(f"requantize goes to fewer bits: got {bits!r} for a {qt.bits}-bit block")
    if qt.pair8:  # its tables are fitted for its bits (the codec refuses a schedule on such a side)
        raise CalibrationError("a block with 8-bit scale/zero pairs cannot be requantized to fewer bits")
    x = dequantize(qt)  # (B, H, T, D) float32
    fn = quantize_keys if qt.axis == "token" else quantize_values
    return fn(x, bits, qt.group, valid=valid)


def quantize_dequantize_keys(
    k: torch.Tensor,
    bits: int,
    group: int,
    clip: ClipArg = 1.0,
    valid: torch.Tensor | None = None,
    levels: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fake-quantized keys, float32 ``(B, H, T, D)``: ``dequantize_keys(quantize_keys(...))``.

    Skips the pack/unpack round trip (which is lossless), so it is cheaper in simulation and
    does not need ``D`` to be a multiple of ``length_multiple(bits)``.
    """
    lv = check_levels(levels, bits)
    codes, scale16, zero16 = _quantize_keys_unpacked(k, bits, group, clip, valid, lv)
    *lead, t, d = codes.shape
    codes = codes.reshape(*lead, t // group, group, d)  # (..., T/G, G, D)
    return decode(codes, scale16.unsqueeze(-2), zero16.unsqueeze(-2), lv).reshape(*lead, t, d)


def quantize_dequantize_values(
    v: torch.Tensor,
    bits: int,
    group: int,
    clip: ClipArg = 1.0,
    valid: torch.Tensor | None = None,
    levels: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fake-quantized values, float32 ``(B, H, T, D)``: ``dequantize_values(quantize_values(...))``.

    Skips the pack/unpack round trip; unlike :func:`quantize_values` it does not need ``D`` to
    be a multiple of ``length_multiple(bits)``.
    """
    lv = check_levels(levels, bits)
    codes, scale16, zero16 = _quantize_values_unpacked(v, bits, group, clip, valid, lv)
    *lead, t, d = codes.shape
    codes = codes.reshape(*lead, t, d // group, group)  # (..., T, D/G, G)
    return decode(codes, scale16.unsqueeze(-1), zero16.unsqueeze(-1), lv).reshape(*lead, t, d)
