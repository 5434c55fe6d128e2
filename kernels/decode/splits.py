"""Split-K work division shared by the fixed-width and Huffman decode kernels: how many split
programs walk the packed tokens of each (batch, kv head) row, how many chunk programs the
full-precision segments take, and the buffers of their partials. The measurements behind each
default are in ``artifacts/bench/HISTORY.md``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from kvcalib_kernels.decode.common import _cdiv


@dataclass(frozen=True)
class SplitRule:
    """How the packed tokens of a call are divided into split programs.

    - ``programs_per_sm``: target split programs per SM. 8 (the fixed-width kernel): one wave of
      its one-warp programs at ~255 registers (8 fit on an SM); 16 (two waves) was slower wherever
      the splits stay long.
    - ``num_splits``: force the packed splits per row (tests); None: from ``programs_per_sm``.
    - ``whole_waves``: round the splits per row down, not up, so all rows' programs stay within one
      wave (a few programs past it ran as a wave of their own: 1.6x slower).
    - ``min_split_blocks``: fewest blocks per split (bounds the partials written and merged) ...
    - ``min_splits``: ... unless that leaves fewer splits than this (short caches: down to one
      block per split; batch 1 / 4k: 31 -> 62 splits, 13.1 -> 10.9 us) ...
    - ``min_programs``: ... or fewer split programs in all (batch x kv heads x splits) than this
      (few kv heads at batch 1: one block per split).
    """

    programs_per_sm: float = 8.0
    num_splits: int | None = None
    whole_waves: bool = True
    min_split_blocks: int = 2
    min_splits: int = 64
    min_programs: int = 640


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _split_plan(n, block_n, f_lens, fp_block, bsz, h, dev, rule: SplitRule):
    """``n`` packed tokens in splits of whole ``block_n`` blocks (:class:`SplitRule`; off CUDA the
    device counts as 4 SMs), full-precision segments of ``f_lens`` tokens in ``fp_block`` chunks.
    Returns (splits, split_size, chunks per segment, total partials)."""
    if n:
        n_blocks = _cdiv(n, block_n)
        if rule.num_splits is not None:
            splits = min(rule.num_splits, n_blocks)
        else:
            sms = _sm_count(dev.index or 0) if dev.type == "cuda" else 4
            cap = max(1, n_blocks // max(1, rule.min_split_blocks))
            if cap < rule.min_splits:  # short caches: down to one block per split
                cap = min(n_blocks, rule.min_splits)
            if bsz * h * cap < rule.min_programs:  # few (batch, kv head) rows: one block per split
                cap = n_blocks
            per_row = rule.programs_per_sm * sms / (bsz * h)  # split programs per (batch, kv head) row
            splits = max(1, min(cap, math.floor(per_row) if rule.whole_waves else math.ceil(per_row)))
        split_size = _cdiv(n_blocks, splits) * block_n
        splits = _cdiv(n, split_size)
    else:
        splits, split_size = 0, block_n
    chunks = [_cdiv(f, fp_block) for f in f_lens]
    return splits, split_size, chunks, splits + sum(chunks)


def _partials(bsz, hq, d, s_tot, dev, out_dtype=torch.float32):
    """Buffers of ``s_tot`` partials per row: m/l (B*Hq, S) float32, acc (B*Hq, S, D) float32, and
    the output (B, Hq, D) ``out_dtype``."""
    rows = bsz * hq
    m_part = torch.empty((rows, max(s_tot, 1)), dtype=torch.float32, device=dev)  # (B*Hq, S)
    l_part = torch.empty_like(m_part)
    o_part = torch.empty((rows, max(s_tot, 1), d), dtype=torch.float32, device=dev)  # (B*Hq, S, D)
    out = torch.empty((bsz, hq, d), dtype=out_dtype, device=dev)  # (B, Hq, D)
    return m_part, l_part, o_part, out


def _work_split(n, block_n, f_lens, fp_block, bsz, h, hq, d, dev, rule: SplitRule):
    """:func:`_split_plan` plus its buffers (:func:`_partials`): (splits, split_size, chunks per
    segment, total partials, (m, l, acc, out))."""
    splits, split_size, chunks, s_tot = _split_plan(n, block_n, f_lens, fp_block, bsz, h, dev, rule)
    return splits, split_size, chunks, s_tot, _partials(bsz, hq, d, s_tot, dev)
