"""The merge of the decode kernels' partials (kernel -> launcher): each row's ``(m, l, acc)`` of
every split and full-precision chunk, combined by log-sum-exp into the attention output (and the
row's log-sum-exp). Shared by :mod:`kvcalib_kernels.decode_attention` (all parts of a PATS cache
write one partial buffer and merge in one launch) and :mod:`kvcalib_kernels.decode_attention_huffman`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcalib_kernels.decode.common import _interpreting
from kvcalib_kernels.launch import FastLauncher


@triton.jit(do_not_specialize=["S_TOT"])
def _combine_kernel(
    M_part, L_part, O_part, S_TOT,  # (ROWS, S_TOT), (ROWS, S_TOT), (ROWS, S_TOT, D) float32
    Out,  # (ROWS, D) float32 / float16 / bfloat16 (cast at the store), ROWS = B * Hq
    Lse,  # (ROWS,) float32, written when STORE_LSE
    D: tl.constexpr, DB: tl.constexpr, S_BLOCK: tl.constexpr, STORE_LSE: tl.constexpr = False,
):
    """out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s; 0 where nothing was visible.
    STORE_LSE: also the row's log-sum-exp of the scores in natural-log units (-inf: nothing
    visible), written by the programs of the first channel block.

    Program ``(row, c)`` merges channels ``[c * DB, (c + 1) * DB)`` of one row, S_BLOCK partials
    at a time with a running max (one pass; :func:`_combine` picks the sizes). Splitting the
    channels over programs keeps the merge parallel when there are few rows and many partials
    (batch 1: 32 rows x 256 splits), where one program per row was most of the call's time.
    """
    row = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * DB + tl.arange(0, DB)
    offs_s = tl.arange(0, S_BLOCK)
    m_run = tl.max(tl.full([S_BLOCK], -1.0e30, tl.float32), axis=0)
    l_run = tl.sum(tl.zeros([S_BLOCK], tl.float32), axis=0)
    acc = tl.zeros([DB], tl.float32)
    for s0 in range(0, S_TOT, S_BLOCK):
        ok = s0 + offs_s < S_TOT
        m = tl.load(M_part + row * S_TOT + s0 + offs_s, mask=ok, other=-1.0e30)  # (S_BLOCK,)
        l = tl.load(L_part + row * S_TOT + s0 + offs_s, mask=ok, other=0.0)
        o = tl.load(O_part + (row * S_TOT + s0 + offs_s)[:, None] * D + offs_d[None, :], mask=ok[:, None],
                    other=0.0)  # (S_BLOCK, DB)
        m_new = tl.maximum(m_run, tl.max(m, axis=0))
        alpha = tl.exp2(m_run - m_new)
        w = tl.where(ok, tl.exp2(m - m_new), 0.0)  # (S_BLOCK,)
        l_run = l_run * alpha + tl.sum(l * w, axis=0)
        acc = acc * alpha + tl.sum(o * w[:, None], axis=0)
        m_run = m_new
    out = acc / tl.where(l_run > 0, l_run, 1.0)
    if Out.dtype.element_ty == tl.float32:
        tl.store(Out + row * D + offs_d, out)
    else:  # round to nearest even (what torch's .to does; the interpreter's implicit store cast truncates)
        tl.store(Out + row * D + offs_d, out.to(Out.dtype.element_ty, fp_downcast_rounding="rtne"))
    if STORE_LSE:
        lse = tl.where(l_run > 0, (m_run + tl.log2(tl.where(l_run > 0, l_run, 1.0))) * 0.6931471805599453,
                       float("-inf"))
        tl.store(Lse + row, lse, mask=tl.program_id(1) == 0)


def _combine(m_part, l_part, o_part, s_tot: int, out: torch.Tensor, lse: torch.Tensor | None = None,
             channels: int | None = None) -> None:
    """Launch :func:`_combine_kernel` over ``out`` (B, Hq, D) (float32, or the caller's 16-bit dtype:
    the merge runs in float32 and rounds once at the store) from ``s_tot`` partials per row.
    ``lse`` (B, Hq) float32, when given, receives each row's log-sum-exp.

    One warp per program, up to 128 partials a step, 16 channels a program (32 with <= 64
    partials): the best of 27 (step, channels, warps) choices within 1% at every (rows, partials)
    of the benchmark grid's shapes on an H200 (``combine_sweep`` in ``artifacts/bench/HISTORY_sweeps.md``). The earlier
    rule (all partials in one step, <= 2048 values a program, 4 warps) read 8- or 16-byte pieces
    at the stride of a partial's row when partials were many: batch 1, Qwen2.5-1.5B shape (12 rows
    x 530 partials) 5.2 -> 3.4 us, Mistral-7B shape (32 x 258) 4.5 -> 2.8 us, batch 8 / 4k (96 x
    130) 5.4 -> 3.0 us (CUDA-graph time of the combine alone). Under Triton's interpreter a
    program takes all channels (its cost is per program and op, not per byte); ``channels``
    forces the channels per program (tests)."""
    rows, d = out.shape[0] * out.shape[1], out.shape[2]
    s_block = min(128, max(16, triton.next_power_of_2(max(s_tot, 1))))  # partials per step
    # channels per program (head_dim is a power of two >= 16)
    db = channels or (d if _interpreting() else min(d, 16 if s_tot > 64 else 32))
    _COMBINE((rows, d // db), (m_part, l_part, o_part, max(s_tot, 1), out, out if lse is None else lse),
             {"D": d, "DB": db, "S_BLOCK": s_block, "STORE_LSE": lse is not None, "num_warps": 1})


_COMBINE = FastLauncher(_combine_kernel)
