"""8-bit scale and zero per quantization group (issue 53 item 4): the format, in PyTorch.

A min/max group stores its scale and zero as two float16 numbers: at 2 bits and groups of 64 that
is 0.5 of the 2.5 bits an element costs, so below 2.6 bits at 8k nothing fits beside a full-precision
window. This format stores each group's pair in two bytes instead of four, on calibrated tables:

    scale = base * 2 ** (e / 32)                  e  uint8 (0..255), base float32 per column
    zero  = centre + m * step * scale             m  int8 (-128..127), centre float32 per column,
                                                  step = 2**bits / 32 (in units of the scale)

A *column* is what a group's parameters repeat along: a channel for per-channel keys (one pair per
channel per ``group`` tokens), a channel group for per-token layouts. ``base`` and ``centre`` are
float32 ``(H, C)`` per kv head and column, fitted on calibration data (:mod:`kvcalib.methods.scale8`).
The exponent grid spans 2**(255/32), about 250x, in steps of 2**(1/32) (2.2%); the zero moves in
steps of 1/8 of a scale at 2 bits (1/2 at 4 bits) within +-16 scales (+-64 at 4 bits) of the column's
centre, about +-5 group ranges. Why that far: keys are stored after RoPE, and a low-frequency channel
pair drifts with the position, so at 8k-16k tokens a key group's range sits far from its column's
centre, calibrated on short windows. With the reach of ``experiments/scale8.py``'s format (+-4 scales
at 2 bits: steps of 2**bits / 128) 3-8% of SmolLM2's key groups at positions 5k-13k had to take a
coarser scale to reach their minimum, which cost +3% / +15% key MSE at positions 5k / 11k at 2 bits
and +60% / +131% at 3 / 4 bits at 11k; with this reach +0.7% / +1.1%, and +7% / +14% at 3 / 4 bits
(values: +0.15%, from +0.02%; docs/results.md, "8-bit scale pairs stored").

Rounding (the encoder): ``e`` is the grid point nearest ``log2((hi - lo) / qmax / base) * 32`` and
``m`` the step nearest ``lo``, then ``e`` is stepped up wherever the group's extremes would leave the
code range (``round((x - zero) / scale)`` outside 0..qmax) or ``m`` would leave int8; a group still
failing at ``e = 255`` keeps ``e = 255`` and its extremes clamp. Nearest rounding, not covering:
covering (zero floored, scale ceiled) cost +4.7% MSE where nearest cost +0.1%
(``experiments/scale8.py``; docs/results.md, "8-bit scale and zero at 2 bits"). This is the
``log8c`` format measured there (at 8k through the whole model about 1% of the search's KL at the
same code widths, saving 0.242 bits per element), with a four times longer reach for the zero.

Arithmetic (float32, the decoder's): ``scale = base * exp2(e / 32)``, ``zero = centre + m * (scale *
step)``; the encoder computes its codes from exactly these floats, so encode and decode agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["OCTAVE_STEPS", "HEADROOM", "Pair8", "pair_step", "pair_floats", "pair_params", "fit_pair8"]

OCTAVE_STEPS = 32  # exponent grid points per octave (log8c)
HEADROOM = 4.0  # the grid's top: this many times the largest scale the calibration needed


def pair_step(bits: int) -> float:
    """The zero's step in units of the scale: ``2**bits / 32`` (an int8 spans 8 x 2**bits scales)."""
    return (1 << bits) / 32.0


