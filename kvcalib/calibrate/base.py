"""The calibration-step base class, input validation and the fake quantizer every step shares.

A calibration step (:class:`CalibrationMethod`) reads one layer's :class:`~kvcalib.stats.LayerStats`
and its :class:`~kvcalib.recipe.LayerConfig` and returns the recipe tensors it fits, named
without the ``layers.{i}.`` prefix (``"v.perm"``, ``"k.clip"``...). Steps are pure: no I/O, no
global state, the seed passed in is the only source of randomness.

Subclasses override one method, :meth:`CalibrationMethod._fit`; :meth:`CalibrationMethod.fit`
validates the statistics (geometry, finiteness, reservoir) before and the produced tensors
(declared names, finiteness) after, so every step refuses the same bad input the same way.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvcalib.errors import KvcalibError
from kvcalib.quant.uniform import quantize_dequantize_keys, quantize_dequantize_values
from kvcalib.recipe import LayerConfig
from kvcalib.stats import LayerStats

__all__ = [
    "CalibrationError",
    "LayerGeometry",
    "CalibrationMethod",
    "validate_layer_stats",
    "validate_reservoir",
    "reservoir_to_bhtd",
    "fake_quantize",
    "usable_tokens",
    "check_side",
    "SIDES",
]

SIDES = ("k", "v")
STAT_KEYS = ("min", "max", "mean", "absmax", "sq_mean")


class CalibrationError(KvcalibError, ValueError):
    """Calibration input that cannot be fitted (wrong shapes, empty reservoir, NaN/inf...).

    Both a :class:`~kvcalib.errors.KvcalibError` (the CLI prints it as one line) and a
    ``ValueError`` (what the quantization core raises for bad arguments), so callers may catch
    either.
    """


@dataclass(frozen=True)
class LayerGeometry:
    """Shapes read off one layer's statistics."""

    heads: int  # H, kv heads
    head_dim: int  # D
    q_heads: int  # Hq = H * rep (0 when the reservoir holds no queries)
    blocks: int  # NB, reservoir blocks (0 = empty reservoir)
    block_len: int  # BL, consecutive tokens per block

    @property
    def rep(self) -> int:
        """Query heads per kv head (GQA ratio)."""
        return self.q_heads // self.heads if self.q_heads else 0


def check_side(side: str) -> str:
    if side not in SIDES:
        raise CalibrationError(f"side must be 'k' or 'v', got {side!r}")
    return side


def validate_reservoir(
    reservoir: torch.Tensor, name: str, heads: int | None = None, head_dim: int | None = None
) -> tuple[int, int, int, int]:
    """Check a reservoir ``(NB, BL, H, D)``: 4-D, floating, non-empty, finite. Returns its shape."""
    if not isinstance(reservoir, torch.Tensor) or not reservoir.is_floating_point():
        raise CalibrationError(f"{name} must be a floating tensor (NB, BL, H, D), got {type(reservoir).__name__}"
                               f"{'' if not isinstance(reservoir, torch.Tensor) else ' ' + str(reservoir.dtype)}")
    if reservoir.dim() != 4:
        raise CalibrationError(f"{name} must have shape (NB, BL, H, D), got {tuple(reservoir.shape)}")
    nb, bl, h, d = reservoir.shape
    if nb == 0 or bl == 0:
        raise CalibrationError(
            f"{name} is empty (shape {tuple(reservoir.shape)}): collect statistics with "
            "--reservoir-blocks >= 1 and enough samples to fill at least one block"
        )
    if heads is not None and h != heads:
        raise CalibrationError(f"{name} has {h} heads, expected {heads}: statistics from another model?")
    if head_dim is not None and d != head_dim:
        raise CalibrationError(f"{name} has head_dim {d}, expected {head_dim}: statistics from another model?")
    if not bool(torch.isfinite(reservoir).all()):
        raise CalibrationError(
            f"{name} holds NaN or inf: collect again in float32 (--dtype fp32) or check the model"
        )
    return nb, bl, h, d


