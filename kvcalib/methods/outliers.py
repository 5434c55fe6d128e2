"""OTT, Outlier Tokens Tracing: keep the few smallest-|K| tokens of each flush in full precision.

Observation (OTT): in the outlier channels of keys, a few tokens have abnormally *small* values;
they stretch the per-channel range of their group and cost every other token resolution.
Those tokens also have the smallest key norm overall, so the norm identifies them.

The rule, run at every flush of a group of G tokens, per (batch row, kv head) independently:

1. candidates = the outlier pool (at most ``pool_size`` full-precision tokens) + the G tokens
   being flushed;
2. key magnitude = L2 norm of the key over the D channels (float32);
3. the ``pool_size`` candidates with the **smallest** magnitude form the new pool (stable sort,
   old pool tokens first, so ties keep the current pool members);
4. flushed tokens not chosen are quantized; flushed tokens chosen are *not* quantized: their
   slots are excluded from the group's range (``quant_mask`` False) -- OTT replaces their K and V
   with the mean of the group; :attr:`OutlierSelection.k_fill` / ``v_fill`` do that, with the
   mean taken over the group's *quantized* tokens (and clamped into their range), so the group's
   per-channel key range is exactly the range of its quantized tokens;
5. old pool tokens not chosen ("evicted") move to an **extra pool** of full-precision tokens,
   capacity ``extra_capacity`` (32, OTT). Their own group was quantized without them long ago,
   so they can never be quantized again;
6. tracking stops for a (batch row, kv head) when its extra pool is full, or when a flush would
   evict more tokens than the extra pool has room for (that flush is then quantized whole and
   the pools keep what they hold). After that, every later group is quantized whole.

Models that normalize each head's keys (``k_norm``: Gemma 3, Qwen 3, OLMo 2) give every key the
same norm (RoPE keeps it), so step 3 is a tie that float rounding decides: :func:`outlier_gain`
measures ~0 there and the fit leaves the pool off. A pool forced onto such a layer still decodes
correctly, but which tokens it holds depends on the last bits of the keys (on CUDA a padded
batch's row and its prompt alone picked different tokens: tests/kernels/test_graph_padding.py).

Consequence used by the decode-faithful simulation: a token chosen at its own flush stays in
full precision forever (pool, then extra pool); a token not chosen is quantized forever. So the
set of full-precision tokens is a per-token property, computed by :func:`trace_outliers`.

Layers: OTT finds no outlier tokens in the first 1-2 layers and sets the pool to 0 there
(:func:`default_pool_sizes`); :class:`OutlierMethod` decides per layer from the reservoir.

Runtime contract (per layer; ``kv.outlier_pool`` = ``pool_size``, int64 scalar, 0 = off):

- hold an :class:`OutlierState` per layer: pool K/V ``(B, H, P, D)`` and extra pool K/V
  ``(B, H, E, D)`` in full precision with their absolute positions (int32, -1 = empty slot);
- at each flush of a group (after the group's attention has run): ``sel = select_outliers(k_g,
  v_g, state, group_start, valid=padding)``; padding tokens never enter the pool; quantize the
  group with ``valid=sel.quant_mask`` (or quantize
  ``sel.k_fill``/``sel.v_fill``: same key scales/zeros); store ``sel.quant_mask`` with the block
  (1 bit per token per kv head) and keep ``sel.state``;
- attention: the packed block's slots with ``quant_mask`` False are masked out (score -inf);
  pool and extra-pool tokens with position >= 0 are attended in full precision, merged with the
  other full-precision segments. Every token is then seen exactly once;
- memory: ``pool_bytes(...)``: the pools' allocated K/V slots in full precision, their int32
  positions, the per-(row, head) counters (``extra_count`` int64, ``tracking`` bool), and the
  1-bit-per-token masks.

The runtime that does this is :mod:`kvcalib.runtime.outlier_pool` (state and masks) with
:mod:`kvcalib.runtime.cache` (flush, attention segments); :mod:`kvcalib.simulate` reproduces it
with :func:`trace_outliers`. Neither imports this file: they reach the rule through the layer's
:class:`PoolState` (the codec's ``pool``: :meth:`PoolState.select`, :meth:`PoolState.trace`), and
the pools' storage (:class:`OutlierState`) lives in :mod:`kvcalib.quant.pools`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvcalib.errors import KvcalibError
from kvcalib.layout import LayerConfig
from kvcalib.methods.base import (
    CalibrationError,
    FitContext,
    Flag,
    LayerGeometry,
    Method,
    MethodState,
    TensorSpec,
    reservoir_to_bhtd,
    scalar_value,
    validate_reservoir,
)
# the pools' storage (what the cache keeps and a snapshot saves) is shared with the runtime: one layer down
from kvcalib.quant.pools import DEFAULT_POOL, EXTRA_CAPACITY, MAX_OUTLIER_POOL, POS_DTYPE, OutlierState
from kvcalib.quant.uniform import quantize_dequantize_keys
from kvcalib.stats import LayerStats

__all__ = [
    "DEFAULT_POOL",
    "EXTRA_CAPACITY",
    "OutlierState",
    "OutlierSelection",
    "select_outliers",
    "trace_outliers",
    "default_pool_sizes",
    "pool_bytes",
    "outlier_gain",
    "PoolState",
    "OutlierMethod",
]

@dataclass
class OutlierSelection:
    """What one flush decided (shapes for a group of G tokens).

    Attributes:
        quant_mask: bool ``(B, H, G)``: True = the token is quantized in this group; False = it
            entered the pool (full precision); its packed slot must be masked out of attention.
        k_fill, v_fill: ``(B, H, G, D)``: the group with the pool entrants replaced by the mean
            of the quantized tokens (clamped into their per-channel range): OTT's input to a
            quantizer without masks.
        evicted: bool ``(B, H, P)``: old pool slots moved to the extra pool at this flush.
        stopped: bool ``(B, H)``: tracking stopped at this flush (the group was quantized whole).
        state: the pools after this flush.
    """

    quant_mask: torch.Tensor
    k_fill: torch.Tensor
    v_fill: torch.Tensor
    evicted: torch.Tensor
    stopped: torch.Tensor
    state: OutlierState


def _check_group_kv(k_group: torch.Tensor, v_group: torch.Tensor) -> tuple[int, int, int, int]:
    if not isinstance(k_group, torch.Tensor) or k_group.dim() != 4 or not k_group.is_floating_point():
        raise CalibrationError(f"k_group must be a float tensor (B, H, G, D), got {tuple(getattr(k_group, 'shape', ()))}")
    if not isinstance(v_group, torch.Tensor) or v_group.shape[:3] != k_group.shape[:3] or v_group.dim() != 4:
        raise CalibrationError(
            f"v_group {tuple(getattr(v_group, 'shape', ()))} does not fit k_group {tuple(k_group.shape)}"
        )
    if not bool(torch.isfinite(k_group).all()):
        raise CalibrationError("k_group holds NaN or inf: outlier selection needs finite keys")
    return tuple(k_group.shape)  # type: ignore[return-value]


def _fill_with_mean(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Replace tokens where ``keep`` is False by the mean of kept tokens, clamped into their range.

    x ``(B, H, G, D)``, keep bool ``(B, H, G)``; rows with nothing kept are filled with 0.
    """
    m = keep[..., None]  # (B, H, G, 1)
    xf = x.float()
    n = m.sum(2, keepdim=True).clamp_min(1)  # (B, H, 1, 1)
    mean = (xf * m).sum(2, keepdim=True) / n  # (B, H, 1, D)
    inf = torch.tensor(float("inf"))
    lo = torch.where(m, xf, inf).amin(2, keepdim=True)  # (B, H, 1, D)
    hi = torch.where(m, xf, -inf).amax(2, keepdim=True)
    # float rounding of sum/n can leave the mean an ulp outside [lo, hi]: clamp so the group's
    # range is exactly the kept tokens' range
    fill = torch.where(m.any(2, keepdim=True), torch.minimum(torch.maximum(mean, lo), hi), torch.zeros_like(mean))
    return torch.where(m, xf, fill).to(x.dtype)


