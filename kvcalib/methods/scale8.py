"""8-bit scale and zero per quantization group, on tables calibrated per layer, side and column
(issue 53 item 4; the ``log8c`` format of ``experiments/scale8.py``).

A min/max group stores a float16 scale and zero: at 2 bits and groups of 64 that is 0.5 bits of
every element's 2.5. This method stores the pair in two bytes, a uint8 exponent on a per-column
log grid and an int8 zero step from a per-column centre (:mod:`kvcalib.quant.pair8` has the format
and its rounding), which saves 16 bits a group (0.245 bits an element at groups of 64). Measured
before it was a stored format: about 1% of the search's KL at the same code widths at 8k on
SmolLM2, and, with the saved bits spent on wider codes at the same bytes, half the KL
(docs/results.md, "8-bit scale and zero end to end at 8k"). It is what brings the layouts of a
2.5-bit budget at 8k within reach (``scripts/bits_floor.py``: group 64, window 64, 4 sinks, 2.465
bits with these pairs against 2.711 with float16 ones).

Fit (per layer and side, at the layer's bits): on the reservoir, in the basis the quantizer sees it
(rotation, centering, permutation and the clip scale fitted before: :func:`quantizer_input`),
``centre`` is each column's mean and ``base`` puts the grid's top at 4x the largest scale a group
of the column needed (:func:`kvcalib.quant.pair8.fit_pair8`). Recipe tensors ``{side}.pair_base``
and ``{side}.pair_centre``, float32 ``(H, C)`` (``C = D`` for per-channel keys, ``D / group``
otherwise): 1.5 KB a layer on SmolLM2, counted as recipe state.

Memory: each stored group keeps one byte of scale and one of zero; :meth:`Scale8State.bytes` gives
back the two bytes a group the float16 accounting (:func:`kvcalib.layout.layer_bytes`) counted.

Kernels: neither the quantize-and-pack kernels nor the decode kernel read 8-bit pairs yet, so such a
side encodes through the PyTorch reference codec and the layer attends on the reference path
(``kernel_encode`` / ``kernel_attend`` give None); the search offers it only when a ``--space``
file names it in ``layer_methods``, and says per layer which path it decodes on. Refused with a
PATS schedule (the tables belong to the layer's bits) and beside a fixed grid (errbound).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from kvcalib.layout import LayerConfig, scale_pairs
from kvcalib.methods.base import (FitContext, Flag, KernelAttend, KernelEncode, LayerGeometry, Method, MethodState,
                                  NO_KERNEL_ATTEND, NO_KERNEL_ENCODE, TensorSpec, switch_lines, switch_section)
from kvcalib.quant.pair8 import Pair8, fit_pair8
from kvcalib.reservoir import quantizer_input
from kvcalib.stats import LayerStats

__all__ = ["Scale8State", "Scale8Method", "saved_bytes"]

_SIDES = ("k", "v")


class Scale8State(MethodState):
    """8-bit pair tables per side: ``side -> Pair8``."""

    def __init__(self, pairs: dict[str, Pair8]) -> None:
        self.pairs = pairs

    def pair8(self, side: str) -> Pair8 | None:
        return self.pairs.get(side)

    def kernel_encode(self, side: str, x: torch.Tensor, stored: dict[str, Any]) -> KernelEncode | None:
        return None if side in self.pairs else NO_KERNEL_ENCODE  # the kernels write float16 pairs only

    def kernel_attend(self, side: str, device: torch.device) -> KernelAttend | None:
        return None if side in self.pairs else NO_KERNEL_ATTEND  # the decode kernel reads float16 pairs only

    def bytes(self, cfg: LayerConfig, heads: int, head_dim: int, kept: int, packed: int) -> dict[str, float]:
        return saved_bytes(cfg, heads, head_dim, packed, tuple(self.pairs))


def saved_bytes(cfg: LayerConfig, heads: int, head_dim: int, packed: int, sides: tuple[str, ...]) -> dict[str, float]:
    """The bytes :func:`~kvcalib.layout.layer_bytes` counts for float16 pairs beyond one byte each
    (two a group of ``packed`` stored tokens), given back (negative) on ``sides``."""
    return {f"{side}_scales": -2.0 * scale_pairs(cfg, side, packed, heads, head_dim) for side in sides}


class Scale8Method(Method):
    """8-bit scale and zero per group on calibrated per-column tables (module docstring)."""

    name: ClassVar[str] = "scale8"
    summary: ClassVar[str] = "8-bit scale and zero per group on calibrated per-column log grids (reference path)"
    order: ClassVar[int] = 36  # after clip (its range) and levels; before OTT, which fits on the quantized grid
    tensors: ClassVar[tuple[TensorSpec, ...]] = (
        TensorSpec("pair_base", _SIDES, "float32", "(H, C)",
                   "the 8-bit scale grid's base per kv head and parameter column: scale = base * 2**(e / 32)"),
        TensorSpec("pair_centre", _SIDES, "float32", "(H, C)",
                   "the 8-bit zero's centre per kv head and parameter column: zero = centre + m * 2**bits / 32 * scale"),
    )
    search: ClassVar[str | None] = "layer"
    saves_bytes: ClassVar[bool] = True  # two bytes a group: the search's floor prices it (Method docstring)
    letter: ClassVar[str] = "8"
    flags: ClassVar[tuple[Flag, ...]] = (
        Flag("scale8", bool, "8-bit scale and zero per group on calibrated per-column grids: 16 bits less a group "
             "(reference path: the kernels refuse such layers)."),)

    def _fit(self, layer_stats: LayerStats, layer_cfg: LayerConfig, seed: int,
             context: FitContext, geom: LayerGeometry) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for side in _SIDES:
            bits = layer_cfg.bits(side)
            if bits >= 16 or f"{side}.step" in context.fitted:
                continue  # a fixed grid (errbound) stores one pair per column already
            x, alpha = quantizer_input(layer_stats, layer_cfg, side, context.fitted)  # (NB, H, T, D)
            pair = fit_pair8(x, bits, layer_cfg.group(side), layer_cfg.per_channel(side), alpha)
            out[f"{side}.pair_base"], out[f"{side}.pair_centre"] = pair.base, pair.centre
        return out

    def planned_state_bytes(self, cfg: LayerConfig, heads: int, head_dim: int, kept: int, packed: int) -> float:
        """Every quantized side stores its pairs in one byte each (the fit gives every such side
        tables, but beside a fixed grid: then this is a lower bound, as the search's floor wants)."""
        sides = tuple(side for side in _SIDES if cfg.bits(side) < 16)
        return sum(saved_bytes(cfg, heads, head_dim, packed, sides).values())

    @staticmethod
    def _pairs(cfg: LayerConfig, given: dict[str, tuple[Any, Any]], heads: int | None,
               head_dim: int | None) -> Scale8State | None:
        pairs = {}
        for side, (base, centre) in given.items():
            if base is None and centre is None:
                continue
            if base is None or centre is None:
                raise ValueError(f"{side}.pair_base and {side}.pair_centre come together: one is missing")
            if cfg.bits(side) >= 16:
                raise ValueError(f"{side}.pair_base: the layer keeps {side.upper()} at 16 bits; remove the tensor")
            cols = None if head_dim is None else (head_dim if cfg.per_channel(side) else head_dim // cfg.group(side))
            try:
                pair = Pair8(base.float(), centre.float())
            except (ValueError, AttributeError) as err:
                raise ValueError(f"{side}.pair_base / {side}.pair_centre: {err}") from None
            if (heads is not None and pair.base.shape[0] != heads) or (cols is not None and pair.base.shape[1] != cols):
                raise ValueError(f"{side}.pair_base must be float32 (H, C) = ({heads}, {cols}), got "
                                 f"{tuple(pair.base.shape)}")
            pairs[side] = pair
        return Scale8State(pairs) if pairs else None

    @classmethod
    def load(cls, tensors: dict[str, torch.Tensor], cfg: LayerConfig, heads: int | None,
             head_dim: int | None) -> Scale8State | None:
        return cls._pairs(cfg, {s: (tensors.get(f"{s}.pair_base"), tensors.get(f"{s}.pair_centre")) for s in _SIDES},
                          heads, head_dim)

    @classmethod
    def from_arguments(cls, cfg: LayerConfig, arguments: dict[str, Any]) -> Scale8State | None:
        """``k_pair=`` / ``v_pair=``: a :class:`~kvcalib.quant.pair8.Pair8` (or ``(base, centre)``)."""
        given = {}
        for side in _SIDES:
            pair = arguments.pop(f"{side}_pair", None)
            if pair is not None:
                given[side] = (pair.base, pair.centre) if isinstance(pair, Pair8) else tuple(pair)
        return cls._pairs(cfg, given, None, None)

    @classmethod
    def inspect(cls, recipe: Any, info: Any, context: int, layers: list[dict[str, Any]],
                elements_per_layer: list[int]) -> dict[str, Any] | None:
        """Which sides store 8-bit pairs."""
        return switch_section(recipe, info, layers, cls.name, _SIDES, {"pair_base": "8-bit"})

    @classmethod
    def inspect_lines(cls, report: dict[str, Any]) -> list[str]:
        return switch_lines(report, cls.name, "8-bit scale pairs", {"8-bit": "8"})
