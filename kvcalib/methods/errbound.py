"""An error-bounded uniform quantizer: a fixed step per column from calibration, codes centred at
zero (KVComp's design), instead of each group's min/max.

A min/max group stretches its grid from its smallest to its largest value, so its codes are
spread evenly and every group stores a float16 scale and zero. With a step fixed per kv head and
parameter column (a channel of per-channel keys, a channel group of values and per-token keys),
``code = clamp(round(x / step) + 2**(bits-1), 0, 2**bits - 1)`` and ``x_hat = (code - 2**(bits-1))
* step``: the error is at most ``step / 2`` wherever the value lies inside the grid, and for
near-Gaussian data (after a rotation) most codes sit near the middle. A peaked code histogram is
what entropy coding needs: ``benchmarks/quantizers.py`` measures what the Huffman tier
(:mod:`kvcalib.methods.huffman`) saves on these codes against the min/max quantizer's.

The step: ``alpha * rms`` of the column over the reservoir (in the basis and after the centering /
permutation the quantizer sees), ``alpha`` chosen per layer and side from a grid to minimise the
reservoir's squared error. Recipe tensor ``{side}.step`` float32 ``(H, C)``.

Storage: this runtime keeps its packed layout (codes, and a float16 scale and zero per group, here
the column's fixed step and ``-2**(bits-1) * step``), so the decode kernel reads these layers as it
reads any other and the memory accounting counts those parameters as stored. A store without
per-group parameters (KVComp's) would save them; that layout is not built here. The
quantize-and-pack kernels fit min/max grids only: such sides encode through the PyTorch
reference codec. With a PATS schedule (older blocks requantized to fewer bits) it is refused.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from kvcalib.layout import LayerConfig
from kvcalib.methods.base import (FitContext, Flag, KernelAttend, KernelEncode, LayerGeometry, Method, MethodState,
                                  NO_KERNEL_ATTEND, NO_KERNEL_ENCODE, TensorSpec)
from kvcalib.quant.uniform import dequantize, quantize_fixed
from kvcalib.reservoir import quantizer_input
from kvcalib.stats import LayerStats

__all__ = ["DEFAULT_ALPHAS", "fixed_params", "step_errors", "ErrBoundState", "ErrBoundMethod"]

DEFAULT_ALPHAS = tuple(round(0.1 * i, 2) for i in range(2, 31))  # 0.2 .. 3.0 column RMS per step


def fixed_params(step: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale16, zero16)`` float16 of a step ``(H, C)``: codes centred at zero, ``zero =
    -2**(bits-1) * step`` (exact in float16: a power-of-two multiple of the rounded step)."""
    scale16 = step.to(torch.float16)
    return scale16, (-(1 << (bits - 1)) * scale16.float()).to(torch.float16)


