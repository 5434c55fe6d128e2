"""OTT in the cache: one layer's outlier pools and the per-block quant masks.

This is the runtime side of :mod:`kvcalib.methods.outliers` (read its "Runtime contract"):

- :class:`OutlierPool` holds the layer's :class:`~kvcalib.quant.pools.OutlierState`
  (pool and extra pool K/V in full precision, int32 positions, counters), allocated at the first
  flush. :meth:`OutlierPool.select` runs OTT's selection on a group being flushed, through the
  method state that asked for the pool (the codec's ``pool``: ``PoolState.select``), and returns
  its quant mask; :meth:`OutlierPool.segment` gives the pools to attention (full precision, with
  absolute positions so the attention can look up their visibility; empty slots are -1);
- the quant mask of each flushed block is stored with the block, packed 8 tokens per byte
  (:func:`pack_keep` / :func:`unpack_keep`): ``ceil(G / 8)`` bytes per block per kv head. A slot
  whose bit is 0 holds a token that lives in the pool: attention masks the packed slot out, so
  every token is seen exactly once.

A pool size of 0 means OTT is off for the layer: nothing is allocated and nothing is stored.
"""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING

import torch

from kvcalib.quant.pools import OutlierState

if TYPE_CHECKING:
    from kvcalib.methods import MethodState


def mask_bytes_per_block(block: int) -> int:
    """Bytes of one block's quant mask per kv head (8 tokens per byte, rounded up)."""
    return (block + 7) // 8


def pack_keep(keep: torch.Tensor) -> torch.Tensor:
    """bool ``(B, H, G)`` -> uint8 ``(B, H, ceil(G / 8))``; token ``t`` is bit ``t % 8`` of byte ``t // 8``."""
    b, h, g = keep.shape
    nb = mask_bytes_per_block(g)
    bits = torch.zeros(b, h, nb * 8, dtype=torch.uint8, device=keep.device)  # (B, H, 8 * nb)
    bits[..., :g] = keep.to(torch.uint8)
    weights = (1 << torch.arange(8, device=keep.device, dtype=torch.int32)).to(torch.uint8)  # (8,)
    return (bits.reshape(b, h, nb, 8) * weights).sum(-1, dtype=torch.int32).to(torch.uint8)  # (B, H, nb)


def unpack_keep(packed: torch.Tensor, block: int) -> torch.Tensor:
    """uint8 ``(B, H, nblocks * ceil(G / 8))`` of whole blocks -> bool ``(B, H, nblocks * G)``."""
    b, h, r = packed.shape
    nb = mask_bytes_per_block(block)
    shifts = torch.arange(8, device=packed.device, dtype=torch.uint8)  # (8,)
    bits = (packed[..., None] >> shifts) & 1  # (B, H, R, 8)
    return bits.reshape(b, h, r // nb, nb * 8)[..., :block].reshape(b, h, -1).bool()


def _joined(state: OutlierState) -> tuple[OutlierState, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The same state with pool and extra pool stored back to back: K, V ``(B, H, P + E, D)``
    and positions ``(B, H, P + E)``, the state's parts views into them (one copy per flush, so
    attention reads the pools without a concatenation per step; the bytes are the same)."""
    p = state.pool_size
    k = torch.cat([state.pool_k, state.extra_k], dim=2)  # (B, H, P + E, D)
    v = torch.cat([state.pool_v, state.extra_v], dim=2)  # (B, H, P + E, D)
    pos = torch.cat([state.pool_pos, state.extra_pos], dim=2)  # (B, H, P + E) int32
    views = OutlierState(k[:, :, :p], v[:, :, :p], pos[:, :, :p], k[:, :, p:], v[:, :, p:], pos[:, :, p:],
                         state.extra_count, state.tracking)
    return views, (k, v, pos)


class OutlierPool:
    """One layer's OTT state in the cache (``pool_size`` 0 = off)."""

    def __init__(self, pool: "MethodState | None" = None) -> None:
        # the state that asked for the pool (its pool_size > 0) runs OTT's selection: kvcalib.methods.outliers
        self.pool = pool
        self.pool_size = 0 if pool is None else int(pool.pool_size)
        self.extra_capacity = 0 if pool is None else int(pool.extra_capacity)
        self._state: OutlierState | None = None  # allocated at the first flush
        self._joined: tuple[torch.Tensor, ...] = ()  # K, V (B, H, P + E, D), positions (B, H, P + E)

    @property
    def state(self) -> OutlierState | None:
        """The pools (None before the first flush); setting it stores the pools joined."""
        return self._state

    @state.setter
    def state(self, value: OutlierState | None) -> None:
        self._state, self._joined = (None, ()) if value is None else _joined(value)

    @property
    def active(self) -> bool:
        return self.pool_size > 0

    def select(self, k_blk: torch.Tensor, v_blk: torch.Tensor, start: int,
               valid: torch.Tensor | None = None) -> torch.Tensor | None:
        """One flush of ``k_blk``/``v_blk`` ``(B, H, G, D)`` starting at absolute ``start``.

        ``valid`` ``(B, G)`` bool marks real tokens (padding never enters the pool). Returns the
        quant mask bool ``(B, H, G)`` (False = the token went to the pool), or None when OTT is off.
        """
        if not self.active:
            return None
        if self.state is None:
            b, h, _, d = k_blk.shape
            self.state = OutlierState.empty(b, h, d, self.pool_size, self.extra_capacity, k_blk.dtype,
                                            k_blk.device)
        sel = self.pool.select(k_blk, v_blk, self.state, start, valid=valid)
        self.state = sel.state
        return sel.quant_mask

    def copy_row(self, other: "OutlierPool", row: int) -> None:
        """Hold batch row ``row`` of ``other``'s pools (a copy), as a single-row pool (padded
        batches split into rows: :mod:`kvcalib.runtime.cache`)."""
        state = other.state
        if state is not None:
            one = slice(row, row + 1)
            self.state = OutlierState(*(getattr(state, f.name)[one].clone() for f in fields(state)))

    def segment(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Pool and extra pool for attention: K, V ``(B, H, P + E, D)`` in ``dtype`` and int32
        positions ``(B, H, P + E)`` (-1 = empty slot); None before the first flush or when off.
        No copy in the cache's dtype (the pools are stored joined, one tensor per part), no host
        sync: empty slots are left for the attention to mask."""
        if self.state is None:
            return None
        k, v, pos = self._joined
        return k.to(dtype), v.to(dtype), pos

    def nbytes(self) -> dict[str, int]:
        """Held bytes: ``outlier_pool`` (K/V slots), ``outlier_positions`` (positions + counters)."""
        s = self.state
        if s is None:
            return {}

        def size(*ts: torch.Tensor) -> int:
            return sum(int(t.numel() * t.element_size()) for t in ts)

        return {"outlier_pool": size(s.pool_k, s.pool_v, s.extra_k, s.extra_v),
                "outlier_positions": size(s.pool_pos, s.extra_pos, s.extra_count, s.tracking)}
