"""TaDA mean-centering across kv heads: store one shared mean per token, quantize deviations.

For one layer and side, token ``t`` of batch row ``b`` has one vector per kv head
``x[b, h, t, :]``. TaDA stores the mean over heads ``m[b, t] = mean_h x[b, h, t]`` once per token
and quantizes the per-head deviations ``dev[b, h, t] = x[b, h, t] - m[b, t]`` (TaDA writes
``K_m - K_i``; the sign is immaterial). Outlier structure shared by the heads moves into the
mean, so the deviations have a smaller range.

The mean's precision (``mean_bits``), stated and counted:

- ``16``: the mean is stored as float16 (or the model's bf16; same bytes): ``2 * D`` bytes per
  token per side, i.e. ``16 / H`` bits per cache element (e.g. 8 kv heads: +2.0 bits per
  element; 2 kv heads: +8.0). With few kv heads this is not free.
- ``8``: the mean is quantized per token to 8 bits over one group of all ``D`` channels with a
  float16 scale and zero (:func:`kvcalib.quant.uniform.quantize_values` with ``group = D``):
  ``D + 4`` bytes per token per side, ``(8 * D + 32) / (H * D)`` bits per element.

Deviations are taken from the *stored* (dequantized) mean, ``dev = x - mean_hat``, so the
mean's own quantization error is absorbed into the deviations instead of being added on top.

Runtime contract for ``{k|v}.center`` (float32 scalar: ``mean_bits`` in {8, 16}, or 0 = off):

- at flush (and for full-precision segments, optionally): ``mean_hat, dev = center(x, mean_bits)``;
  store ``mean_hat`` once per token at ``mean_bits`` (``quantize_mean``), quantize ``dev`` with the
  layer's K/V layout (perm/clip, if fitted, apply to ``dev``);
- keys: ``q_i . k_{h,t} = q_i . mean_hat_t + q_i . dev_{h,t}`` (query head ``i`` reads its kv
  head ``h = i // rep`` for the deviation and the shared mean for every head);
- values: ``o_i = sum_t p_{i,t} (mean_hat_t + dev_{h,t})`` = ``P_i @ mean_hat + P_i @ dev_h``;
- count ``mean_bytes_per_token(D, mean_bits)`` per token per centred side in the memory budget.

H = 1 (MQA): the mean is the token itself and ``dev = 0``; centering would just move all the
information into the mean stream at ``mean_bits``. :func:`center` returns that exact
decomposition (a no-op), :func:`fit_centering_gain` reports 0.0 and :class:`CenterMethod`
leaves centering off.

The split itself (:func:`center`, :func:`quantize_mean`) lives in :mod:`kvcalib.quant.transforms`,
one layer down, because the methods fitted after centering (reorder, clip, levels) fit on the
deviations the runtime quantizes; this file decides where centering pays and carries its state.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from kvcalib.layout import LayerConfig
from kvcalib.methods.base import (
    CalibrationError,
    FitContext,
    Flag,
    KernelAttend,
    KernelEncode,
    LayerGeometry,
    Method,
    MethodState,
    NO_KERNEL_ATTEND,
    NO_KERNEL_ENCODE,
    TensorSpec,
    check_quantized_side,
    check_side,
    fake_quantize,
    reservoir_to_bhtd,
    scalar_value,
    usable_tokens,
    validate_reservoir,
)
from kvcalib.quant.transforms import MEAN_BITS, center, check_mean_bits, quantize_mean, uncenter
from kvcalib.quant.uniform import QuantizedTensor, dequantize_values, quantize_values
from kvcalib.stats import LayerStats

__all__ = [
    "MEAN_BITS",
    "center",
    "uncenter",
    "quantize_mean",
    "mean_bytes_per_token",
    "mean_bits_per_element",
    "centering_errors",
    "fit_centering_gain",
    "independent_heads_gain",
    "center_reference",
    "CenterState",
    "CenterMethod",
]

def mean_bytes_per_token(head_dim: int, mean_bits: int) -> float:
    """Bytes of the stored mean per token, per layer and side (module docstring)."""
    check_mean_bits(mean_bits)
    if mean_bits == 16:
        return 2.0 * head_dim
    return float(head_dim + 4)  # D codes of 1 byte + float16 scale + float16 zero


def mean_bits_per_element(heads: int, head_dim: int, mean_bits: int) -> float:
    """The mean's cost spread over the side's ``H * D`` elements per token, in bits per element."""
    return 8.0 * mean_bytes_per_token(head_dim, mean_bits) / (heads * head_dim)


def centering_errors(
    reservoir: torch.Tensor,
    bits: int,
    group: int,
    side: str,
    k_axis: str = "channel",
    mean_bits: int = 8,
    clip: float = 1.0,
) -> tuple[float, float]:
    """Squared quantization error on the reservoir without and with centering.

    Args:
        reservoir: ``(NB, BL, H, D)`` token blocks (float16 from the statistics, any float).
        bits, group, side, k_axis: the layer's layout for this side (see ``fake_quantize``).
        mean_bits: precision of the stored mean.
        clip: clip alpha used for both (1.0 = none).

    Returns:
        ``(plain, centred)``: ``sum |fq(x) - x|^2`` and ``sum |mean_hat + fq(dev) - x|^2`` over
        the usable tokens (whole key groups), as Python floats.
    """
    check_side(side)
    check_mean_bits(mean_bits)
    validate_reservoir(reservoir, "reservoir")
    x = reservoir_to_bhtd(reservoir)  # (NB, H, BL, D)
    x = x[:, :, : usable_tokens(x.shape[2], side, group, k_axis)]  # (NB, H, T, D)
    plain = float(((fake_quantize(x, side, bits, group, k_axis, clip) - x) ** 2).sum(dtype=torch.float64))
    mean, dev = center(x, mean_bits)  # (NB, 1, T, D), (NB, H, T, D)
    # mean_hat + fq(dev) - x == fq(dev) - dev exactly in exact arithmetic; computing it as the
    # runtime reconstructs it keeps the float32 rounding of the reconstruction in the score
    recon = uncenter(mean, fake_quantize(dev, side, bits, group, k_axis, clip))
    centred = float(((recon - x) ** 2).sum(dtype=torch.float64))
    return plain, centred


def fit_centering_gain(
    reservoir: torch.Tensor,
    bits: int,
    group: int,
    side: str,
    k_axis: str = "channel",
    mean_bits: int = 8,
) -> float:
    """Relative reduction of the quantization error from centering: ``1 - centred / plain``.

    1.0 = centering removes all error, 0 = no change, negative = centering hurts. Returns 0.0
    for a single kv head (centering is a no-op there, see the module docstring) and when the
    plain error is already 0 (e.g. constant data). Never NaN.

    Independent heads already give about ``1/H`` (:func:`independent_heads_gain`): that part
    is bought with the mean's bytes, not with shared structure; judge the gain against it and
    against :func:`mean_bits_per_element`.
    """
    validate_reservoir(reservoir, "reservoir")
    if reservoir.shape[2] < 2:
        return 0.0
    plain, centred = centering_errors(reservoir, bits, group, side, k_axis, mean_bits)
    if plain <= 0.0:
        return 0.0
    return 1.0 - centred / plain


def independent_heads_gain(heads: int) -> float:
    """Gain centering gives even without shared structure: ``1 / H``.

    For H independent heads of equal variance, the deviations keep ``1 - 1/H`` of the variance
    (the rest moves into the mean stream, paid for by its bytes), so quantization error falls
    by ``1/H`` at the same bits. Only the gain beyond this comes from structure shared across
    heads (what TaDA exploits).
    """
    return 1.0 / heads if heads >= 2 else 0.0


def center_reference(x: torch.Tensor, mean_bits: int
                     ) -> tuple[torch.Tensor, torch.Tensor | None, QuantizedTensor | None]:
    """TaDA's stored mean of ``x`` (B, H, N, D): ``(mean_hat, mean16, mean_q)``.

    ``mean_hat`` float32 (B, 1, N, D) is the stored mean dequantized (the deviations are taken
    from it); ``mean_bits == 16``: ``mean16`` float16 (B, 1, N, D) is what is stored; ``8``:
    ``mean_q`` holds 8-bit per-token codes of ``mean_hat`` over one group of D channels. The
    specification of :func:`kvcalib_kernels.quant_pack.center_pack`.
    """
    mean_hat, _ = center(x, mean_bits)  # (B, 1, N, D) as stored
    if mean_bits == 16:
        return mean_hat, mean_hat.to(torch.float16), None
    return mean_hat, None, quantize_values(mean_hat, 8, mean_hat.shape[-1])


class CenterState(MethodState):
    """Mean bits per centred side of one layer (``{"k": 16}``...): the runtime contract above."""

    def __init__(self, bits: dict[str, int]) -> None:
        self.bits = {side: b for side, b in bits.items() if b}  # side -> 8 | 16

    def encode(self, side: str, x: torch.Tensor, stored: dict[str, Any]) -> torch.Tensor:
        if side not in self.bits:
            return x
        mean, stored["mean"], stored["mean_q"] = center_reference(x, self.bits[side])  # (B, 1, N, D)
        return x.float() - mean  # (B, H, N, D) deviations from the stored mean

    def decode(self, side: str, y: torch.Tensor, stored: dict[str, Any]) -> torch.Tensor:
        if stored.get("mean") is not None:
            return y + stored["mean"].float()
        if stored.get("mean_q") is not None:
            return y + dequantize_values(stored["mean_q"])
        return y

    def kernel_encode(self, side: str, x: torch.Tensor, stored: dict[str, Any]) -> KernelEncode | None:
        if side not in self.bits:
            return NO_KERNEL_ENCODE
        from kvcalib_kernels import quant_pack

        if x.shape[1] > quant_pack.MAX_CENTER_HEADS:
            return None
        mean, stored["mean"], stored["mean_q"] = quant_pack.center_pack(x, self.bits[side], validate=False)
        return KernelEncode(mean=mean, center=self.bits[side])  # (B, 1, N, D) float32: the kernel subtracts it

    def kernel_attend(self, side: str, device: torch.device) -> KernelAttend | None:
        return NO_KERNEL_ATTEND  # the kernel reads the stored means from the packed store's view

    def bytes(self, cfg: LayerConfig, heads: int, head_dim: int, kept: int, packed: int) -> dict[str, float]:
        # one stored mean per packed token (TaDA): 16-bit = 2D bytes, 8-bit = D codes + fp16 scale/zero
        return {f"{side}_mean": packed * mean_bytes_per_token(head_dim, bits)
                for side, bits in self.bits.items() if packed and cfg.bits(side) < 16}


class CenterMethod(Method):
    """Decide TaDA centering per layer and side from its measured error reduction.

    Produces, for each quantized side: ``{side}.center`` = ``mean_bits`` when the relative error
    reduction on the reservoir exceeds the independent-heads baseline ``1/H``
    (:func:`independent_heads_gain`) by at least ``min_gain`` (and H >= 2), else 0.0; and
    ``{side}.center_gain`` = the measured reduction (a search may overrule the decision, e.g.
    weigh it against ``mean_bits_per_element``).
    """

    name: ClassVar[str] = "center"
    summary: ClassVar[str] = "TaDA mean-centering across kv heads where it pays"
    order: ClassVar[int] = 10
    tensors: ClassVar[tuple[TensorSpec, ...]] = (
        TensorSpec("center", ("k", "v"), "float32", "()", "mean bits (8 or 16) when the side is centred, 0 = off"),
        TensorSpec("center_gain", ("k", "v"), "float32", "()",
                   "relative quantization error reduction from centering", applied=False),
    )
    search: ClassVar[str | None] = "layer"
    letter: ClassVar[str] = "C"
    flags: ClassVar[tuple[Flag, ...]] = (Flag("center", bool, "TaDA mean-centering across kv heads where it pays."),)

    def __init__(self, mean_bits: int = 8, min_gain: float = 0.1) -> None:
        if mean_bits not in MEAN_BITS:
            raise ValueError(f"mean_bits must be one of {MEAN_BITS}, got {mean_bits!r}")
        if not 0.0 <= float(min_gain) < 1.0:
            raise ValueError(f"min_gain must lie in [0, 1), got {min_gain!r}")
        self.mean_bits = mean_bits
        self.min_gain = float(min_gain)

    def _fit(self, layer_stats: LayerStats, layer_cfg: LayerConfig, seed: int,
             context: FitContext, geom: LayerGeometry) -> dict[str, torch.Tensor]:
        out = {}
        for side, bits, group in (("k", layer_cfg.k_bits, layer_cfg.k_group),
                                  ("v", layer_cfg.v_bits, layer_cfg.v_group)):
            if bits >= 16:
                continue
            gain = fit_centering_gain(getattr(layer_stats, f"reservoir_{side}"), bits, group, side,
                                      layer_cfg.k_axis, self.mean_bits)
            on = geom.heads >= 2 and gain - independent_heads_gain(geom.heads) >= self.min_gain
            out[f"{side}.center"] = torch.tensor(float(self.mean_bits if on else 0))
            out[f"{side}.center_gain"] = torch.tensor(gain, dtype=torch.float32)
        return out

    @classmethod
    def load(cls, tensors: dict[str, torch.Tensor], cfg: LayerConfig, heads: int | None,
             head_dim: int | None) -> CenterState | None:
        bits = {}
        for side in ("k", "v"):
            gain = tensors.get(f"{side}.center_gain")
            if gain is not None:  # informs the search and inspect only, but must say something
                check_quantized_side(cfg, f"{side}.center_gain")
                scalar_value(gain, f"{side}.center_gain", "the relative error reduction")
            t = tensors.get(f"{side}.center")
            if t is None:
                continue
            value = scalar_value(t, f"{side}.center", "the mean bits")
            if value not in (0, *MEAN_BITS):  # 8.4 is no precision: refused, not rounded
                raise ValueError(f"{side}.center must be 0, 8 or 16 (mean bits), got {value:g}")
            if value:
                check_quantized_side(cfg, f"{side}.center")
            bits[side] = int(value)
        return CenterState(bits) if any(bits.values()) else None

    @classmethod
    def from_arguments(cls, cfg: LayerConfig, arguments: dict[str, Any]) -> CenterState | None:
        bits = {side: int(arguments.pop(f"{side}_center", 0) or 0) for side in ("k", "v")}
        for side, b in bits.items():
            if b not in (0, *MEAN_BITS):
                raise CalibrationError(f"{side}_center must be 0, 8 or 16 (mean bits), got {b}")
        return CenterState(bits) if any(bits.values()) else None