def validate_layer_stats(
    stats: LayerStats,
    heads: int | None = None,
    head_dim: int | None = None,
    *,
    need_reservoir: bool = False,
) -> LayerGeometry:
    """Check one layer's statistics are self-consistent, finite and of the expected geometry.

    Args:
        stats: the layer's statistics.
        heads, head_dim: the model's kv heads and head_dim when known (``ModelInfo``); a mismatch
            means statistics of another model and is refused.
        need_reservoir: refuse an empty reservoir (steps that fit on token blocks).

    Raises :class:`CalibrationError` naming the offending field.
    """
    if not isinstance(stats, LayerStats):
        raise CalibrationError(f"expected LayerStats, got {type(stats).__name__}")
    shape: tuple[int, ...] | None = None
    for side in SIDES:
        group = getattr(stats, side)
        for key in STAT_KEYS:
            t = group.get(key)
            if t is None:
                raise CalibrationError(f"statistics field {side}.{key} is missing: collect again")
            if t.dim() != 2:
                raise CalibrationError(f"statistics field {side}.{key} must be (H, D), got {tuple(t.shape)}")
            if shape is None:
                shape = tuple(t.shape)
            elif tuple(t.shape) != shape:
                raise CalibrationError(
                    f"statistics field {side}.{key} has shape {tuple(t.shape)}, the other fields {shape}: "
                    "the statistics file mixes models"
                )
            if not bool(torch.isfinite(t).all()):
                raise CalibrationError(f"statistics field {side}.{key} holds NaN or inf: collect again in fp32")
    h, d = shape  # type: ignore[misc]
    if heads is not None and h != heads:
        raise CalibrationError(f"statistics have {h} kv heads, the model has {heads}: statistics from another model")
    if head_dim is not None and d != head_dim:
        raise CalibrationError(f"statistics have head_dim {d}, the model has {head_dim}: statistics from another model")
    rk, rv, rq = stats.reservoir_k, stats.reservoir_v, stats.reservoir_q
    for name, r in (("reservoir_k", rk), ("reservoir_v", rv), ("reservoir_q", rq)):
        if r.dim() != 4:
            raise CalibrationError(f"{name} must be 4-D (NB, BL, heads, D), got {tuple(r.shape)}")
    nb, bl = int(rk.shape[0]), int(rk.shape[1])
    if tuple(rk.shape[2:]) != (h, d) or tuple(rv.shape) != tuple(rk.shape):
        raise CalibrationError(
            f"reservoir shapes k {tuple(rk.shape)} / v {tuple(rv.shape)} do not match the (H, D) = {(h, d)} "
            "of the statistics: statistics from another model"
        )
    hq = int(rq.shape[2])
    if rq.shape[0] != nb or rq.shape[1] != bl or rq.shape[3] != d or (hq and hq % h):
        raise CalibrationError(
            f"reservoir_q {tuple(rq.shape)} does not fit reservoir_k {tuple(rk.shape)}: expected "
            f"({nb}, {bl}, Hq, {d}) with Hq a multiple of {h}"
        )
    if need_reservoir:
        validate_reservoir(rk, "reservoir_k")
        validate_reservoir(rv, "reservoir_v")
    if not (isinstance(stats.scaling, int | float) and stats.scaling > 0 and stats.scaling < float("inf")):
        raise CalibrationError(f"statistics scaling must be a positive finite float, got {stats.scaling!r}")
    return LayerGeometry(heads=h, head_dim=d, q_heads=hq, blocks=nb, block_len=bl)


def reservoir_to_bhtd(reservoir: torch.Tensor) -> torch.Tensor:
    """``(NB, BL, H, D)`` float16 reservoir -> ``(NB, H, BL, D)`` float32 (blocks become the batch)."""
    return reservoir.float().transpose(1, 2).contiguous()


