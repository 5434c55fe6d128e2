"""PATS generalised to integer tiers: a token's precision depends on its age, decreasing over time.

PATS (Position-Adaptive Temporal Sparsity) truncates the low mantissa bits of K/V entries by a
position-dependent amount, with three static schedules over the context: *old-heavy* truncates
older tokens more (linear in position), *new-heavy* truncates recent tokens more while keeping
the initial sink tokens, *middle-heavy* truncates the middle most and keeps both ends (best in
the paper). kvcalib turns this into **integer tiers** on packed storage:

    Schedule(tiers=(Tier(age=0, k_bits=16, v_bits=16),      # recent window, full precision
                    Tier(age=128, k_bits=8, v_bits=8),      # then 8 bits
                    Tier(age=1024, k_bits=4, v_bits=4),     # then 4
                    Tier(age=4096, k_bits=2, v_bits=2)),    # then 2
             sinks=4)                                       # first 4 tokens: full precision

A tier applies to tokens whose age (``T - 1 - position`` at context length T; the newest token
has age 0) is in ``[tier.age, next_tier.age)``. A packed block of consecutive tokens
``[s, e)`` moves as a whole: its tier is that of its *youngest* token, age ``T - e``
(:meth:`Schedule.block_tier`), so a block drops to fewer bits only once all its tokens are old
enough.

Why bits may only decrease with age (validated): a stored token cannot regain information it
lost, so in a streaming cache precision is non-increasing over a token's life. This is what
limits the mapping of PATS's schedules, which are static functions of position over the
whole context (a paper evaluation that truncates a complete context at once):

- ``middle-heavy`` (PATS's best): both ends kept -- the newest end by a full-precision recent
  window, the oldest end by full-precision **sinks** (the first tokens, position-based); the
  middle loses bits with age: 16 (window) -> 8 -> 4 -> 2. PATS's triangle also rises gradually
  toward position 0; here that end is a fixed number of sink tokens, because a token drifting
  toward the "old end" as T grows would have to regain bits.
- ``old-heavy``: the same age tiers with **no sinks**: the oldest tokens are truncated most.
- ``new-heavy``: recent tokens truncated most, sinks kept. Bits cannot increase with age, so
  the realisable version stores every non-sink token at the lowest tier from the moment it is
  written (no recent window); only the sinks keep full precision. (PATS also found new-heavy
  worse.)

Preset thresholds (window 128, then ages 1024 and 4096) and bits (8, 4, 2) are kvcalib's
choice; PATS's schedules are linear in position with ``b_min=2`` and ``b_max`` up to 10
truncated mantissa bits. The paper's own operation, mantissa truncation of floating-point
entries, is :func:`mantissa_truncate` (bit-exact), usable on the full-precision segments.

Runtime contract for ``kv.schedule`` (int64 ``(N, 3)``, rows ``(age, k_bits, v_bits)``; the
layer's ``sinks`` stay in the LayerConfig):

- the row of the first quantized tier equals the LayerConfig (its age is ``cfg.window``, its bits
  ``cfg.k_bits``/``cfg.v_bits``): flushing is unchanged (:meth:`Schedule.check_layer`);
- after every step at context T, each packed block ``[s, e)`` must hold the bits of
  ``block_tier(e, T)``; when that tier's bits for a side are lower than the block's, replace the
  block's side by :func:`requantize` (dequantize at the old bits, quantize at the new bits, same
  layout and group; no clipping on requantization: the range is already clipped). Blocks only
  ever move down; a side at 16 bits in the first quantized tier stays at 16 (validated);
- the decode-faithful simulation must reproduce the *chain* of requantizations, not a direct
  quantization at the final bits: :func:`fake_quantize_chain` with :meth:`Schedule.bits_chain`;
- memory: :func:`schedule_bytes` counts each block at its tier's bits plus its scales/zeros.

The runtime that does this is :mod:`kvcalib.runtime.tiers` (one packed store per stored tier,
advanced right after each step's flush). Timing, as for flushes: the step that attends query i
ends at context T = i + 1 and leaves every block at ``block_tier(e, i + 1)``, so query i itself
sees the tiers of context i (the state the previous step left); :mod:`kvcalib.simulate`
reproduces exactly that.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvcalib.errors import KvcalibError
from kvcalib.layout import LayerConfig, layer_bytes
from kvcalib.methods.base import (CalibrationError, FitContext, Flag, LayerGeometry, Method, MethodState, TensorSpec,
                                  check_side, fake_quantize)
# requantize (a packed block moved to fewer bits) is the packed format's, shared with the codec
from kvcalib.quant.uniform import requantize  # noqa: F401  (named here as before)
from kvcalib.stats import LayerStats

__all__ = [
    "TIER_BITS",
    "PRESETS",
    "Tier",
    "Schedule",
    "preset_schedule",
    "requantize",
    "fake_quantize_chain",
    "MANTISSA_BITS",
    "mantissa_truncate",
    "truncated_width",
    "tier_token_counts",
    "schedule_bytes",
    "TierState",
    "ScheduleMethod",
    "NO_SCHEDULE",
    "SCHEDULE_PRESETS",
    "schedule_ages",
]

TIER_BITS = (2, 3, 4, 8, 16)  # 16 = full precision; a 3-bit layer's tokens halve to 2 bits
PRESETS = ("old-heavy", "middle-heavy", "new-heavy")
SCALE_BYTES = 2  # float16 scale and zero


def _check_int(name: str, val: Any, lo: int = 0) -> int:
    if isinstance(val, bool) or not isinstance(val, int) or val < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {val!r}")
    return val


@dataclass(frozen=True)
class Tier:
    """Tokens at least ``age`` tokens old (until the next tier) hold ``k_bits``/``v_bits``."""

    age: int
    k_bits: int
    v_bits: int

    def __post_init__(self) -> None:
        _check_int("tier age", self.age)
        for name in ("k_bits", "v_bits"):
            if getattr(self, name) not in TIER_BITS or isinstance(getattr(self, name), bool):
                raise ValueError(f"tier {name} must be one of {TIER_BITS}, got {getattr(self, name)!r}")

    @property
    def quantized(self) -> bool:
        return self.k_bits < 16 or self.v_bits < 16


@dataclass(frozen=True)
class Schedule:
    """Age tiers, youngest first, plus the count of full-precision sink tokens.

    Validation (``ValueError``): at least one tier; the first starts at age 0; ages strictly
    increase; k_bits and v_bits each never increase with age; consecutive tiers differ (no
    redundant tier); a side at 16 bits in the first quantized tier stays at 16 (later tiers only
    requantize packed data).
    """

    tiers: tuple[Tier, ...]
    sinks: int = 0

    def __post_init__(self) -> None:
        tiers = []
        for t in self.tiers:
            if isinstance(t, Tier):
                tiers.append(t)
            elif isinstance(t, dict):
                unknown = sorted(set(t) - {"age", "k_bits", "v_bits"})
                if unknown:
                    raise ValueError(f"tier has unknown keys {unknown}; allowed: age, k_bits, v_bits")
                tiers.append(Tier(**t))
            elif isinstance(t, Sequence) and len(t) == 3:
                tiers.append(Tier(*t))
            else:
                raise ValueError(f"a tier must be a Tier, a dict or an (age, k_bits, v_bits) triple, got {t!r}")
        object.__setattr__(self, "tiers", tuple(tiers))
        _check_int("sinks", self.sinks)
        if not tiers:
            raise ValueError("a schedule needs at least one tier")
        if tiers[0].age != 0:
            raise ValueError(f"the first tier must start at age 0, got {tiers[0].age}")
        first_q = next((t for t in tiers if t.quantized), None)
        for prev, cur in zip(tiers, tiers[1:]):
            if cur.age <= prev.age:
                raise ValueError(f"tier ages must strictly increase, got {prev.age} then {cur.age}")
            if cur.k_bits > prev.k_bits or cur.v_bits > prev.v_bits:
                raise ValueError(
                    f"bits may not increase with age (a stored token cannot regain precision): tier at age "
                    f"{cur.age} has ({cur.k_bits}, {cur.v_bits}) after ({prev.k_bits}, {prev.v_bits})"
                )
            if (cur.k_bits, cur.v_bits) == (prev.k_bits, prev.v_bits):
                raise ValueError(f"tier at age {cur.age} repeats the bits of the previous tier: merge them")
            if first_q is not None and prev.quantized:
                for side in ("k_bits", "v_bits"):
                    if getattr(first_q, side) == 16 and getattr(cur, side) < 16:
                        raise ValueError(
                            f"{side} is full precision in the first quantized tier (age {first_q.age}) but "
                            f"{getattr(cur, side)} at age {cur.age}: later tiers may only requantize packed data"
                        )

    # ------------------------------------------------------------------ queries
    def tier_of(self, age: int) -> int:
        """Index of the tier holding a token of this age (``age >= 0``)."""
        if isinstance(age, bool) or not isinstance(age, int) or age < 0:
            raise ValueError(f"age must be a non-negative int, got {age!r}")
        return bisect.bisect_right([t.age for t in self.tiers], age) - 1

    def bits_at(self, age: int) -> tuple[int, int]:
        """``(k_bits, v_bits)`` of a token of this age."""
        t = self.tiers[self.tier_of(age)]
        return t.k_bits, t.v_bits

    def block_tier(self, block_end: int, context: int) -> int:
        """Tier of the block of tokens ending at position ``block_end`` (exclusive) at context length T."""
        if not 0 < block_end <= context:
            raise ValueError(f"block_end must lie in (0, context={context}], got {block_end}")
        return self.tier_of(context - block_end)

    @property
    def window(self) -> int | None:
        """Age where the first quantized tier starts (the full-precision window), None if none is quantized."""
        return next((t.age for t in self.tiers if t.quantized), None)

    def bits_chain(self, tier: int, side: str) -> list[int]:
        """Bits a block's side passes through from its first quantization up to tier ``tier``.

        E.g. tiers 16 -> 8 -> 4 -> 2 and ``tier=3``: ``[8, 4, 2]``; ``[]`` while at 16 bits.
        """
        key = f"{check_side(side)}_bits"
        chain: list[int] = []
        for t in self.tiers[: tier + 1]:
            b = getattr(t, key)
            if b < 16 and (not chain or chain[-1] != b):
                chain.append(b)
        return chain

    def check_layer(self, cfg: LayerConfig) -> None:
        """Refuse a schedule that disagrees with the layer's config (sinks, window, first bits)."""
        first = next((t for t in self.tiers if t.quantized), None)
        want = {"sinks": self.sinks, "window": self.window or 0,
                "k_bits": first.k_bits if first else 16, "v_bits": first.v_bits if first else 16}
        for key, val in want.items():
            if getattr(cfg, key) != val:
                raise CalibrationError(
                    f"schedule does not fit the layer config: layer {key} is {getattr(cfg, key)}, the schedule "
                    f"needs {val}"
                )

    # ------------------------------------------------------------------ (de)serialisation
    def to_tensor(self) -> torch.Tensor:
        """int64 ``(N, 3)``: rows ``(age, k_bits, v_bits)``."""
        return torch.tensor([[t.age, t.k_bits, t.v_bits] for t in self.tiers], dtype=torch.int64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor, sinks: int = 0) -> "Schedule":
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[1] != 3 or t.is_floating_point():
            raise CalibrationError(f"a schedule tensor must be integer (N, 3), got {getattr(t, 'shape', t)}")
        try:
            return cls(tuple(Tier(*map(int, row)) for row in t.tolist()), sinks)
        except ValueError as err:
            raise CalibrationError(f"invalid schedule tensor: {err}") from None

    def to_dict(self) -> dict[str, Any]:
        return {"tiers": [[t.age, t.k_bits, t.v_bits] for t in self.tiers], "sinks": self.sinks}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Schedule":
        if not isinstance(data, dict):
            raise ValueError(f"a schedule must be an object, got {type(data).__name__}")
        unknown = sorted(set(data) - {"tiers", "sinks"})
        if unknown:
            raise ValueError(f"schedule has unknown keys {unknown}; allowed: sinks, tiers")
        if "tiers" not in data:
            raise ValueError("schedule needs 'tiers'")
        return cls(tuple(data["tiers"]), data.get("sinks", 0))

    @classmethod
    def from_layer(cls, cfg: LayerConfig, ages: Sequence[int] = (1024, 4096)) -> "Schedule":
        """The layer's config (sinks, window, bits) followed by halving the bits at each age in ``ages``.

        8 -> 4 -> 2 and 3 -> 2 (a side at 2 bits stays, a side at 16 stays 16); steps that change nothing are
        dropped. ``ages`` must be increasing and beyond the window.
        """
        tiers = []
        if cfg.window > 0 or not cfg.compressed:
            tiers.append(Tier(0, 16, 16))
        if cfg.compressed:
            tiers.append(Tier(cfg.window, cfg.k_bits, cfg.v_bits))
            kb, vb = cfg.k_bits, cfg.v_bits
            for age in ages:
                if age <= tiers[-1].age:
                    raise ValueError(f"schedule ages must increase beyond the window ({cfg.window}), got {list(ages)}")
                kb = kb if kb >= 16 else max(2, kb // 2)
                vb = vb if vb >= 16 else max(2, vb // 2)
                if (kb, vb) != (tiers[-1].k_bits, tiers[-1].v_bits):
                    tiers.append(Tier(age, kb, vb))
        return cls(tuple(tiers), cfg.sinks)


def preset_schedule(name: str, window: int = 128, sinks: int = 4, ages: Sequence[int] = (1024, 4096),
                    bits: Sequence[int] = (8, 4, 2)) -> Schedule:
    """One of :data:`PRESETS` (mapping from PATS in the module docstring).

    ``bits[i]`` holds from ``window`` (i = 0) and from ``ages[i - 1]`` (i >= 1) on, for K and V
    alike; ``len(bits) == len(ages) + 1``. ``new-heavy`` uses only ``bits[-1]`` and ``sinks``.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown schedule preset {name!r}: use one of {', '.join(PRESETS)}")
    if len(bits) != len(ages) + 1:
        raise ValueError(f"need len(bits) == len(ages) + 1, got bits {list(bits)} and ages {list(ages)}")
    if name == "new-heavy":
        return Schedule((Tier(0, bits[-1], bits[-1]),), sinks)
    starts = [window, *ages]
    tiers = ([Tier(0, 16, 16)] if window > 0 else []) + [Tier(a, b, b) for a, b in zip(starts, bits)]
    return Schedule(tuple(tiers), 0 if name == "old-heavy" else sinks)


# ---------------------------------------------------------------------- packed-storage operations


def fake_quantize_chain(x: torch.Tensor, side: str, chain: Sequence[int], group: int, k_axis: str = "channel",
                        clip: float | torch.Tensor = 1.0) -> torch.Tensor:
    """float32 ``(..., T, D)``: what decoding sees after the first quantization at ``chain[0]`` (with
    ``clip``) and requantizations to each later bit width (no clip). Equals
    ``dequantize(requantize(...requantize(quantize(x, chain[0]), chain[1])..., chain[-1]))``.
    An empty chain returns ``x`` (full precision)."""
    out = x.float()
    for i, b in enumerate(chain):
        out = fake_quantize(out, side, b, group, k_axis, clip=clip if i == 0 else 1.0)
    return out


MANTISSA_BITS = {torch.float16: 10, torch.bfloat16: 7, torch.float32: 23}
_EXPONENT_BITS = {torch.float16: 5, torch.bfloat16: 8, torch.float32: 8}
_INT_VIEW = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}


def mantissa_truncate(x: torch.Tensor, keep_bits: int) -> torch.Tensor:
    """PATS's bit truncation: zero all but the ``keep_bits`` highest mantissa bits, bit-exactly.

    Args:
        x: float16, bfloat16 (or float32) tensor, any shape.
        keep_bits: mantissa bits kept, ``0 <= keep_bits <= mantissa bits`` (10 fp16, 7 bf16, 23 fp32).

    Returns a tensor of ``x``'s dtype and shape: the sign and exponent unchanged, the low
    ``mantissa - keep_bits`` bits cleared, i.e. rounding toward zero in magnitude. Non-finite
    entries (inf, NaN) are returned unchanged (clearing a NaN's payload could turn it into inf).
    The truncated value needs ``1 + exponent + keep_bits`` bits if packed (:func:`truncated_width`).
    """
    if not isinstance(x, torch.Tensor) or x.dtype not in MANTISSA_BITS:
        raise CalibrationError(f"mantissa_truncate needs float16/bfloat16/float32, got {getattr(x, 'dtype', type(x))}")
    mbits = MANTISSA_BITS[x.dtype]
    if isinstance(keep_bits, bool) or not isinstance(keep_bits, int) or not 0 <= keep_bits <= mbits:
        raise CalibrationError(f"keep_bits must be an int in [0, {mbits}] for {x.dtype}, got {keep_bits!r}")
    drop = mbits - keep_bits
    if drop == 0:
        return x.clone()
    mask = -(1 << drop)  # two's complement: ones above bit `drop`, e.g. drop=3 -> ...11111000
    bits = x.contiguous().view(_INT_VIEW[x.dtype]) & mask
    return torch.where(torch.isfinite(x), bits.view(x.dtype), x)


def truncated_width(dtype: torch.dtype, keep_bits: int) -> int:
    """Bits per element of a mantissa-truncated value: sign + exponent + kept mantissa bits."""
    if dtype not in MANTISSA_BITS or not 0 <= keep_bits <= MANTISSA_BITS[dtype]:
        raise CalibrationError(f"no truncated width for {dtype} keeping {keep_bits} mantissa bits")
    return 1 + _EXPONENT_BITS[dtype] + keep_bits


# ---------------------------------------------------------------------- memory accounting


def _flush_block(schedule: Schedule, k_group: int, k_axis: str) -> int:
    """Tokens flushed together: a key group when keys are quantized per channel, else 1 (LayerConfig)."""
    first = next((t for t in schedule.tiers if t.quantized), None)
    return k_group if first is not None and first.k_bits < 16 and k_axis == "channel" else 1


def tier_token_counts(schedule: Schedule, context: int, k_group: int = 32, k_axis: str = "channel") -> dict[str, Any]:
    """Where the ``context`` tokens of one sequence sit: ``{"full_precision": n, "tiers": [n_0, ...]}``.

    Sinks and not-yet-flushed tokens are full precision; flushed blocks of the flush size count
    in their :meth:`Schedule.block_tier` (same flush rule as ``recipe.quantized_token_count``).
    """
    _check_int("context", context)
    counts = [0] * len(schedule.tiers)
    window = schedule.window
    if window is None:
        return {"full_precision": context, "tiers": counts}
    block = _flush_block(schedule, k_group, k_axis)
    sinks = min(context, schedule.sinks)
    pending = context - sinks
    n_blocks = max(0, (pending - window) // block)
    for i in range(n_blocks):
        counts[schedule.tier_of(pending - (i + 1) * block)] += block  # youngest token's age
    return {"full_precision": context - n_blocks * block, "tiers": counts}


def schedule_bytes(schedule: Schedule, context: int, heads: int, head_dim: int, k_group: int = 32,
                   v_group: int = 32, k_axis: str = "channel", fp_bytes: int = 2) -> dict[str, float]:
    """Bytes one sequence's K and V of one layer hold at ``context`` under ``schedule``, by component.

    Components as :func:`kvcalib.layout.layer_bytes` (which this is, with the schedule's stored
    tiers): ``full_precision`` (sinks, window and pending tokens, and any side at 16 bits),
    ``k_codes``/``v_codes`` (each block at its tier's bits), ``k_scales``/``v_scales``. A
    one-tier-quantized schedule gives exactly the untiered ``layer_bytes``.
    """
    _check_int("heads", heads, 1)
    _check_int("head_dim", head_dim, 1)
    _check_int("context", context)
    if fp_bytes != 2:
        raise CalibrationError(f"full-precision segments are accounted at 2 bytes, got fp_bytes={fp_bytes}")
    if head_dim % v_group or (k_axis == "token" and head_dim % k_group):
        raise CalibrationError(f"groups (k {k_group}, v {v_group}) must divide head_dim {head_dim}")
    first = next((t for t in schedule.tiers if t.quantized), None)
    if first is None:
        return {"full_precision": float(2 * context * heads * head_dim * fp_bytes)}
    cfg = LayerConfig(k_bits=first.k_bits, v_bits=first.v_bits, k_axis=k_axis, k_group=k_group, v_group=v_group,
                      sinks=schedule.sinks, window=first.age)
    return layer_bytes(cfg, heads, head_dim, context, tiers=stored_tiers(schedule))


def stored_tiers(schedule: Schedule) -> list[tuple[int, int, int]]:
    """The schedule's stored tiers ``(first age, k_bits, v_bits)``, youngest first: its first
    quantized tier (the layer config) and every later one."""
    first = next(i for i, t in enumerate(schedule.tiers) if t.quantized)
    return [(t.age, t.k_bits, t.v_bits) for t in schedule.tiers[first:]]


class TierState(MethodState):
    """A layer's PATS schedule: the cache keeps one packed store per stored tier and moves blocks
    down as they age (:mod:`kvcalib.runtime.tiers`); the accounting counts each block at its tier."""

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self.stored_tiers = stored_tiers(schedule)


# ---------------------------------------------------------------------- search space: schedules
NO_SCHEDULE = "none"
# name -> ages where bits halve (preset_schedule's ages; the PATS shape comes from the sinks:
# middle-heavy keeps them, old-heavy has none; checked on the space)
SCHEDULE_PRESETS = {NO_SCHEDULE: (), "middle-heavy": (1024, 4096), "old-heavy": (1024, 4096)}


def schedule_ages(name: str) -> tuple[int, ...]:
    """Ages (tokens) at which a search-space schedule halves a layer's bits: ``()`` for ``"none"``.

    ``name`` is a key of :data:`SCHEDULE_PRESETS` or ``"ages:A,B,..."`` (strictly increasing
    positive integers). Raises ``ValueError`` otherwise.
    """
    if not isinstance(name, str):
        raise ValueError(f"search space key 'schedules': {name!r} is not a string")
    if name in SCHEDULE_PRESETS:
        return SCHEDULE_PRESETS[name]
    if name.startswith("ages:"):
        try:
            ages = tuple(int(a) for a in name[len("ages:"):].split(","))
        except ValueError:
            ages = ()
        if ages and all(a >= 1 for a in ages) and list(ages) == sorted(set(ages)):
            return ages
        raise ValueError(f"search space key 'schedules': {name!r} must list strictly increasing positive ages, "
                         "e.g. 'ages:1024,4096'")
    hint = (" (new-heavy stores every token at the lowest bits from the start: search per-layer bits "
            "at 2 bits instead)" if name == "new-heavy" else "")
    raise ValueError(f"search space key 'schedules': unknown schedule {name!r}{hint}; use "
                     f"{', '.join(repr(k) for k in SCHEDULE_PRESETS)} or 'ages:A,B,...'")


# ---------------------------------------------------------------------- export flags
EXPORT_AGES = (1024, 4096)  # ages where a preset halves the bits (preset_schedule's)
EXPORT_SINKS = 4  # sinks of the presets that keep the oldest end (preset_schedule's)


def _parse_ages(text: str | None) -> tuple[int, ...]:
    """``"1024,4096"`` -> (1024, 4096) for ``export --schedule-ages``."""
    if text is None:
        return EXPORT_AGES
    if isinstance(text, (tuple, list)):
        return tuple(text)
    try:
        return tuple(int(a) for a in str(text).split(",") if a.strip())
    except ValueError:
        raise KvcalibError(f"--schedule-ages {text!r} is not a comma-separated list of integers (e.g. 1024,4096).") from None


class ScheduleMethod(Method):
    """Attach a PATS-style age schedule to a quantized layer (static: nothing is fitted from data).

    The schedule is the layer's own config (sinks, window, bits) followed by halving the bits at
    each age in ``ages`` (:meth:`Schedule.from_layer`), validated against the layer; produces
    ``kv.schedule``. ``preset="new-heavy"`` instead stores every non-sink token at the layer's
    bits from the start (one tier at age 0; the layer's window must be 0).
    """

    name: ClassVar[str] = "schedule"
    summary: ClassVar[str] = "PATS position-adaptive tiers: packed blocks move to fewer bits as they age"
    order: ClassVar[int] = 50
    tensors: ClassVar[tuple[TensorSpec, ...]] = (
        TensorSpec("schedule", ("kv",), "int64", "(N, 3)",
                   "tiers (age, k_bits, v_bits), youngest first; sinks from the LayerConfig"),
    )
    needs_reservoir: ClassVar[bool] = False
    search: ClassVar[str | None] = "global"  # the search space's ``schedules`` (kvcalib.optimize.space)
    search_off: ClassVar[str] = NO_SCHEDULE  # the choice that attaches no schedule (the default space's only one)
    letter: ClassVar[str] = "s"
    flags: ClassVar[tuple[Flag, ...]] = (
        Flag("schedule", str, "PATS position-adaptive tiers: old-heavy | middle-heavy | new-heavy. Starts at --bits "
             "after --window, halves the bits at each of --schedule-ages (8 -> 4 -> 2).", tag="{}"),
        Flag("schedule_ages", str, "Token ages where --schedule halves the bits, comma-separated, increasing, above "
             "--window (default 1024,4096)."),
    )

    def __init__(self, ages: Sequence[int] = (1024, 4096), preset: str | None = None) -> None:
        ages = tuple(ages)
        for a in ages:
            _check_int("schedule age", a, 1)
        if list(ages) != sorted(set(ages)):
            raise ValueError(f"schedule ages must strictly increase, got {list(ages)}")
        if preset is not None and preset not in PRESETS:
            raise ValueError(f"unknown schedule preset {preset!r}: use one of {', '.join(PRESETS)}")
        self.ages = ages
        self.preset = preset

    def schedule_for(self, layer_cfg: LayerConfig) -> Schedule:
        """The schedule this method attaches to a compressed layer (checked against it)."""
        try:
            if self.preset == "new-heavy":
                schedule = Schedule((Tier(0, layer_cfg.k_bits, layer_cfg.v_bits),), layer_cfg.sinks)
            else:
                schedule = Schedule.from_layer(layer_cfg, self.ages)
        except ValueError as err:
            raise CalibrationError(f"schedule: {err}") from None
        schedule.check_layer(layer_cfg)
        return schedule

    # ------------------------------------------------------------------ its search dimension
    search_ages = staticmethod(schedule_ages)

    @staticmethod
    def check_search_choice(name: str, space: Any) -> None:
        """Refuse (``ValueError``) a choice of the space's ``schedules`` that no layout of ``space``
        (its ``windows`` and ``sinks``) can carry."""
        ages = schedule_ages(name)
        if ages and ages[0] <= max(space.windows):
            raise ValueError(f"search space key 'schedules': {name!r} changes bits at age {ages[0]}, inside the "
                             f"full-precision window {max(space.windows)}; every age must exceed every window")
        if name == "middle-heavy" and min(space.sinks) < 1:
            raise ValueError("search space key 'schedules': 'middle-heavy' keeps the oldest tokens as sinks, but "
                             f"the space's sinks include 0 ({list(space.sinks)}): give sinks >= 1 only (e.g. [4]), "
                             "or use 'ages:1024,4096' (the same tiers with any sinks)")
        if name == "old-heavy" and max(space.sinks) > 0:
            raise ValueError("search space key 'schedules': 'old-heavy' keeps no sinks, but the space's sinks are "
                             f"{list(space.sinks)}: give sinks [0], or use 'ages:1024,4096' (the same tiers with any sinks)")

    @staticmethod
    def min_scoring_length(name: str, space: Any, context: int) -> int:
        """The shortest scoring sequence in which every tier of schedule ``name`` that holds tokens at
        ``context`` also holds tokens, for every (bits, group, window, sinks) of ``space``; 0 for none.

        A block's tier is that of its youngest token (``Schedule.block_tier``), and the oldest
        flushed block of a T-token sequence ends at ``sinks + block``, so tier ``age`` holds tokens
        at T once ``T >= sinks + block + age`` (``block`` = key group for per-channel keys).
        """
        ages = schedule_ages(name)
        need = 0
        if not ages:
            return need
        for bits in space.bits:
            for group in space.groups:
                for window in space.windows:
                    for sinks in space.sinks:
                        cfg = LayerConfig(k_bits=bits, v_bits=bits, k_axis=space.k_axis, k_group=group,
                                          v_group=group, sinks=sinks, window=window)
                        sched = Schedule.from_layer(cfg, ages)
                        at_context = tier_token_counts(sched, context, group, space.k_axis)["tiers"]
                        block = cfg.flush_block
                        for tier, n in zip(sched.tiers, at_context):
                            if n and tier.age > 0:
                                need = max(need, sinks + block + tier.age)
        return need

    def static_tensors(self, layer_cfg: LayerConfig) -> dict[str, torch.Tensor]:
        """``kv.schedule`` from the ages alone, without statistics (what :meth:`_fit` attaches: nothing
        is read from data), for the search's floor check before collection; a schedule that does
        not fit the layer raises :meth:`Schedule.from_layer`'s ``ValueError`` as it is."""
        sched = Schedule.from_layer(layer_cfg, self.ages)
        sched.check_layer(layer_cfg)
        return {"kv.schedule": sched.to_tensor()}

    def _fit(self, layer_stats: LayerStats, layer_cfg: LayerConfig, seed: int,
             context: FitContext, geom: LayerGeometry) -> dict[str, torch.Tensor]:
        if not layer_cfg.compressed:
            return {}
        return {"kv.schedule": self.schedule_for(layer_cfg).to_tensor()}

    @classmethod
    def load(cls, tensors: dict[str, torch.Tensor], cfg: LayerConfig, heads: int | None,
             head_dim: int | None) -> TierState | None:
        t = tensors.get("kv.schedule")
        if t is None:
            return None
        try:
            schedule = Schedule.from_tensor(t, sinks=cfg.sinks)
            schedule.check_layer(cfg)
        except KvcalibError as err:
            raise ValueError(f"kv.schedule (rows age, k_bits, v_bits) is invalid: {err}. Re-export the recipe "
                             "(kvcalib export --schedule ...)") from None
        return TierState(schedule) if cfg.compressed else None

    @classmethod
    def from_arguments(cls, cfg: LayerConfig, arguments: dict[str, Any]) -> TierState | None:
        schedule = arguments.pop("schedule", None)
        if schedule is None:
            return None
        if not isinstance(schedule, Schedule):
            raise KvcalibError(f"schedule must be a Schedule, got {type(schedule).__name__}")
        schedule.check_layer(cfg)  # first quantized tier == config (sinks, window, bits)
        # nothing is ever stored packed on an uncompressed layer: the schedule has nothing to act on
        return TierState(schedule) if cfg.compressed else None

    # ------------------------------------------------------------------ export flags
    @classmethod
    def export_layer(cls, values: dict[str, Any], window: int | None, sinks: int | None) -> tuple[int | None, int | None]:
        """Window and sinks: defaults, or what the schedule preset needs (a contradiction is refused)."""
        sched = values.get("schedule")
        if sched is None:
            if values.get("schedule_ages") is not None:
                raise KvcalibError("--schedule-ages sets the ages of --schedule: pass --schedule too, or drop it.")
            return window, sinks
        if sched not in PRESETS:
            raise KvcalibError(f"--schedule {sched!r} is not known: use one of {', '.join(PRESETS)}.")
        want_sinks = EXPORT_SINKS if sched in ("middle-heavy", "new-heavy") else 0
        if sinks is None:
            sinks = want_sinks
        elif sched == "old-heavy" and sinks:
            raise KvcalibError(f"--schedule old-heavy truncates the oldest tokens most, so it keeps no sinks, "
                               f"but --sinks is {sinks}: drop --sinks, or use --schedule middle-heavy.")
        elif sched in ("middle-heavy", "new-heavy") and not sinks:
            raise KvcalibError(f"--schedule {sched} keeps the oldest tokens (sinks) in full precision, but --sinks "
                               f"is 0: leave --sinks out ({EXPORT_SINKS}) or pass --sinks >= 1 (or use old-heavy).")
        if window is None:
            window = 0 if sched == "new-heavy" else None
        elif sched == "new-heavy" and window:
            raise KvcalibError(f"--schedule new-heavy stores every non-sink token at --bits from the moment it is "
                               f"written (no full-precision window), but --window is {window}: leave "
                               "--window out or pass --window 0.")
        return window, sinks

    @classmethod
    def from_flags(cls, values: dict[str, Any], layer: LayerConfig) -> "ScheduleMethod | None":
        sched = values.get("schedule")
        if sched is None:
            return None
        ages = _parse_ages(values.get("schedule_ages"))
        if sched != "new-heavy":
            bad = [a for a in ages if isinstance(a, bool) or not isinstance(a, int)]
            if bad or list(ages) != sorted(set(ages)) or (ages and ages[0] <= layer.window):
                raise KvcalibError(f"--schedule-ages {','.join(map(str, ages))} must be strictly increasing "
                                   f"integers above the window ({layer.window}), e.g. 1024,4096.")
        if not layer.compressed:
            raise KvcalibError(f"--schedule {sched} moves quantized tokens to fewer bits as they age, but "
                               f"the layer keeps K and V in full precision: pass --bits k8v8, k4v4, ...")
        method = cls(ages if sched != "new-heavy" else EXPORT_AGES, preset=sched)
        try:
            method.schedule_for(layer)
        except KvcalibError as err:
            raise KvcalibError(f"--schedule {sched}: {err}.") from None
        return method
