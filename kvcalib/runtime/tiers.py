"""PATS in the cache: one layer's packed tokens in one store per stored tier.

This is the runtime side of :mod:`kvcalib.methods.schedule` (read its "Runtime contract").
A layer's codec lists its stored tiers, youngest first (``codec.tiers``: ``(first age, k_bits,
v_bits)``; one entry without a schedule). :class:`PackedTiers` keeps one
:class:`~kvcalib.runtime.store.PackedStore` per stored tier:

- a flushed block enters the youngest store (the config's bits);
- after every step at context T (:meth:`PackedTiers.advance`, called right after the flush), the
  block ``[s, e)`` must be in the store of ``block_tier(e, T)``, i.e. the last tier whose age
  ``<= T - e``. Tiers only grow with age, so each store holds a contiguous run of positions and
  older stores hold older runs: moving is "take the leading blocks of a store, requantize them
  through every tier they pass (``LayerCodec.requantize`` wherever a side's bits drop -- the
  chain the simulation reproduces), append them to the target store". A block that jumps several
  tiers at once (after a long prompt) goes through all of them;
- sinks and the full-precision window are untouched (they live outside the stores).

Iteration order for attention is by position (oldest store first), so a layer with one store
behaves exactly as before tiers existed.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from kvcalib.layout import LayerConfig
from kvcalib.codec import LayerCodec, PackedBlock
from kvcalib.runtime.store import PackedStore, PackedView
from kvcalib.errors import KvcalibError


class PackedTiers:
    """All flushed tokens of one layer, in one :class:`PackedStore` per stored tier."""

    def __init__(self, cfg: LayerConfig, codec: LayerCodec) -> None:
        self.cfg = cfg
        self.codec = codec
        self.ages = [age for age, _, _ in codec.tiers]  # first age of each stored tier, increasing
        self.stores = [PackedStore(cfg, kb, vb) for _, kb, vb in codec.tiers]  # youngest first

    # ------------------------------------------------------------------ bookkeeping
    @property
    def n(self) -> int:
        """Live packed tokens over all tiers."""
        return sum(s.n for s in self.stores)

    @property
    def start(self) -> int:
        """Absolute position of the oldest live packed token (0 when empty)."""
        live = [s for s in self.stores if s.n]
        return live[-1].start if live else 0

    def append(self, start: int, k: PackedBlock, v: PackedBlock, n: int, keep: torch.Tensor | None = None) -> None:
        """A freshly flushed block (at the config's bits) enters the youngest tier."""
        self.stores[0].append(start, k, v, n, keep)

    def drop_front(self, tokens: int) -> None:
        """Forget the oldest ``tokens`` packed tokens (a multiple of the flush block; sliding layers)."""
        for store in reversed(self.stores):
            take = min(tokens, store.n)
            if take:
                store.drop_front(take)
                tokens -= take

    def view(self) -> PackedView:
        """Contiguous views for the kernels; only for untiered layers (one store)."""
        if len(self.stores) > 1:
            raise KvcalibError("a tiered (PATS) layer has one store per tier: there is no single packed view")
        return self.stores[0].view()

    def runs(self, step: int) -> Iterator[tuple[PackedStore, int, int]]:
        """``(store, a, b)`` chunks of at most ``step`` tokens, in position order (oldest first)."""
        for store in reversed(self.stores):
            for a in range(0, store.n, step):
                yield store, a, min(a + step, store.n)

    # ------------------------------------------------------------------ PATS
    def advance(self, context: int, valid: torch.Tensor | None = None) -> None:
        """Move every block to the tier it holds at ``context`` tokens (module docstring).

        ``valid`` (B, context) bool: the cache's padding mask (None = no padding); with the
        stored OTT quant masks it gives each requantization the ranges of the first quantization.
        """
        if len(self.stores) == 1:
            return
        block = self.cfg.flush_block
        last = len(self.stores) - 1
        for src_i in range(last - 1, -1, -1):  # older stores first: they make room for younger blocks
            src = self.stores[src_i]
            for dst_i in range(last, src_i, -1):  # the oldest target first
                if not src.n:
                    break
                limit = context - self.ages[dst_i]  # blocks ending at or before this are in tier >= dst_i
                tokens = min(src.n, max(0, (limit - src.start) // block * block))
                if tokens:
                    self._move(src_i, dst_i, tokens, valid)

    def move_due(self, context: int) -> bool:
        """Whether :meth:`advance` at ``context`` tokens would move a block (cheap, host only): some
        store's oldest block has reached the next tier's age (the nearest tier is reached first)."""
        block = self.cfg.flush_block
        return any(src.n and context - self.ages[i + 1] - src.start >= block
                   for i, src in enumerate(self.stores[:-1]))

    def _move(self, src_i: int, dst_i: int, tokens: int, valid: torch.Tensor | None) -> None:
        """Requantize the leading ``tokens`` of store ``src_i`` through the tiers up to ``dst_i``."""
        src, dst = self.stores[src_i], self.stores[dst_i]
        start = src.start
        k, v = src.block("k", 0, tokens), src.block("v", 0, tokens)
        keep_bytes = src.keep_bytes(0, tokens)  # (B, H, R) uint8 or None
        keep = src.keep(0, tokens)  # (B, H, tokens) bool or None
        pad = None if valid is None else valid[:, start:start + tokens]  # (B, tokens)
        bits = dict(src.bits)
        for _, kb, vb in self.codec.tiers[src_i + 1:dst_i + 1]:
            if kb < bits["k"]:
                k, bits["k"] = self.codec.requantize("k", k, kb, pad, keep), kb
            if vb < bits["v"]:
                v, bits["v"] = self.codec.requantize("v", v, vb, pad, keep), vb
        dst.append(start, k, v, tokens, keep_bytes)  # copies: src's views stay valid until dropped
        src.drop_front(tokens)

    # ------------------------------------------------------------------ memory
    def nbytes(self) -> dict[str, int]:
        """Held bytes by component, summed over the tiers."""
        out: dict[str, int] = {}
        for store in self.stores:
            for key, val in store.nbytes().items():
                out[key] = out.get(key, 0) + val
        return out