def _columns(x: torch.Tensor, group: int, per_channel: bool) -> torch.Tensor:
    """``x`` (NB, H, T, D) as (H, C, elements of the column)."""
    nb, h, t, d = x.shape
    if per_channel:
        return x.permute(1, 3, 0, 2).reshape(h, d, nb * t)  # (H, D, NB * T)
    return x.reshape(nb, h, t, d // group, group).permute(1, 3, 0, 2, 4).reshape(h, d // group, -1)  # (H, D/G, .)


def step_errors(x: torch.Tensor, bits: int, group: int, per_channel: bool,
                alphas: tuple[float, ...] = DEFAULT_ALPHAS) -> tuple[torch.Tensor, list[float]]:
    """The column RMS ``(H, C)`` of ``x`` (NB, H, T, D) and the squared error of the fixed grid at
    ``step = alpha * rms`` for every alpha (float64, summed over the reservoir)."""
    rms = _columns(x.double(), group, per_channel).pow(2).mean(-1).sqrt().float().clamp_min(1e-6)  # (H, C)
    errs = []
    for alpha in alphas:
        scale16, zero16 = fixed_params(alpha * rms, bits)
        q = quantize_fixed(x, bits, group, per_channel, scale16, zero16)
        errs.append(float(((dequantize(q) - x) ** 2).sum(dtype=torch.float64)))
    return rms, errs


class ErrBoundState(MethodState):
    """Fixed grids per side: ``side -> (scale16, zero16)`` float16 ``(H, C)``."""

    def __init__(self, grids: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.grids = grids
        self._device: dict[tuple[str, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def fixed_grid(self, side: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.grids.get(side)

    def kernel_encode(self, side: str, x: torch.Tensor, stored: dict[str, Any]) -> KernelEncode | None:
        return None if side in self.grids else NO_KERNEL_ENCODE  # the quantize-and-pack kernels fit min/max grids only

    def kernel_attend(self, side: str, device: torch.device) -> KernelAttend | None:
        return NO_KERNEL_ATTEND  # stored as any packed side: the decode kernel reads the per-group parameters


class ErrBoundMethod(Method):
    """A fixed step per kv head and parameter column, chosen on the reservoir (module docstring)."""

    name: ClassVar[str] = "errbound"
    summary: ClassVar[str] = "error-bounded uniform quantizer: fixed step per column, codes centred at zero (KVComp)"
    order: ClassVar[int] = 34
    tensors: ClassVar[tuple[TensorSpec, ...]] = (
        TensorSpec("step", ("k", "v"), "float32", "(H, C)",
                   "fixed quantization step per kv head and parameter column (C = D for per-channel keys, "
                   "D / group otherwise); codes centred at zero"),
    )
    search: ClassVar[str | None] = "layer"
    letter: ClassVar[str] = "E"
    flags: ClassVar[tuple[Flag, ...]] = (
        Flag("errbound", bool, "Error-bounded uniform quantizer (KVComp): a fixed step per column from "
             "calibration, codes centred at zero, instead of min/max groups."),)

    def __init__(self, alphas: tuple[float, ...] = DEFAULT_ALPHAS) -> None:
        alphas = tuple(float(a) for a in alphas)
        if not alphas or not all(a > 0 for a in alphas):
            raise ValueError(f"alphas must be positive, got {alphas!r}")
        self.alphas = alphas

    def _fit(self, layer_stats: LayerStats, layer_cfg: LayerConfig, seed: int,
             context: FitContext, geom: LayerGeometry) -> dict[str, torch.Tensor]:
        out = {}
        for side in ("k", "v"):
            bits = layer_cfg.bits(side)
            if bits >= 16:
                continue
            x, _ = quantizer_input(layer_stats, layer_cfg, side, context.fitted)  # (NB, H, T, D)
            rms, errs = step_errors(x, bits, layer_cfg.group(side), layer_cfg.per_channel(side), self.alphas)
            best = min(range(len(errs)), key=errs.__getitem__)
            out[f"{side}.step"] = (self.alphas[best] * rms).contiguous()  # (H, C)
        return out

    @classmethod
    def load(cls, tensors: dict[str, torch.Tensor], cfg: LayerConfig, heads: int | None,
             head_dim: int | None) -> ErrBoundState | None:
        grids = {}
        for side in ("k", "v"):
            t = tensors.get(f"{side}.step")
            if t is None:
                continue
            bits = cfg.bits(side)
            if bits >= 16:
                raise ValueError(f"{side}.step: the layer keeps {side.upper()} at 16 bits; remove the tensor")
            cols = None if head_dim is None else (head_dim if cfg.per_channel(side) else head_dim // cfg.group(side))
            if (t.dim() != 2 or not t.is_floating_point() or (heads is not None and t.shape[0] != heads)
                    or (cols is not None and t.shape[1] != cols)):
                raise ValueError(f"{side}.step must be float32 (H, C) = ({heads}, {cols}), got {t.dtype} "
                                 f"{tuple(t.shape)}")
            if not bool((t > 0).all()) or not bool(torch.isfinite(t).all()):
                raise ValueError(f"{side}.step must hold positive finite steps")
            grids[side] = fixed_params(t.float(), bits)
        return ErrBoundState(grids) if grids else None

    @classmethod
    def from_arguments(cls, cfg: LayerConfig, arguments: dict[str, Any]) -> ErrBoundState | None:
        """``k_step=`` / ``v_step=`` float ``(H, C)``."""
        grids = {}
        for side in ("k", "v"):
            step = arguments.pop(f"{side}_step", None)
            if step is not None:
                grids[side] = fixed_params(step.float(), cfg.bits(side))
        return ErrBoundState(grids) if grids else None
