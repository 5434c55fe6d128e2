"""Keys quantized before the rotary embedding (KVQuant's pre-RoPE keys).

RoPE rotates each pair of key channels ``(i, i + R/2)`` by an angle that grows with the token's
position, so a channel's values wander with position after RoPE; before it, KVQuant finds the
per-channel structure (a few large channels of steady sign and range) that per-channel key
quantization groups over tokens exploit. The cache holds post-RoPE keys (the model applies RoPE
before the cache sees them), so this method un-applies it at encode and applies it again after
dequantizing:

- encode (reference codec, and the flush before the quantize-and-pack kernels): ``k_pre =
  RoPE^-1(k, p)`` at each token's RoPE position ``p`` (the positions the model's forward gave it:
  padding skipped), then every later step (rotation, centering, clip, the quantizer) on ``k_pre``;
- decode: dequantize, undo the later steps, then ``RoPE(k_pre_hat, p)``.

The codec's callers pass the blocks' positions (``positions=`` of
:meth:`~kvcalib.codec.LayerCodec.encode_keys` / ``decode_keys``; the cache computes them from its
padding mask, the simulation from the attention mask). The decode kernel does not re-apply RoPE
per block: a layer with pre-RoPE keys runs the PyTorch reference attention
(``kernel_attend`` returns None), the other layers still use the kernel.

Recipe tensors: ``k.rope`` float32 ``(R/2 + 1,)``: the layer's inverse frequencies and cos/sin
scaling (:func:`kvcalib.models.rope_tables`, recorded by ``kvcalib collect``), the runtime's whole
state for it; ``k.prerope_gain``: the fit's measured reduction of the post-RoPE key error on the
reservoir (the method is on where it is above ``min_gain``).

Statistics of older collections lack the reservoir's positions and the RoPE tables: the fit then
refuses with a message to collect again.
"""

from __future__ import annotations

from dataclasses import replace
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
    fake_quantize,
    reservoir_moments,
    reservoir_positions,
    reservoir_to_bhtd,
    switch_lines,
    switch_section,
    usable_tokens,
)
from kvcalib.quant.rotation import apply_rope
from kvcalib.stats import LayerStats

__all__ = ["prerope_errors", "PreRopeState", "PreRopeMethod"]