@dataclass(frozen=True)
class Pair8:
    """The calibrated tables of one side of one layer: ``base`` (positive) and ``centre``, float32
    ``(H, C)`` per kv head and parameter column."""

    base: torch.Tensor  # (H, C) float32 > 0
    centre: torch.Tensor  # (H, C) float32

    def __post_init__(self) -> None:
        for name in ("base", "centre"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.is_floating_point():
                raise ValueError(f"pair {name} must be a float tensor (H, C), got "
                                 f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}")
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"pair {name} must be finite")
        if self.base.shape != self.centre.shape:
            raise ValueError(f"pair base {tuple(self.base.shape)} and centre {tuple(self.centre.shape)} differ in shape")
        if not bool((self.base > 0).all()):
            raise ValueError("pair base must be positive")

    def tables(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(base, centre)`` float32 on ``like``'s device, shaped ``(H, 1, C)`` to broadcast against
        parameters ``(..., H, X, C)`` (keys ``X = T / group``, per-token layouts ``X = T``)."""
        h, c = self.base.shape
        if like.dim() < 3 or like.shape[-3] != h or like.shape[-1] != c:
            raise ValueError(f"pair tables (H, C) = {(h, c)} do not fit group parameters of shape "
                             f"{tuple(like.shape)} (..., H, X, C)")
        return (self.base.to(like.device, torch.float32)[:, None, :],
                self.centre.to(like.device, torch.float32)[:, None, :])


def pair_floats(e: torch.Tensor, m: torch.Tensor, bits: int, pair: Pair8) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder's float32 ``(scale, zero)`` of stored ``e`` (uint8) and ``m`` (int8), both
    ``(..., H, X, C)``."""
    base, centre = pair.tables(e)
    scale = base * torch.exp2(e.float() / OCTAVE_STEPS)  # (..., H, X, C)
    zero = centre + m.float() * (scale * pair_step(bits))  # (..., H, X, C)
    return scale, zero


def _in_range(lo: torch.Tensor, hi: torch.Tensor, s: torch.Tensor, z: torch.Tensor, qmax: int) -> torch.Tensor:
    """Whether the encoder's codes of a group's extremes, ``round((x - z) / s)`` in float32, lie in
    0..qmax unclamped (subtraction and division are monotone, so then every element's code does)."""
    q_lo, q_hi = torch.round((lo - z) / s), torch.round((hi - z) / s)
    return (q_lo >= 0) & (q_hi <= qmax)


def pair_params(lo: torch.Tensor, hi: torch.Tensor, bits: int, pair: Pair8) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored ``(e uint8, m int8)`` of groups with (clipped) range ``[lo, hi]``, float32
    ``(..., H, X, C)`` (module docstring: nearest, stepped up where the extremes leave the codes)."""
    qmax = (1 << bits) - 1
    base, centre = pair.tables(lo)
    lo, hi = lo.float(), hi.float()
    need = ((hi - lo) / qmax).clamp_min(torch.finfo(torch.float32).tiny)  # (..., H, X, C)
    e = torch.round(torch.log2(need / base) * OCTAVE_STEPS).clamp(0, 255)

    def grid(e_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        e8 = e_.to(torch.uint8)
        scale = base * torch.exp2(e8.float() / OCTAVE_STEPS)
        m = torch.round((lo - centre) / (scale * pair_step(bits)))
        ok = (m >= -128) & (m <= 127)
        m8 = m.clamp(-128, 127).to(torch.int8)
        s, z = pair_floats(e8, m8, bits, pair)
        return m8, ok & _in_range(lo, hi, s, z, qmax)

    m8, ok = grid(e)
    for _ in range(256):  # a few steps where a group's extremes or its zero fall off the grid
        bad = ~ok & (e < 255)
        if not bool(bad.any()):
            break
        e = torch.where(bad, e + 1, e)
        m8, ok = grid(e)
    return e.to(torch.uint8), m8


def fit_pair8(x: torch.Tensor, bits: int, group: int, per_channel: bool,
              alpha: float | torch.Tensor = 1.0) -> Pair8:
    """The tables of one side from calibration values ``x`` (NB, H, T, D) in the basis the
    quantizer sees (``T`` a multiple of ``group`` for per-channel keys): ``centre`` the column's
    mean; ``base`` such that the grid's top is :data:`HEADROOM` x the largest scale a group of the
    column needed (its range at clip ``alpha``, a float or a tensor broadcastable to the groups'
    parameters ``(NB, H, X, C)``, over ``qmax``, or the scale its zero needs to reach the group's
    minimum from the centre in int8 steps). A held-out group past the top steps up to it and clamps;
    one below the bottom (1/62 of the top) is quantized coarser than it needs."""
    qmax = (1 << bits) - 1
    nb, h, t, d = x.shape
    xf = x.float()
    if per_channel:
        xg = xf[:, :, : t - t % group].reshape(nb, h, t // group, group, d)  # (NB, H, T/G, G, D)
        lo, hi, over = xg.amin(3), xg.amax(3), (0, 2, 3)  # (NB, H, T/G, D)
        centre = xg.mean(over)  # (H, D)
    else:
        xg = xf.reshape(nb, h, t, d // group, group)  # (NB, H, T, D/G, G)
        lo, hi, over = xg.amin(4), xg.amax(4), (0, 2, 4)  # (NB, H, T, D/G)
        centre = xg.mean(over)  # (H, D/G)
    if not (isinstance(alpha, float) and alpha == 1.0):
        a = torch.as_tensor(alpha, dtype=torch.float32)
        mid = (hi + lo) * 0.5
        lo, hi = mid - a * (mid - lo), mid + a * (hi - mid)
    step = pair_step(bits)
    c = centre[None, :, None, :]  # (1, H, 1, C)
    need = torch.maximum((hi - lo) / qmax, (c - lo) / (128 * step))
    need = torch.maximum(need, (lo - c) / (127 * step))  # (NB, H, X, C)
    top = need.amax(dim=(0, 2))  # (H, C)
    base = top.clamp_min(1e-30) * HEADROOM / 2.0 ** (255 / OCTAVE_STEPS)
    return Pair8(base.contiguous(), centre.contiguous())
