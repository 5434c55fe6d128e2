"""A toy compression method, whole in this one file: the registry contract end to end.

"Equalize": per kv head and channel, divide a side by a fitted power of two before quantizing
(the power of two nearest the channel's largest magnitude, so every channel's range is near 1)
and multiply after dequantizing.
It declares what every method declares -- what it fits, the recipe tensor it writes, its state
and transforms, the bytes it costs, its search switch and its CLI flag -- and nothing else in
kvcalib names it. ``tests/unit/test_toy_method.py`` registers it and follows it through fitting,
saving, loading, memory accounting, the search and decoding. Powers of two make the transform
exact in floating point, so decode(encode(x)) differs from x by the quantizer's error only.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from kvcalib.layout import LayerConfig
from kvcalib.methods.base import FitContext, Flag, LayerGeometry, Method, MethodState, TensorSpec
from kvcalib.stats import LayerStats


class EqualizeState(MethodState):
    """Channel scales per equalized side, float32 (H, D) powers of two."""

    def __init__(self, scales: dict[str, torch.Tensor]) -> None:
        self.scales = scales  # side -> (H, D)

    def encode(self, side: str, x: torch.Tensor, stored: dict[str, Any]) -> torch.Tensor:
        s = self.scales.get(side)
        return x if s is None else x.float() / s[None, :, None, :].to(x.device)  # (B, H, N, D)

    def decode(self, side: str, y: torch.Tensor, stored: dict[str, Any]) -> torch.Tensor:
        s = self.scales.get(side)
        return y if s is None else y * s[None, :, None, :].to(y.device)  # (B, H, N, D)

    def bytes(self, cfg: LayerConfig, heads: int, head_dim: int, kept: int, packed: int) -> dict[str, float]:
        # pretend the runtime keeps a float16 copy of each scale table once anything is packed
        return {"equalize_tables": 2.0 * heads * head_dim * len(self.scales)} if packed else {}


class EqualizeMethod(Method):
    name: ClassVar[str] = "equalize"
    summary: ClassVar[str] = "toy: power-of-two channel equalization before quantizing"
    order: ClassVar[int] = 35
    tensors: ClassVar[tuple[TensorSpec, ...]] = (
        TensorSpec("equalize", ("k", "v"), "float32", "(H, D)", "power-of-two scale per kv head and channel"),
    )
    needs_reservoir: ClassVar[bool] = False
    search: ClassVar[str | None] = "layer"
    letter: ClassVar[str] = "e"
    flags: ClassVar[tuple[Flag, ...]] = (Flag("equalize", bool, "Toy: equalize channel ranges by powers of two."),)

    def _fit(self, layer_stats: LayerStats, layer_cfg: LayerConfig, seed: int, context: FitContext,
             geom: LayerGeometry) -> dict[str, torch.Tensor]:
        out = {}
        for side in ("k", "v"):
            if layer_cfg.bits(side) >= 16:
                continue
            absmax = getattr(layer_stats, side)["absmax"].float().clamp_min(1e-6)  # (H, D)
            out[f"{side}.equalize"] = torch.exp2(torch.round(torch.log2(absmax))).clamp(2.0 ** -8, 2.0 ** 8)
        return out

    @classmethod
    def load(cls, tensors: dict[str, torch.Tensor], cfg: LayerConfig, heads: int | None,
             head_dim: int | None) -> EqualizeState | None:
        scales = {}
        for side in ("k", "v"):
            t = tensors.get(f"{side}.equalize")
            if t is None:
                continue
            if t.dim() != 2 or (heads is not None and t.shape[0] != heads) or (head_dim is not None and t.shape[1] != head_dim):
                raise ValueError(f"{side}.equalize must have shape (H, D) = ({heads}, {head_dim}), got {tuple(t.shape)}")
            if not t.is_floating_point() or not bool((t > 0).all()):
                raise ValueError(f"{side}.equalize must hold positive scales")
            scales[side] = t.float()
        return EqualizeState(scales) if scales else None

    @classmethod
    def from_arguments(cls, cfg: LayerConfig, arguments: dict[str, Any]) -> EqualizeState | None:
        scales = {side: arguments.pop(f"{side}_equalize", None) for side in ("k", "v")}
        scales = {side: s for side, s in scales.items() if s is not None}
        return EqualizeState(scales) if scales else None