def select_outliers(
    k_group: torch.Tensor,
    v_group: torch.Tensor,
    state: OutlierState | None,
    group_start: int,
    pool_size: int = DEFAULT_POOL,
    extra_capacity: int = EXTRA_CAPACITY,
    valid: torch.Tensor | None = None,
) -> OutlierSelection:
    """One OTT flush (module docstring, steps 1-6).

    Args:
        k_group, v_group: ``(B, H, G, D)``, the G consecutive tokens being flushed, per kv head.
        state: the pools before this flush; None = empty pools of ``pool_size`` /
            ``extra_capacity`` (then those two arguments are used; otherwise the state's sizes are).
        group_start: absolute position of the group's first token.
        valid: optional bool ``(B, G)``: False = padding, never a candidate (it stays in the
            group with ``quant_mask`` True; the cache's padding mask keeps it out of the ranges).

    Returns: :class:`OutlierSelection` (never modifies ``state`` in place).
    """
    b, h, g, d = _check_group_kv(k_group, v_group)
    if state is None:
        state = OutlierState.empty(b, h, d, pool_size, extra_capacity, k_group.dtype, k_group.device)
    if tuple(state.pool_k.shape[:2]) != (b, h) or state.pool_k.shape[3] != d:
        raise CalibrationError(
            f"outlier state of shape {tuple(state.pool_k.shape)} does not fit a group {tuple(k_group.shape)}"
        )
    p, e = state.pool_size, state.extra_capacity
    dev = k_group.device
    if p == 0:
        ones = torch.ones(b, h, g, dtype=torch.bool, device=dev)
        return OutlierSelection(ones, k_group, v_group, torch.zeros(b, h, 0, dtype=torch.bool, device=dev),
                                torch.zeros(b, h, dtype=torch.bool, device=dev), state)

    group_pos = group_start + torch.arange(g, device=dev, dtype=POS_DTYPE).expand(b, h, g)  # (B, H, G)
    cand_k = torch.cat([state.pool_k.to(k_group.dtype), k_group], dim=2)  # (B, H, P+G, D)
    cand_v = torch.cat([state.pool_v.to(v_group.dtype), v_group], dim=2)  # (B, H, P+G, D)
    cand_pos = torch.cat([state.pool_pos.to(POS_DTYPE), group_pos], dim=2)  # (B, H, P+G)
    real = cand_pos >= 0  # (B, H, P+G)
    if valid is not None:
        if valid.dtype != torch.bool or tuple(valid.shape) != (b, g):
            raise CalibrationError(f"valid must be bool (B, G) = {(b, g)}, got {valid.dtype} {tuple(valid.shape)}")
        real = real & torch.cat([real.new_ones(b, h, p), valid.to(dev)[:, None, :].expand(b, h, g)], dim=2)
    norm = cand_k.float().norm(dim=-1).masked_fill(~real, float("inf"))  # (B, H, P+G)
    keep = torch.sort(norm, dim=-1, stable=True).indices[..., :p]  # (B, H, P) candidate indices
    chosen = torch.zeros_like(real).scatter(-1, keep, True) & real  # (B, H, P+G)

    evicted = real[..., :p] & ~chosen[..., :p]  # (B, H, P)
    room = e - state.extra_count  # (B, H)
    ok = state.tracking & (evicted.sum(-1) <= room)  # (B, H): this flush selects
    stopped = state.tracking & ~ok
    evicted = evicted & ok[..., None]
    entered = chosen[..., p:] & ok[..., None]  # (B, H, G)
    quant_mask = ~entered

    # new pool: the chosen candidates (empty slots stay -1) where this flush selected, else as before
    kidx = keep[..., None].expand(b, h, p, d)  # (B, H, P, D)
    new_pos = torch.where(torch.gather(chosen, -1, keep), torch.gather(cand_pos, -1, keep), -1)  # (B, H, P)
    okp = ok[..., None]  # (B, H, 1)
    pool_pos = torch.where(okp, new_pos, state.pool_pos.to(POS_DTYPE))
    pool_k = torch.where(okp[..., None], torch.gather(cand_k, 2, kidx), state.pool_k.to(k_group.dtype))
    pool_v = torch.where(okp[..., None], torch.gather(cand_v, 2, kidx), state.pool_v.to(v_group.dtype))

    # extra pool: evicted slots are appended at extra_count, extra_count + 1, ...; the other slots
    # are scattered into a dump slot E that is cut off afterwards
    slot = state.extra_count[..., None] + evicted.long().cumsum(-1) - 1  # (B, H, P)
    slot = torch.where(evicted, slot, torch.full_like(slot, e))
    sidx = slot[..., None].expand(b, h, p, d)
    extra_k = torch.cat([state.extra_k.to(k_group.dtype), state.extra_k.new_zeros(b, h, 1, d).to(k_group.dtype)], 2)
    extra_v = torch.cat([state.extra_v.to(v_group.dtype), state.extra_v.new_zeros(b, h, 1, d).to(v_group.dtype)], 2)
    extra_pos = torch.cat([state.extra_pos.to(POS_DTYPE), cand_pos.new_full((b, h, 1), -1)], 2)
    extra_k = extra_k.scatter(2, sidx, state.pool_k.to(k_group.dtype))[:, :, :e]
    extra_v = extra_v.scatter(2, sidx, state.pool_v.to(v_group.dtype))[:, :, :e]
    extra_pos = extra_pos.scatter(2, slot, state.pool_pos.to(POS_DTYPE))[:, :, :e]
    extra_count = state.extra_count + evicted.sum(-1)
    tracking = state.tracking & ok & (extra_count < e)

    new_state = OutlierState(pool_k, pool_v, pool_pos, extra_k, extra_v, extra_pos, extra_count, tracking)
    return OutlierSelection(
        quant_mask=quant_mask,
        k_fill=_fill_with_mean(k_group, quant_mask),
        v_fill=_fill_with_mean(v_group, quant_mask),
        evicted=evicted,
        stopped=stopped,
        state=new_state,
    )


