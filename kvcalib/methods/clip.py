"""SKVQ clipped quantization: fit the clip alpha per kv head on the attention output error.

Clipping shrinks each quantization group's range toward its centre before the scale is set
(``kvcalib.quant.uniform``: ``lo' = c - alpha (c - lo)``, ``hi' = c + alpha (hi - c)``,
elements outside are clamped). A few outliers then cost a clamping error while every other
element gets a finer grid.

Objective. The alpha is chosen from a grid (default ``1.0, 0.95, ..., 0.5``) to minimise the
error of the **attention output**, not of the raw K or V: over each reservoir block of BL
consecutive tokens, causal attention of the block's own queries (``softmax(scaling * q k^T)``
with the causal mask; GQA: query head ``i`` reads kv head ``i // rep``) is computed once in
float32 with full-precision K and V, and again with the fitted side fake-quantized in the
runtime layout at that alpha (the other side full precision). The error of a kv head is the
sum of squared output differences of its ``rep`` query heads over all blocks, tokens and
channels. (``objective="mse"`` scores the raw ``|x_hat - x|^2`` instead, for comparison.)

Granularity: one alpha **per kv head**, ``(H,)``. The output error separates over kv heads
(a kv head's K/V only reach its own query heads), so each head's alpha is its own exact
argmin over the grid at no extra cost; a per-layer scalar would be the special case of one
value. Ties (errors within a relative ``1e-3`` of the best) go to the **largest** alpha (least
clipping): a constant or already well-quantized head keeps alpha = 1.

Within-block causal attention is a proxy for decoding: in the runtime the most recent tokens
are in the full-precision window and never quantized; the proxy quantizes all of them, so it
weights the near-diagonal slightly more than decoding does.

Note on "uniform data": asymmetric min-max quantization puts grid points *on* the group's
extremes, wasting half a step at each end. For data uniform over its range the MSE-optimal
alpha is therefore ``(2**b - 1) / 2**b`` (0.75 at 2 bits, 0.94 at 4 bits, 0.996 at 8 bits),
not 1: the fit finds that, and picks 1.0 at 8 bits (the grid's nearest point).

Runtime contract for ``{k|v}.clip`` (stored float32 ``(H, 1)``, values in (0, 1]): pass it as
``clip=`` to ``quantize_keys`` / ``quantize_values`` of the matching side at every flush; it
broadcasts as ``(1, H, 1, 1)`` over the parameter shape ``(B, H, groups, D|D/G)``
(:class:`ClipState` does this). Fitted after the permutation (and on centred deviations
when centering is on), it must be applied to the permuted (centred) data, as it was fitted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from kvcalib.layout import LayerConfig
from kvcalib.methods.base import (
    CalibrationError,
    FitContext,
    Flag,
    KernelEncode,
    LayerGeometry,
    Method,
    MethodState,
    NO_KERNEL_ENCODE,
    TensorSpec,
    check_quantized_side,
)
# causal_probs: the attention-output objective's softmax, shared with levels; named here as before
from kvcalib.reservoir import MIN_CLIP, OBJECTIVES, causal_probs, check_grid, quantization_errors  # noqa: F401
from kvcalib.stats import LayerStats

__all__ = ["DEFAULT_GRID", "OBJECTIVES", "clip_errors", "choose_alpha", "fit_clip_alpha", "ClipState", "ClipMethod"]

DEFAULT_GRID = tuple(round(1.0 - 0.05 * i, 2) for i in range(11))  # 1.0, 0.95, ..., 0.5
TIE_RTOL = 1e-3  # errors within this relative margin of the best count as ties -> largest alpha


def clip_errors(reservoir_k: torch.Tensor, reservoir_v: torch.Tensor, reservoir_q: torch.Tensor, scaling: float,
                bits: int, group: int, side: str, grid: Sequence[float] = DEFAULT_GRID, *layout: Any,
                **options: Any) -> torch.Tensor:
    """The error of every alpha of the clip grid for every kv head, float64 ``(len(grid), H)``:
    :func:`kvcalib.reservoir.quantization_errors` (the measure rotation shares) over ``grid``."""
    return quantization_errors(reservoir_k, reservoir_v, reservoir_q, scaling, bits, group, side, grid,
                               *layout, **options)


def choose_alpha(errs: torch.Tensor, grid: Sequence[float], rtol: float = TIE_RTOL) -> torch.Tensor:
    """Per head, the largest alpha whose error is within ``rtol`` of the best; float32 ``(H,)``.

    ``errs`` float ``(len(grid), H)`` (from :func:`clip_errors`).
    """
    grid = check_grid(grid)
    if errs.dim() != 2 or errs.shape[0] != len(grid):
        raise CalibrationError(f"errs must be (len(grid)={len(grid)}, H), got {tuple(errs.shape)}")
    if not bool(torch.isfinite(errs).all()):
        raise CalibrationError("clip errors are not finite: the reservoir's values overflow float32")
    g = torch.tensor(grid, dtype=torch.float64)  # (A,)
    best = errs.amin(0, keepdim=True)  # (1, H)
    ok = errs <= best * (1.0 + rtol)  # (A, H); the best itself is always ok
    cand = torch.where(ok, g[:, None], torch.full_like(errs, -1.0))
    return cand.amax(0).float()  # (H,)


def fit_clip_alpha(reservoir_k: torch.Tensor, reservoir_v: torch.Tensor, reservoir_q: torch.Tensor, scaling: float,
                   bits: int, group: int, side: str, grid: Sequence[float] = DEFAULT_GRID, *layout: Any,
                   **options: Any) -> torch.Tensor:
    """Fit the clip alpha per kv head, float32 ``(H,)`` in (0, 1] (arguments: :func:`clip_errors`).

    Returns all-ones for ``bits >= 16`` (nothing is quantized).
    """
    if bits >= 16:
        return torch.ones(reservoir_k.shape[2], dtype=torch.float32)
    errs = quantization_errors(reservoir_k, reservoir_v, reservoir_q, scaling, bits, group, side, grid,
                               *layout, **options)
    return choose_alpha(errs, grid)


class ClipState(MethodState):
    """Clip scales of one layer per clipped side: a float, or a tensor broadcastable to the
    quantizer's per-group parameter shape (B, H, groups, D|D/G)."""

    def __init__(self, alphas: dict[str, float | torch.Tensor]) -> None:
        self.alpha = {side: a for side, a in alphas.items() if a is not None}
        self._device: dict[tuple[str, torch.device], torch.Tensor] = {}

    def clip(self, side: str) -> float | torch.Tensor | None:
        return self.alpha.get(side)

    def kernel_encode(self, side: str, x: torch.Tensor, stored: dict[str, Any]) -> KernelEncode | None:
        """The side's alpha on the block's device as float32, checked and copied once per device
        (a host-to-device copy at every flush would stall it)."""
        alpha = self.alpha.get(side)
        if alpha is None:
            return NO_KERNEL_ENCODE
        if not isinstance(alpha, torch.Tensor):
            return KernelEncode(clip=alpha)
        key = (side, x.device)
        if key not in self._device:
            a = alpha.detach().to(dtype=torch.float32)
            if not bool(((a > 0) & (a <= 1)).all()):  # once: the kernels run with validate=False
                raise ValueError(f"{side} clip values must lie in (0, 1] (1 means no clipping)")
            self._device[key] = a.to(x.device)
        return KernelEncode(clip=self._device[key])


