"""How one layer's cache is laid out: its configuration and what it stores, in bytes.

This is the bottom of kvcalib beside :mod:`kvcalib.quant`: the methods (:mod:`kvcalib.methods`),
the recipe format, the runtime and the offline phases all read it, and it reads nothing of theirs.

- :class:`LayerConfig`: user configuration of one layer (bits, group sizes, key axis, sinks,
  full-precision window); fitted tensors live in the recipe, apart.
- :func:`quantized_token_count`: tokens in packed storage after ``t`` tokens (the runtime's flush
  policy, which the decode-faithful simulation reproduces).
- :func:`layer_bytes`: bytes one sequence's K and V of one layer hold, by component, with the
  packed blocks at the bits of the stored tier their age puts them in (one tier without a
  position-adaptive schedule).
- :func:`held_tokens` / :func:`held_elements`: the tokens a layer must hold at context T (a
  sliding-window layer only its window) and the K/V elements a bf16 cache of the model holds.
- :class:`MemoryBreakdown`: the whole cache at context T, its effective bits per element and its
  compression against the model's own bf16 cache.

Memory accounting (:data:`ACCOUNTING`): effective bits = 8 x bytes held / (2 x kv_heads x
head_dim x sum over layers of the tokens the layer holds), so bf16 is 16.0 on every model and a
number of bits means the same compression everywhere (16 / bits). The first accounting
(:data:`LEGACY_ACCOUNTING`) divided by 2 x layers x kv_heads x head_dim x T, counting tokens a
sliding-window layer never holds: bf16 read 4.33 on gemma3-270m at 4096 (issue 38). On a model
without sliding layers, or at a context within every window, the two are the same number.
"""

from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass, fields
from typing import Any, Sequence

from kvcalib.errors import RecipeError

VALID_BITS = (2, 3, 4, 8, 16)  # 16 = kept in full precision (not quantized)
KEY_AXES = ("channel", "token")  # keys per channel over token groups (KIVI) or per token
FP_BITS = 16  # full-precision segments are accounted at 16 bits, as stored on GPU (bf16/fp16)
SCALE_BYTES = 2  # scales and zero-points are float16

# How a number of effective bits was accounted (recorded in recipes, search.json and result files).
ACCOUNTING = "held-tokens"  # denominator: the tokens each layer holds (sliding layers their window)
LEGACY_ACCOUNTING = "all-layers-at-context"  # the first one: every layer counted at T (before issue 38)
ACCOUNTINGS = (ACCOUNTING, LEGACY_ACCOUNTING)

# A stored tier: (first age in tokens, k_bits, v_bits). Packed blocks move to later tiers as
# they age (PATS); without a schedule a layer has the one tier (window, k_bits, v_bits).
StoredTier = tuple[int, int, int]


