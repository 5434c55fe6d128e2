"""The storage of OTT's full-precision token pools: what the cache keeps per layer, the memory
accounting counts and a coded snapshot saves (:mod:`kvcalib.methods.outliers` decides which tokens
enter them; this is only the container, shared with the runtime one layer up).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcalib.errors import CalibrationError

__all__ = ["DEFAULT_POOL", "EXTRA_CAPACITY", "POS_DTYPE", "MAX_OUTLIER_POOL", "OutlierState"]

DEFAULT_POOL = 3  # OTT's outlier_num
EXTRA_CAPACITY = 32  # OTT's extra pool for evicted outlier tokens
POS_DTYPE = torch.int32  # pool positions as stored and accounted (kvcalib.methods.outliers.pool_bytes: pos_bytes=4)
MAX_OUTLIER_POOL = 1024  # full-precision pool slots per kv head; beyond this a pool defeats compression


@dataclass
class OutlierState:
    """The full-precision outlier pools of one layer, carried from flush to flush.

    Attributes:
        pool_k, pool_v: ``(B, H, P, D)``, P = pool_size, in the cache dtype.
        pool_pos: int32 ``(B, H, P)`` absolute token positions, -1 = empty slot (int32: what
            :func:`kvcalib.methods.outliers.pool_bytes` accounts; contexts stay far below 2**31).
        extra_k, extra_v: ``(B, H, E, D)``, E = extra capacity; filled from slot 0 upward.
        extra_pos: int32 ``(B, H, E)``, -1 = empty slot.
        extra_count: int64 ``(B, H)`` filled extra slots.
        tracking: bool ``(B, H)``: False once tracking has stopped for that row/head.
    """

    pool_k: torch.Tensor
    pool_v: torch.Tensor
    pool_pos: torch.Tensor
    extra_k: torch.Tensor
    extra_v: torch.Tensor
    extra_pos: torch.Tensor
    extra_count: torch.Tensor
    tracking: torch.Tensor

    @classmethod
    def empty(cls, batch: int, heads: int, head_dim: int, pool_size: int = DEFAULT_POOL,
              extra_capacity: int = EXTRA_CAPACITY, dtype: torch.dtype = torch.float32,
              device: torch.device | str | None = None) -> "OutlierState":
        """Empty pools for ``(batch, heads)`` rows."""
        for name, val in (("pool_size", pool_size), ("extra_capacity", extra_capacity)):
            if isinstance(val, bool) or not isinstance(val, int) or val < 0:
                raise CalibrationError(f"{name} must be a non-negative int, got {val!r}")
        z = dict(dtype=dtype, device=device)
        i = dict(dtype=POS_DTYPE, device=device)
        return cls(
            pool_k=torch.zeros(batch, heads, pool_size, head_dim, **z),
            pool_v=torch.zeros(batch, heads, pool_size, head_dim, **z),
            pool_pos=torch.full((batch, heads, pool_size), -1, **i),
            extra_k=torch.zeros(batch, heads, extra_capacity, head_dim, **z),
            extra_v=torch.zeros(batch, heads, extra_capacity, head_dim, **z),
            extra_pos=torch.full((batch, heads, extra_capacity), -1, **i),
            extra_count=torch.zeros(batch, heads, dtype=torch.int64, device=device),
            tracking=torch.ones(batch, heads, dtype=torch.bool, device=device),
        )

    @property
    def pool_size(self) -> int:
        return int(self.pool_k.shape[2])

    @property
    def extra_capacity(self) -> int:
        return int(self.extra_k.shape[2])

    def full_precision_positions(self) -> list[list[list[int]]]:
        """Sorted positions held in full precision (pool + extra), per ``[b][h]`` (for tests/debug)."""
        pos = torch.cat([self.pool_pos, self.extra_pos], dim=-1).tolist()  # (B, H, P + E)
        return [[sorted(p for p in row if p >= 0) for row in rows] for rows in pos]