class ClipMethod(Method):
    """SKVQ clip scales per kv head for every quantized side.

    Uses ``{side}.perm`` and ``{side}.center`` from earlier methods when present, so the alpha is
    fitted on the data the runtime will quantize.
    """

    name: ClassVar[str] = "clip"
    summary: ClassVar[str] = "SKVQ clip scales per kv head, fitted on the attention output"
    order: ClassVar[int] = 30
    tensors: ClassVar[tuple[TensorSpec, ...]] = (
        TensorSpec("clip", ("k", "v"), "float32", "(H, 1)", "clip alpha in (0, 1] per kv head"),
    )
    search: ClassVar[str | None] = "layer"
    search_default: ClassVar[bool] = True
    letter: ClassVar[str] = "c"
    flags: ClassVar[tuple[Flag, ...]] = (Flag("clip", bool, "SKVQ clip scales fitted on the attention output."),)

    def __init__(self, grid: Sequence[float] = DEFAULT_GRID, objective: str = "output") -> None:
        try:
            self.grid = check_grid(grid)
        except CalibrationError as err:
            raise ValueError(str(err)) from None
        if objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
        self.objective = objective

    def _fit(self, layer_stats: LayerStats, layer_cfg: LayerConfig, seed: int,
             context: FitContext, geom: LayerGeometry) -> dict[str, torch.Tensor]:
        out = {}
        fitted = context.fitted
        objective = self.objective if geom.q_heads else "mse"  # no queries collected: raw error
        for side, bits, group in (("k", layer_cfg.k_bits, layer_cfg.k_group),
                                  ("v", layer_cfg.v_bits, layer_cfg.v_group)):
            if bits >= 16:
                continue
            center_bits = int(fitted.get(f"{side}.center", torch.tensor(0.0)))  # 0, 8 or 16
            alpha = fit_clip_alpha(layer_stats.reservoir_k, layer_stats.reservoir_v, layer_stats.reservoir_q,
                                   layer_stats.scaling, bits, group, side, self.grid,
                                   fitted.get(f"{side}.perm"), layer_cfg.k_axis, objective, center_bits)
            out[f"{side}.clip"] = alpha[:, None].contiguous()  # (H, 1)
        return out

    @classmethod
    def load(cls, tensors: dict[str, torch.Tensor], cfg: LayerConfig, heads: int | None,
             head_dim: int | None) -> ClipState | None:
        alphas = {}
        for side in ("k", "v"):
            t = tensors.get(f"{side}.clip")
            if t is None:
                continue
            check_quantized_side(cfg, f"{side}.clip")
            if not t.is_floating_point():
                raise ValueError(f"{side}.clip must be floating point, got {t.dtype}")
            # (H, 1): one alpha per kv head, what the fit writes; (H, head_dim): one per channel,
            # only where the quantizer's groups run along tokens with one scale per channel (KIVI
            # keys): per-token layouts have D/G groups per token, which a (1, H, 1, D) alpha
            # would silently broadcast against when G = 1 or fail on otherwise
            per_channel = cfg.per_channel(side) and head_dim is not None
            h_ok = heads is None or t.shape[:1] == (heads,)
            d_ok = t.dim() == 2 and t.shape[0] >= 1 and (t.shape[1] == 1 or (per_channel and t.shape[1] == head_dim))
            if not (h_ok and d_ok):
                also = f" (or (H, head_dim) = ({heads}, {head_dim}) for keys per channel)" if cfg.per_channel(side) else ""
                raise ValueError(f"{side}.clip must have shape (H, 1) = ({heads}, 1){also}, got {tuple(t.shape)}")
            t = t.float()
            if t.numel() and (t.min() < MIN_CLIP or t.max() > 1):
                raise ValueError(f"{side}.clip must lie in [{MIN_CLIP:g}, 1] (1 means no clipping; below "
                                 f"{MIN_CLIP:g} a group keeps almost none of its range: the channel is zeroed), got "
                                 f"values in [{float(t.min()):.3g}, {float(t.max()):.3g}]")
            # stored per (head, channel-or-1); quantizers broadcast over (B, H, groups, D)
            alphas[side] = t[None, :, None, :]
        return ClipState(alphas) if alphas else None

    @classmethod
    def from_arguments(cls, cfg: LayerConfig, arguments: dict[str, Any]) -> ClipState | None:
        alphas = {side: arguments.pop(f"{side}_clip", 1.0) for side in ("k", "v")}
        alphas = {side: a for side, a in alphas.items() if isinstance(a, torch.Tensor) or a != 1.0}
        return ClipState(alphas) if alphas else None