def _unrope_reservoir(reservoir: torch.Tensor, pos: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """A reservoir ``(NB, BL, Hx, D)`` before RoPE at positions ``pos`` (NB, BL): float32, same shape."""
    x = reservoir.float().transpose(1, 2)  # (NB, Hx, BL, D)
    return apply_rope(x, pos, rope, inverse=True).transpose(1, 2).contiguous()


def prerope_errors(layer_stats: LayerStats, bits: int, group: int, k_axis: str = "channel") -> tuple[float, float]:
    """Squared error of the post-RoPE keys on the reservoir, ``(plain, pre-RoPE)``: quantized as
    the cache holds them, and quantized before RoPE then rotated back (what decoding sees)."""
    if layer_stats.rope is None:
        raise CalibrationError("pre-RoPE keys need the model's RoPE tables, which these statistics lack (a model "
                               "without a static rotary embedding, or statistics of an older kvcalib: collect again)")
    pos = reservoir_positions(layer_stats)  # (NB, BL)
    k = reservoir_to_bhtd(layer_stats.reservoir_k)  # (NB, H, BL, D) post-RoPE
    t = usable_tokens(k.shape[2], "k", group, k_axis)
    k, pos = k[:, :, :t], pos[:, :t]
    plain = float(((fake_quantize(k, "k", bits, group, k_axis) - k) ** 2).sum(dtype=torch.float64))
    pre = apply_rope(k, pos, layer_stats.rope, inverse=True)  # (NB, H, T, D)
    back = apply_rope(fake_quantize(pre, "k", bits, group, k_axis), pos, layer_stats.rope)
    return plain, float(((back - k) ** 2).sum(dtype=torch.float64))


class PreRopeState(MethodState):
    """The layer's RoPE table ``(R/2 + 1,)`` (inverse frequencies, then the cos/sin scaling): keys
    are stored before RoPE at the positions the codec's caller passes."""

    needs_positions = True

    def __init__(self, rope: torch.Tensor) -> None:
        self.rope = rope.float()

    @staticmethod
    def _positions(stored: dict[str, Any]) -> torch.Tensor:
        return stored["positions"]  # (B|1, N) int64: the codec refuses a call without them

    def encode(self, side: str, x: torch.Tensor, stored: dict[str, Any]) -> torch.Tensor:
        return apply_rope(x, self._positions(stored), self.rope, inverse=True) if side == "k" else x  # (B, H, N, D)

    def decode(self, side: str, y: torch.Tensor, stored: dict[str, Any]) -> torch.Tensor:
        return apply_rope(y, self._positions(stored), self.rope) if side == "k" else y  # (B, H, N, D)

    def kernel_encode(self, side: str, x: torch.Tensor, stored: dict[str, Any]) -> KernelEncode | None:
        return KernelEncode(x=self.encode(side, x, stored)) if side == "k" else NO_KERNEL_ENCODE  # un-RoPE'd at flush

    def kernel_attend(self, side: str, device: torch.device) -> KernelAttend | None:
        return None if side == "k" else NO_KERNEL_ATTEND  # RoPE per packed block is not in the decode kernel: reference path


class PreRopeMethod(Method):
    """Store keys before RoPE on the layers where that lowers the (post-RoPE) key error."""

    name: ClassVar[str] = "prerope"
    summary: ClassVar[str] = "keys quantized before the rotary embedding (KVQuant)"
    order: ClassVar[int] = 3
    tensors: ClassVar[tuple[TensorSpec, ...]] = (
        TensorSpec("rope", ("k",), "float32", "(R/2 + 1,)",
                   "RoPE inverse frequencies, then the cos/sin scaling: keys stored before RoPE"),
        TensorSpec("prerope_gain", ("k",), "float32", "()",
                   "relative reduction of the post-RoPE key error from quantizing before RoPE", applied=False),
    )
    search: ClassVar[str | None] = "layer"
    letter: ClassVar[str] = "p"
    flags: ClassVar[tuple[Flag, ...]] = (
        Flag("prerope", bool, "Keys quantized before RoPE (KVQuant) where that lowers the key error."),)

    def __init__(self, min_gain: float = 0.0) -> None:
        if not -1.0 < float(min_gain) < 1.0:
            raise ValueError(f"min_gain must lie in (-1, 1), got {min_gain!r}")
        self.min_gain = float(min_gain)

    def _fit(self, layer_stats: LayerStats, layer_cfg: LayerConfig, seed: int,
             context: FitContext, geom: LayerGeometry) -> dict[str, torch.Tensor]:
        if layer_cfg.k_bits >= 16:
            return {}
        plain, pre = prerope_errors(layer_stats, layer_cfg.k_bits, layer_cfg.k_group, layer_cfg.k_axis)
        gain = 0.0 if plain <= 0 else 1.0 - pre / plain
        out = {"k.prerope_gain": torch.tensor(gain, dtype=torch.float32)}
        if gain > self.min_gain:
            out["k.rope"] = layer_stats.rope.float().clone()
        return out

    def transform_stats(self, layer_stats: LayerStats, fitted: dict[str, torch.Tensor]) -> LayerStats:
        """Pre-RoPE key reservoir and moments; queries un-rotated at their own positions, so a
        query's score with the keys of its own position is kept (at other positions the scores a
        later output objective sees are an approximation: RoPE's relative rotation is left out)."""
        if "k.rope" not in fitted:
            return layer_stats
        pos = reservoir_positions(layer_stats)  # (NB, BL)
        rope = fitted["k.rope"]
        rk = _unrope_reservoir(layer_stats.reservoir_k, pos, rope)
        rq = layer_stats.reservoir_q
        if rq.shape[2]:
            rq = _unrope_reservoir(rq, pos, rope)
        return replace(layer_stats, k=reservoir_moments(rk, layer_stats.k["count"]), reservoir_k=rk, reservoir_q=rq)

    @classmethod
    def load(cls, tensors: dict[str, torch.Tensor], cfg: LayerConfig, heads: int | None,
             head_dim: int | None) -> PreRopeState | None:
        rope = tensors.get("k.rope")
        if rope is None:
            return None
        if rope.dim() != 1 or rope.numel() < 2 or not rope.is_floating_point():
            raise ValueError(f"k.rope must be float32 (R/2 + 1,) with R >= 2, got {rope.dtype} {tuple(rope.shape)}")
        if head_dim is not None and 2 * (rope.numel() - 1) > head_dim:
            raise ValueError(f"k.rope rotates {2 * (rope.numel() - 1)} channels, the model has head_dim {head_dim}")
        if not bool((rope[-1] > 0) & (rope[:-1] > 0).all()):
            raise ValueError("k.rope must hold positive inverse frequencies and a positive scaling")
        return PreRopeState(rope)

    @classmethod
    def from_arguments(cls, cfg: LayerConfig, arguments: dict[str, Any]) -> PreRopeState | None:
        """``k_rope=`` a RoPE table (:func:`kvcalib.models.rope_tables`)."""
        rope = arguments.pop("k_rope", None)
        return None if rope is None else PreRopeState(rope)

    @classmethod
    def inspect(cls, recipe: Any, info: Any, context: int, layers: list[dict[str, Any]],
                elements_per_layer: list[int]) -> dict[str, Any] | None:
        """Which layers store keys before RoPE, and the key error reduction the fit measured."""
        return switch_section(recipe, info, layers, cls.name, ("k",), {"rope": "on"}, "prerope_gain")

    @classmethod
    def inspect_lines(cls, report: dict[str, Any]) -> list[str]:
        return switch_lines(report, cls.name, "pre-RoPE keys", {"on": "P"})