def trace_outliers(
    k: torch.Tensor,
    group: int,
    pool_size: int = DEFAULT_POOL,
    extra_capacity: int = EXTRA_CAPACITY,
    start: int = 0,
    v: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, OutlierState]:
    """Run the flushes of ``k (B, H, T, D)`` group by group; which tokens stay in full precision.

    Args:
        k: keys of the tokens that get flushed, consecutive from absolute position ``start``
            (sinks excluded); only the first ``(T // group) * group`` tokens are flushed.
        group: flush size G.
        v: values (only carried into the pools); defaults to ``k``.
        valid: optional bool ``(B, T)``, False = padding (never selected).

    Returns:
        ``fp_mask`` bool ``(B, H, T)`` (True = kept in full precision by the tracing; tokens of an
        incomplete last group are False: they are still in the window, not flushed) and the
        final :class:`OutlierState`.
    """
    if not isinstance(k, torch.Tensor) or k.dim() != 4:
        raise CalibrationError(f"k must be (B, H, T, D), got {tuple(getattr(k, 'shape', ()))}")
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise CalibrationError(f"group must be a positive int, got {group!r}")
    v = k if v is None else v
    b, h, t, d = k.shape
    state = OutlierState.empty(b, h, d, pool_size, extra_capacity, k.dtype, k.device)
    fp = torch.zeros(b, h, t, dtype=torch.bool, device=k.device)
    for s in range(0, (t // group) * group, group):
        sel = select_outliers(k[:, :, s : s + group], v[:, :, s : s + group], state, start + s,
                              valid=None if valid is None else valid[:, s : s + group])
        fp[:, :, s : s + group] = ~sel.quant_mask
        state = sel.state
    return fp, state


def default_pool_sizes(num_layers: int, pool: int = DEFAULT_POOL, skip_first: int = 2) -> list[int]:
    """OTT's static rule: ``pool`` outlier slots per layer, 0 in the first ``skip_first`` layers."""
    for name, val in (("num_layers", num_layers), ("pool", pool), ("skip_first", skip_first)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 0:
            raise CalibrationError(f"{name} must be a non-negative int, got {val!r}")
    return [0 if i < skip_first else pool for i in range(num_layers)]


def pool_bytes(heads: int, head_dim: int, pool_size: int, extra_capacity: int = EXTRA_CAPACITY,
               tokens_flushed: int = 0, fp_bytes: int = 2, pos_bytes: int = 4) -> dict[str, float]:
    """Bytes one sequence's outlier pools of one layer hold (allocated capacity, K and V).

    ``fp_k_v``: ``(P + E)`` slots x ``H`` x ``D`` x 2 (K and V) x ``fp_bytes``; ``positions``:
    ``(P + E) x H x pos_bytes`` (int32); ``counters``: ``extra_count`` (int64) and ``tracking``
    (bool) per kv head; ``masks``: 1 bit per flushed token per kv head. Zero for
    ``pool_size == 0`` (no pools are allocated).
    """
    if pool_size == 0:
        return {"fp_k_v": 0.0, "positions": 0.0, "counters": 0.0, "masks": 0.0}
    slots = pool_size + extra_capacity
    return {
        "fp_k_v": float(slots * heads * head_dim * 2 * fp_bytes),
        "positions": float(slots * heads * pos_bytes),
        "counters": float(heads * (8 + 1)),
        "masks": tokens_flushed * heads / 8.0,
    }


def outlier_gain(reservoir_k: torch.Tensor, bits: int, group: int, pool_size: int = DEFAULT_POOL,
                 extra_capacity: int = EXTRA_CAPACITY) -> float:
    """Relative reduction of the key error *per quantized token* from tracing ``pool_size`` outliers.

    On each reservoir block (a fresh sequence: pools start empty), keys per channel over groups
    of ``group`` tokens: ``1 - (err_traced / n_quantized_traced) / (err_plain / n_plain)``, errors
    summed over the quantized tokens only. Per quantized token, so that merely keeping tokens in
    full precision does not count as a gain: without outlier structure the smallest-norm tokens
    sit inside the group's range and the gain is ~0. Returns 0.0 when the plain error is 0.
    """
    nb, bl, h, d = validate_reservoir(reservoir_k, "reservoir_k")
    t = (bl // group) * group
    if t == 0:
        raise CalibrationError(f"reservoir blocks of {bl} tokens are shorter than one group ({group})")
    k = reservoir_to_bhtd(reservoir_k)[:, :, :t]  # (NB, H, T, D)
    plain = float(((quantize_dequantize_keys(k, bits, group) - k) ** 2).sum(dtype=torch.float64))
    if plain <= 0.0 or pool_size == 0:
        return 0.0
    fp, _ = trace_outliers(k, group, pool_size, extra_capacity)  # (NB, H, T)
    q = ~fp  # (NB, H, T)
    kh = quantize_dequantize_keys(k, bits, group, valid=q)  # (NB, H, T, D)
    traced = float((((kh - k) ** 2) * q[..., None]).sum(dtype=torch.float64))
    nq = int(q.sum())
    if nq == 0:
        return 0.0
    return 1.0 - (traced / nq) / (plain / (nb * h * t))


class PoolState(MethodState):
    """An OTT pool of ``pool_size`` tokens per kv head: the cache keeps the pools
    (:mod:`kvcalib.runtime.outlier_pool`), the simulation traces them (runtime contract above)."""

    extra_capacity: int = EXTRA_CAPACITY

    def __init__(self, pool_size: int) -> None:
        self.pool_size = int(pool_size)

    def select(self, k_group: torch.Tensor, v_group: torch.Tensor, state: OutlierState, start: int,
               valid: torch.Tensor | None = None) -> OutlierSelection:
        """One flush of the cache's pools: :func:`select_outliers`."""
        return select_outliers(k_group, v_group, state, start, valid=valid)

    def trace(self, k: torch.Tensor, group: int, start: int = 0, v: torch.Tensor | None = None,
              valid: torch.Tensor | None = None) -> tuple[torch.Tensor, OutlierState]:
        """The flushes of ``k`` (B, H, T, D) with this layer's pools: :func:`trace_outliers`."""
        return trace_outliers(k, group, self.pool_size, self.extra_capacity, start, v, valid)

    def bytes(self, cfg: LayerConfig, heads: int, head_dim: int, kept: int, packed: int) -> dict[str, float]:
        if not packed:  # the cache allocates the pools at the first flush
            return {}
        blocks = packed // cfg.flush_block
        mask_tokens = blocks * ((cfg.flush_block + 7) // 8) * 8  # whole bytes per block
        ott = pool_bytes(heads, head_dim, self.pool_size, EXTRA_CAPACITY, mask_tokens, 2)
        return {"outlier_pool": ott["fp_k_v"], "outlier_positions": ott["positions"] + ott["counters"],
                "outlier_masks": ott["masks"]}


def _check_pool_size(size: Any, cfg: LayerConfig, what: str) -> int:
    if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_OUTLIER_POOL:
        raise ValueError(f"{what} is {size!r}; the outlier pool size must be >= 0 and <= "
                         f"{MAX_OUTLIER_POOL} (0 = off, OTT uses {DEFAULT_POOL})")
    if size and not cfg.compressed:
        raise ValueError(f"{what} is {size} but the layer keeps K and V at 16 bits (nothing is flushed): "
                         "set it to 0 or drop it")
    return size


class OutlierMethod(Method):
    """Decide the OTT pool size per layer: ``pool`` when tracing reduces the per-token key error
    by at least ``min_gain`` on the reservoir, else 0 (OTT's "none in the first layers", found
    from data rather than by layer index; :func:`default_pool_sizes` is the static rule).

    Applies only to keys quantized per channel (``k_bits < 16``, ``k_axis="channel"``): the
    outliers OTT removes stretch per-channel ranges over token groups. Other compressed layers
    get an explicit pool of 0; layers kept in full precision get nothing.
    """

    name: ClassVar[str] = "outliers"
    summary: ClassVar[str] = "OTT outlier-token pool: the few smallest-norm keys of each flush in full precision"
    order: ClassVar[int] = 40
    tensors: ClassVar[tuple[TensorSpec, ...]] = (
        TensorSpec("outlier_pool", ("kv",), "int64", "()", "outlier pool size P for this layer (0 = off); extra pool 32"),
        TensorSpec("outlier_gain", ("kv",), "float32", "()",
                   "relative per-token key error reduction from tracing P outliers", applied=False),
    )
    search: ClassVar[str | None] = "layer"
    letter: ClassVar[str] = "o"
    flags: ClassVar[tuple[Flag, ...]] = (Flag(
        "outliers", int, "OTT outlier-token pool size (3 = OTT's default): N tokens per layer and kv head in full "
        "precision, on layers where tracing them cuts the key error by >= 5% (0 = off).", tag="ott{}"),)

    def __init__(self, pool: int = DEFAULT_POOL, min_gain: float = 0.05,
                 extra_capacity: int = EXTRA_CAPACITY) -> None:
        if isinstance(pool, bool) or not isinstance(pool, int) or pool < 0:
            raise ValueError(f"pool must be a non-negative int, got {pool!r}")
        if not 0.0 <= float(min_gain) < 1.0:
            raise ValueError(f"min_gain must lie in [0, 1), got {min_gain!r}")
        if isinstance(extra_capacity, bool) or not isinstance(extra_capacity, int) or extra_capacity < 0:
            raise ValueError(f"extra_capacity must be a non-negative int, got {extra_capacity!r}")
        self.pool, self.min_gain, self.extra_capacity = pool, float(min_gain), extra_capacity

    def _fit(self, layer_stats: LayerStats, layer_cfg: LayerConfig, seed: int,
             context: FitContext, geom: LayerGeometry) -> dict[str, torch.Tensor]:
        if not layer_cfg.compressed:
            return {}
        if layer_cfg.k_bits >= 16 or layer_cfg.k_axis != "channel":  # OTT does not apply: say so
            return {"kv.outlier_pool": torch.tensor(0, dtype=torch.int64),
                    "kv.outlier_gain": torch.tensor(0.0, dtype=torch.float32)}
        gain = outlier_gain(layer_stats.reservoir_k, layer_cfg.k_bits, layer_cfg.k_group, self.pool,
                            self.extra_capacity)
        size = self.pool if gain >= self.min_gain else 0
        return {"kv.outlier_pool": torch.tensor(size, dtype=torch.int64),
                "kv.outlier_gain": torch.tensor(gain, dtype=torch.float32)}

    @classmethod
    def load(cls, tensors: dict[str, torch.Tensor], cfg: LayerConfig, heads: int | None,
             head_dim: int | None) -> PoolState | None:
        gain = tensors.get("kv.outlier_gain")
        if gain is not None:  # informs the search and inspect only, but must say something
            scalar_value(gain, "kv.outlier_gain", "the relative key error reduction")
        t = tensors.get("kv.outlier_pool")
        if t is None:
            return None
        if t.numel() != 1 or t.is_floating_point() or t.dtype == torch.bool or t.is_complex():
            raise ValueError(f"kv.outlier_pool must be an integer scalar (the OTT pool size), got {t.dtype} of "
                             f"shape {tuple(t.shape)}")
        size = _check_pool_size(int(t.reshape(-1)[0]), cfg, "kv.outlier_pool")
        return PoolState(size) if size else None

    @classmethod
    def from_arguments(cls, cfg: LayerConfig, arguments: dict[str, Any]) -> PoolState | None:
        size = arguments.pop("outlier_pool", 0)
        try:
            size = _check_pool_size(size, cfg, "outlier_pool")
        except ValueError as err:
            raise KvcalibError(str(err)) from None
        return PoolState(size) if size else None

    @classmethod
    def from_flags(cls, values: dict[str, Any], layer: LayerConfig) -> "OutlierMethod | None":
        pool = values.get("outliers")
        if pool is None:
            return None
        if isinstance(pool, bool) or not isinstance(pool, int) or pool < 0:
            raise KvcalibError(f"--outliers {pool!r} is not a pool size: pass an integer >= 0 "
                               "(3 is OTT's default, 0 turns it off).")
        return cls(pool=pool) if pool else None