def usable_tokens(block_len: int, side: str, group: int, k_axis: str = "channel") -> int:
    """Tokens of a block that quantize: keys per channel need whole groups of ``group`` tokens.

    Per-channel keys (``side="k"``, ``k_axis="channel"``) use the first ``(BL // group) * group``
    tokens; every other layout quantizes each token alone and uses all ``BL``. Raises when a
    block is shorter than one key group.
    """
    if check_side(side) == "k" and k_axis == "channel":
        n = (block_len // group) * group
        if n == 0:
            raise CalibrationError(
                f"reservoir blocks of {block_len} tokens are shorter than one key group ({group} tokens): "
                f"collect with --block-len >= {group}"
            )
        return n
    return block_len


def fake_quantize(
    x: torch.Tensor,
    side: str,
    bits: int,
    group: int,
    k_axis: str = "channel",
    clip: float | torch.Tensor = 1.0,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """What decoding sees for ``x (..., T, D)`` stored in the runtime's layout, float32 ``(..., T, D)``.

    Keys with ``k_axis="channel"``: per channel over groups of ``group`` consecutive tokens
    (``T % group == 0``). Keys with ``k_axis="token"`` and values: per token over groups of
    ``group`` channels. ``bits >= 16`` returns ``x`` as float32 (not quantized).
    """
    if bits >= 16:
        return x.float()
    if check_side(side) == "k" and k_axis == "channel":
        return quantize_dequantize_keys(x, bits, group, clip=clip, valid=valid)
    return quantize_dequantize_values(x, bits, group, clip=clip, valid=valid)


class CalibrationMethod(abc.ABC):
    """One calibration step: LayerStats + LayerConfig -> named recipe tensors for that layer.

    Class attributes:
        name: registry key (``kvcalib.calibrate.METHODS[name]``).
        tensors: every tensor name the step may produce -> its shape/dtype and meaning. A step
            produces only names listed here (checked by :meth:`fit`).
        needs_reservoir: whether the step fits on reservoir token blocks (an empty reservoir is
            then refused) rather than on the per-channel moments only.

    Configuration lives in the subclass's constructor (validated there); fitted state is only
    what :meth:`fit` returns.
    """

    name: ClassVar[str]
    tensors: ClassVar[dict[str, str]]
    needs_reservoir: ClassVar[bool] = True

    def fit(
        self,
        layer_stats: LayerStats,
        layer_cfg: LayerConfig,
        seed: int = 0,
        fitted: dict[str, torch.Tensor] | None = None,
        *,
        heads: int | None = None,
        head_dim: int | None = None,
    ) -> dict[str, torch.Tensor]:
        """Fit this step on one layer.

        Args:
            layer_stats: the layer's statistics.
            layer_cfg: the layer's configuration (bits, groups, axis, window, sinks).
            seed: the only source of randomness.
            fitted: tensors already fitted for this layer by earlier steps (same unprefixed
                names); e.g. clipping is fitted on the permuted/centered data when a permutation
                or centering was fitted before it.
            heads, head_dim: the model's geometry when known; statistics of another shape are
                refused.

        Returns:
            ``{name: tensor}`` with names from :attr:`tensors`; possibly empty when the step does
            not apply to this layer (e.g. nothing is quantized).
        """
        if not isinstance(layer_cfg, LayerConfig):
            raise CalibrationError(f"layer_cfg must be a LayerConfig, got {type(layer_cfg).__name__}")
        geom = validate_layer_stats(layer_stats, heads, head_dim, need_reservoir=self.needs_reservoir)
        try:
            layer_cfg.check_head_dim(geom.head_dim)
        except ValueError as err:
            raise CalibrationError(f"{self.name}: layer config does not fit head_dim {geom.head_dim}: {err}") from None
        out = self._fit(layer_stats, layer_cfg, int(seed), dict(fitted or {}), geom)
        unknown = sorted(set(out) - set(self.tensors))
        if unknown:  # a programming error in the subclass, not user input
            raise RuntimeError(f"{type(self).__name__} produced undeclared tensors {unknown}")
        for key, t in out.items():
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise RuntimeError(f"{type(self).__name__} produced non-finite {key}")
        return out

    @abc.abstractmethod
    def _fit(
        self,
        layer_stats: LayerStats,
        layer_cfg: LayerConfig,
        seed: int,
        fitted: dict[str, torch.Tensor],
        geom: LayerGeometry,
    ) -> dict[str, torch.Tensor]:
        """The step itself, on validated input."""

    def config(self) -> dict[str, Any]:
        """The step's configuration (recorded next to its outputs for provenance)."""
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(self).items()}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"
