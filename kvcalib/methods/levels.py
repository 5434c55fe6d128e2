"""Non-uniform quantization levels per layer and side (Lloyd-Max; KVQuant's sensitivity-weighted
non-uniform datatype).

A min/max group spreads ``2**bits`` evenly spaced levels over its range, but the values of a
group (near-Gaussian after a rotation) crowd its middle: levels placed where the values are cut
the error at the same bits. The group keeps its float16 scale and zero (the same bytes); only
the grid inside ``[zero, zero + qmax * scale]`` moves: ``x_hat = levels[code] * scale + zero``,
``levels`` in code units (:mod:`kvcalib.quant.uniform`: the uniform grid is ``levels[c] = c``).

Fit (per layer and side, at 2 and 4 bits): every reservoir element's position on its group's
grid, ``t = (x - zero) / scale`` (:func:`kvcalib.quant.uniform.code_units`), in the basis the
quantizer sees it (after the rotation / pre-RoPE transform of the earlier methods, centred,
permuted and clipped as fitted before), then Lloyd-Max on ``t`` with the end levels pinned at the
group's minimum and maximum (:func:`lloyd_max` says why): inner levels at the weighted means of
their cells, cells between the midpoints, until the levels settle. Weights:

- ``scale**2`` always (an error of ``dt`` in code units is ``scale * dt`` in the values);
- with ``weighting="attention"`` (default) also the attention's sensitivity from the reservoir's
  queries: keys, each channel's ``E[q_c**2]`` over the query heads of its kv head (a score error is
  ``sum_c q_c dk_c``); values, each token's attention mass within its block's causal attention
  (an output error is ``sum_n p_n dv_n``).

The side keeps its levels (``{side}.levels`` float32 ``(2**bits,)``, a few floats per layer) where
they cut the weighted error by more than ``min_gain`` against the uniform grid
(``{side}.levels_gain``, measured and stored either way).

Kernels: the quantize-and-pack kernels and the decode kernel quantize and read the uniform grid
only, so a side with levels is encoded by the PyTorch reference codec and a layer with levels is
attended by the reference attention (``kernel_encode`` / ``kernel_attend`` return None; the other
layers still use the kernels). A PATS schedule (older blocks at fewer bits) and levels on one
layer are refused (the levels belong to the layer's bits). A side on a fixed grid (errbound,
fitted before) gets no levels: they are fitted to where values fall in min/max groups.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from kvcalib.layout import LayerConfig
from kvcalib.methods.base import (
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
    reservoir_to_bhtd,
    switch_lines,
    switch_section,
)
from kvcalib.quant.transforms import apply_perm
from kvcalib.quant.uniform import check_levels, code_units
from kvcalib.reservoir import causal_probs, quantizer_input
from kvcalib.stats import LayerStats

__all__ = ["LEVEL_BITS", "WEIGHTINGS", "lloyd_max", "grid_error", "quantizer_input", "side_units", "LevelsState", "LevelsMethod"]

LEVEL_BITS = (2, 4)
WEIGHTINGS = ("attention", "none")


def lloyd_max(t: torch.Tensor, w: torch.Tensor, bits: int, iters: int = 60) -> torch.Tensor:
    """Weighted Lloyd-Max levels of samples ``t`` (N,) with weights ``w`` (N,), the end levels
    pinned to the grid's ends: float32 ``(2**bits,)`` strictly increasing, ``levels[0] = 0`` and
    ``levels[-1] = 2**bits - 1``, the inner ones started from the uniform grid and moved to the
    weighted means of their cells. A cell that empties keeps its level.

    Why pinned: a min/max group's minimum and maximum sit exactly on its first and last level, and
    attention's largest scores come from them. Free end levels move inward to the bulk of the values
    (0.38 and 2.63 at 2 bits on SmolLM2's keys) and cost those extremes; measured on SmolLM2 at
    2,048 tokens (docs/results.md), free levels made K2V2 +13.5% -> +28.0% perplexity and pinned
    ones +12.8%. On a uniform density the pinned fit is the uniform grid itself."""
    n = 1 << bits
    t, w = t.double().reshape(-1), w.double().reshape(-1)
    levels = torch.arange(n, dtype=torch.float64)
    inner_min = torch.arange(1, n - 1, dtype=torch.float64) * 1e-6  # (n-2,) keeps ties apart
    for _ in range(iters):
        cell = torch.bucketize(t, (levels[1:] + levels[:-1]) * 0.5)  # (N,) nearest level, ties low
        mass = torch.zeros(n, dtype=torch.float64).index_add_(0, cell, w)
        moment = torch.zeros(n, dtype=torch.float64).index_add_(0, cell, w * t)
        new = torch.where(mass > 0, moment / mass.clamp_min(1e-300), levels)
        new[0], new[-1] = 0.0, float(n - 1)
        # cells are ordered, so are their means (cummax guards ties); inner levels stay inside the ends
        new[1:-1] = torch.cummax(new[1:-1].clamp(1e-3, n - 1 - 1e-3), 0).values + inner_min
        if float((new - levels).abs().max()) < 1e-7:
            levels = new
            break
        levels = new
    return levels.float()


def grid_error(t: torch.Tensor, w: torch.Tensor, levels: torch.Tensor) -> float:
    """``sum w (t - levels[nearest])**2`` (float64)."""
    lv = levels.double()
    cell = torch.bucketize(t.double(), (lv[1:] + lv[:-1]) * 0.5)
    return float((w.double() * (t.double() - lv[cell]) ** 2).sum())


def side_units(layer_stats: LayerStats, cfg: LayerConfig, side: str, fitted: dict[str, torch.Tensor],
               weighting: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The reservoir's elements of ``side`` on their groups' grids and their weights (module
    docstring): ``(t, w)`` float32, both ``(NB, H, T, D)``. Centering, permutation and clip fitted
    before (``fitted``) are applied as the runtime applies them (:func:`quantizer_input`)."""
    bits, group = cfg.bits(side), cfg.group(side)
    x, alpha = quantizer_input(layer_stats, cfg, side, fitted)  # (NB, H, T, D)
    t_len, h = x.shape[2], x.shape[1]
    perm = fitted.get(f"{side}.perm")
    units, scale = code_units(x, bits, group, cfg.per_channel(side), alpha)  # (NB, H, T, D) x 2
    weight = scale ** 2
    q = layer_stats.reservoir_q
    if weighting == "attention" and q.shape[2]:
        qb = reservoir_to_bhtd(q)[:, :, :t_len]  # (NB, Hq, T, D)
        rep = qb.shape[1] // h
        if side == "k":
            sens = (qb ** 2).mean(dim=(0, 2)).reshape(h, rep, -1).mean(1)  # (H, D): E[q_c^2] per kv head
            if perm is not None:
                sens = apply_perm(sens[None, :, None, :], perm)[0, :, 0]  # stored channel order
            weight = weight * (sens / sens.mean().clamp_min(1e-30))[None, :, None, :]
        else:
            k = reservoir_to_bhtd(layer_stats.reservoir_k)[:, :, :t_len]  # (NB, H, T, D)
            probs = causal_probs(qb, k.repeat_interleave(rep, dim=1), layer_stats.scaling)  # (NB, Hq, T, T)
            mass = probs.sum(2).reshape(probs.shape[0], h, rep, -1).mean(2)  # (NB, H, T): attention received
            weight = weight * (mass / mass.mean().clamp_min(1e-30))[..., None]
    return units, weight


class LevelsState(MethodState):
    """Levels per side with levels: ``side -> (2**bits,)`` float32."""

    def __init__(self, levels: dict[str, torch.Tensor]) -> None:
        self.lv = {side: lv.float() for side, lv in levels.items()}

    def levels(self, side: str) -> torch.Tensor | None:
        return self.lv.get(side)

    def kernel_encode(self, side: str, x: torch.Tensor, stored: dict[str, Any]) -> KernelEncode | None:
        return None if side in self.lv else NO_KERNEL_ENCODE  # the kernels quantize on the uniform grid only

    def kernel_attend(self, side: str, device: torch.device) -> KernelAttend | None:
        return None if side in self.lv else NO_KERNEL_ATTEND  # no lookup table in the decode kernel: reference path


class LevelsMethod(Method):
    """Lloyd-Max levels per layer and side where they lower the (sensitivity-weighted) error."""

    name: ClassVar[str] = "levels"
    summary: ClassVar[str] = "non-uniform (Lloyd-Max) quantization levels per layer and side"
    order: ClassVar[int] = 35
    tensors: ClassVar[tuple[TensorSpec, ...]] = (
        TensorSpec("levels", ("k", "v"), "float32", "(2**bits,)",
                   "non-uniform quantization levels in code units (x = levels[code] * scale + zero)"),
        TensorSpec("levels_gain", ("k", "v"), "float32", "()",
                   "relative weighted error reduction of the levels against the uniform grid", applied=False),
    )
    search: ClassVar[str | None] = "layer"
    letter: ClassVar[str] = "L"
    flags: ClassVar[tuple[Flag, ...]] = (
        Flag("levels", bool, "Non-uniform (Lloyd-Max, attention-weighted) levels per layer and side at 2 and 4 "
             "bits where they lower the error (reference path: the kernels refuse such layers)."),)

    def __init__(self, weighting: str = "attention", iters: int = 60, min_gain: float = 0.0) -> None:
        if weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
        if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
            raise ValueError(f"iters must be a positive int, got {iters!r}")
        if not -1.0 < float(min_gain) < 1.0:
            raise ValueError(f"min_gain must lie in (-1, 1), got {min_gain!r}")
        self.weighting, self.iters, self.min_gain = weighting, iters, float(min_gain)

    def _fit(self, layer_stats: LayerStats, layer_cfg: LayerConfig, seed: int,
             context: FitContext, geom: LayerGeometry) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for side in ("k", "v"):
            bits = layer_cfg.bits(side)
            if bits not in LEVEL_BITS or f"{side}.step" in context.fitted:
                continue  # levels are fitted to min/max groups, not to a fixed grid (errbound)
            t, w = side_units(layer_stats, layer_cfg, side, context.fitted, self.weighting)
            levels = lloyd_max(t, w, bits, self.iters)
            uniform = grid_error(t, w, torch.arange(1 << bits, dtype=torch.float32))
            gain = 0.0 if uniform <= 0 else 1.0 - grid_error(t, w, levels) / uniform
            out[f"{side}.levels_gain"] = torch.tensor(gain, dtype=torch.float32)
            if gain > self.min_gain:
                out[f"{side}.levels"] = levels
        return out

    @classmethod
    def load(cls, tensors: dict[str, torch.Tensor], cfg: LayerConfig, heads: int | None,
             head_dim: int | None) -> LevelsState | None:
        levels = {}
        for side in ("k", "v"):
            t = tensors.get(f"{side}.levels")
            if t is None:
                continue
            bits = cfg.bits(side)
            if bits >= 16:
                raise ValueError(f"{side}.levels: the layer keeps {side.upper()} at 16 bits; remove the tensor")
            try:
                levels[side] = check_levels(t, bits)
            except ValueError as err:
                raise ValueError(f"{side}.levels: {err}") from None
        return LevelsState(levels) if levels else None

    @classmethod
    def from_arguments(cls, cfg: LayerConfig, arguments: dict[str, Any]) -> LevelsState | None:
        """``k_levels=`` / ``v_levels=`` tensors ``(2**bits,)``."""
        levels = {}
        for side in ("k", "v"):
            given = arguments.pop(f"{side}_levels", None)
            if given is not None:
                levels[side] = check_levels(given, cfg.bits(side))
        return LevelsState(levels) if levels else None

    @classmethod
    def inspect(cls, recipe: Any, info: Any, context: int, layers: list[dict[str, Any]],
                elements_per_layer: list[int]) -> dict[str, Any] | None:
        """Which sides carry levels, and the weighted error reduction the fit measured."""
        return switch_section(recipe, info, layers, cls.name, ("k", "v"), {"levels": "lloyd-max"}, "levels_gain")

    @classmethod
    def inspect_lines(cls, report: dict[str, Any]) -> list[str]:
        return switch_lines(report, cls.name, "non-uniform levels", {"lloyd-max": "L"})