@dataclass(frozen=True)
class LayerConfig:
    """How one layer's cache is compressed (user configuration; fitted tensors live apart).

    - ``k_bits``/``v_bits``: 2, 3, 4, 8, or 16 (no quantization).
    - ``k_axis``: ``channel`` = keys quantized per channel over groups of ``k_group`` consecutive
      tokens (KIVI); ``token`` = per token over groups of ``k_group`` channels.
    - ``v_group``: values are quantized per token over groups of ``v_group`` channels.
    - ``sinks``: the first S tokens stay in full precision forever (attention sinks).
    - ``window``: the most recent R tokens stay in full precision; older tokens are flushed to
      packed storage in blocks of ``flush_block`` tokens once R + block tokens are pending.
    """

    k_bits: int = 16
    v_bits: int = 16
    k_axis: str = "channel"
    k_group: int = 32
    v_group: int = 32
    sinks: int = 0
    window: int = 0

    def __post_init__(self) -> None:
        for name in ("k_bits", "v_bits"):
            val = getattr(self, name)  # an int: 2.0 == 2 would pass `in` and break the packing later
            if not isinstance(val, int) or isinstance(val, bool) or val not in VALID_BITS:
                raise ValueError(f"{name} must be one of {VALID_BITS}, got {getattr(self, name)!r}")
        if self.k_axis not in KEY_AXES:
            raise ValueError(f"k_axis must be one of {KEY_AXES}, got {self.k_axis!r}")
        for name in ("k_group", "v_group"):
            val = getattr(self, name)
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"{name} must be a positive integer, got {val!r}")
        for name in ("sinks", "window"):
            val = getattr(self, name)
            if not isinstance(val, int) or isinstance(val, bool) or val < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {val!r}")
        if self.compressed and self.window and self.window < self.flush_block:
            raise ValueError(
                f"window ({self.window}) is shorter than a group ({self.flush_block} tokens): "
                f"use window 0 or at least {self.flush_block}"
            )

    @property
    def compressed(self) -> bool:
        return self.k_bits < 16 or self.v_bits < 16

    @property
    def flush_block(self) -> int:
        """Tokens moved from the window to packed storage at once."""
        if self.k_bits < 16 and self.k_axis == "channel":
            return self.k_group
        return 1

    def bits(self, side: str) -> int:
        """``k_bits`` or ``v_bits``."""
        return self.k_bits if side == "k" else self.v_bits

    def group(self, side: str) -> int:
        """``k_group`` or ``v_group``."""
        return self.k_group if side == "k" else self.v_group

    def per_channel(self, side: str) -> bool:
        """Whether ``side`` is quantized per channel over groups of tokens (keys, KIVI layout)."""
        return side == "k" and self.k_axis == "channel"

    def check_head_dim(self, head_dim: int) -> None:
        """Group sizes along channels must divide head_dim; packing needs whole bytes."""
        if self.v_bits < 16 and head_dim % self.v_group:
            raise ValueError(f"v_group {self.v_group} does not divide head_dim {head_dim}")
        if self.k_bits < 16 and self.k_axis == "token" and head_dim % self.k_group:
            raise ValueError(f"k_group {self.k_group} does not divide head_dim {head_dim}")
        for side in ("k", "v"):
            # 2/4/8-bit codes pack whole bytes of any head_dim the groups accept; 3-bit codes
            # need runs of 8 channels (their high-bit plane holds 8 codes a byte)
            if self.bits(side) == 3 and head_dim % 8:
                raise ValueError(f"{side}_bits 3 packs runs of 8 channels: head_dim {head_dim} is not a multiple "
                                 "of 8; use 2 or 4 bits on this model")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "layer") -> "LayerConfig":
        if not isinstance(data, dict):
            raise RecipeError(f"recipe field {where} must be an object, got {type(data).__name__}")
        allowed = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise RecipeError(f"recipe field {where} has unknown keys {unknown}; allowed: {sorted(allowed)}")
        try:
            return cls(**data)
        except (ValueError, TypeError) as err:
            raise RecipeError(f"recipe field {where}: {err}") from None


def held_tokens(context: int, sliding: int | None) -> int:
    """Tokens a layer must hold after ``context`` tokens: all of them, or a sliding-window
    layer's last ``sliding``."""
    return context if sliding is None else min(context, sliding)


def held_elements(heads: int, head_dim: int, context: int, windows: Sequence[int | None]) -> int:
    """K and V elements one sequence's bf16 cache holds at ``context``: 2 x heads x head_dim x
    the sum over layers (``windows``: each layer's sliding window or None) of :func:`held_tokens`.
    The denominator of effective bits (:data:`ACCOUNTING`)."""
    return 2 * heads * head_dim * sum(held_tokens(context, w) for w in windows)


def legacy_bits_factor(context: int, windows: Sequence[int | None]) -> float:
    """Multiply a number of effective bits of :data:`LEGACY_ACCOUNTING` by this to get the same
    bytes in :data:`ACCOUNTING` (the bytes are the same; only the denominator changed):
    layers x T / sum of held tokens. Exactly 1.0 when every layer holds all ``context`` tokens."""
    held = sum(held_tokens(context, w) for w in windows)
    return 1.0 if held == len(windows) * context else len(windows) * context / held


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes one sequence's cache holds at context T, by component (all layers, K and V)."""

    context: int
    elements: int  # K/V elements the model's bf16 cache holds at T: :func:`held_elements`
    components: dict[str, float]

    @property
    def total_bytes(self) -> float:
        return float(sum(self.components.values()))

    @property
    def effective_bits(self) -> float:
        """8 x bytes / elements held (:data:`ACCOUNTING`); bf16 is 16.0 on every model."""
        return 8.0 * self.total_bytes / self.elements

    @property
    def bf16_bytes(self) -> float:
        """Bytes of the model's own bf16 cache at the same context (sliding layers their window)."""
        return float(self.elements * FP_BITS // 8)

    @property
    def compression_ratio(self) -> float:
        """How many times smaller than the model's bf16 cache (16 / effective bits)."""
        return self.bf16_bytes / self.total_bytes


def quantized_token_count(cfg: LayerConfig, t: int) -> int:
    """Tokens in packed storage after ``t`` tokens have been cached (flush policy of the runtime)."""
    if not cfg.compressed:
        return 0
    pending = t - min(t, cfg.sinks)
    block = cfg.flush_block
    n_blocks = max(0, (pending - cfg.window) // block)
    return n_blocks * block


def stored_token_counts(cfg: LayerConfig, kept: int, tiers: Sequence[StoredTier] | None = None) -> list[int]:
    """Packed tokens in each stored tier after ``kept`` tokens (youngest tier first).

    A flushed block of ``flush_block`` consecutive tokens sits in the last tier whose first age
    is at most the age of the block's youngest token (a block moves as a whole, once all its
    tokens are old enough). ``tiers`` defaults to the config's one tier.
    """
    tiers = list(tiers) if tiers else [(cfg.window, cfg.k_bits, cfg.v_bits)]
    counts = [0] * len(tiers)
    nq = quantized_token_count(cfg, kept)
    if not nq:
        return counts
    block = cfg.flush_block
    pending = kept - min(kept, cfg.sinks)
    ages = [age for age, _, _ in tiers]
    for i in range(nq // block):
        youngest_age = pending - (i + 1) * block
        counts[max(0, bisect.bisect_right(ages, youngest_age) - 1)] += block
    return counts


def layer_bytes(cfg: LayerConfig, heads: int, head_dim: int, t: int, sliding: int | None = None,
                tiers: Sequence[StoredTier] | None = None) -> dict[str, float]:
    """Bytes of one layer's K and V for one sequence at context ``t``, by component.

    ``sliding``: the layer's sliding window (it keeps only its last ``sliding`` tokens);
    ``tiers``: the stored tiers (PATS), each packed block counted at its tier's bits. Components:
    ``full_precision`` (sinks, window, pending tokens and any side at 16 bits), ``k_codes`` /
    ``v_codes``, ``k_scales`` / ``v_scales`` (a float16 scale and zero per group: keys per channel
    hold one pair per channel per ``k_group`` tokens; per-token layouts one pair per group of
    channels per token).
    """
    kept = held_tokens(t, sliding)
    fp_bytes = FP_BITS // 8
    hd = heads * head_dim
    tiers = list(tiers) if tiers else [(cfg.window, cfg.k_bits, cfg.v_bits)]
    counts = stored_token_counts(cfg, kept, tiers)
    out = {"full_precision": float(2 * (kept - sum(counts)) * hd * fp_bytes)}
    for (_, k_bits, v_bits), n in zip(tiers, counts):
        if not n:
            continue
        for side, bits in (("k", k_bits), ("v", v_bits)):
            if bits >= 16:
                out["full_precision"] += n * hd * fp_bytes
                continue
            out[f"{side}_codes"] = out.get(f"{side}_codes", 0.0) + n * hd * bits / 8
            pairs = scale_pairs(cfg, side, n, heads, head_dim)
            out[f"{side}_scales"] = out.get(f"{side}_scales", 0.0) + pairs * 2 * SCALE_BYTES
    return out


def scale_pairs(cfg: LayerConfig, side: str, tokens: int, heads: int, head_dim: int) -> int:
    """The (scale, zero) pairs ``side`` stores for ``tokens`` packed tokens of one sequence: keys per
    channel one per channel per ``k_group`` tokens, per-token layouts one per group of channels per
    token."""
    if cfg.per_channel(side):
        return (tokens // cfg.k_group) * heads * head_dim
    return tokens * heads * (head_dim // cfg.group(side))
