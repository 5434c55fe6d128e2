"""The merge of the decode kernels' partials (kernel -> launcher): each row's ``(m, l, acc)`` of
every split and full-precision chunk, combined by log-sum-exp into the attention output (and the
row's log-sum-exp). Shared by :mod:`kvcalib_kernels.decode_attention` (all parts of a PATS cache
write one partial buffer and merge in one launch) and :mod:`kvcalib_kernels.decode_attention_huffman`.

Two kernels: :func:`_combine_kernel`, every partial in the input basis; and
:func:`_combine_rotated_kernel`, where a range of partial columns holds the packed splits of a
value side stored rotated (:mod:`kvcalib.quant.rotation`): their weighted sum is rotated back to
the input basis inside the merge (linear, so once per row rather than once per split), in place
of :func:`.rotation.rotate_back_partials`' separate launch before the merge. :mod:`.plan` takes it
on calls of at least ``COMBINE_ROTATION_MIN_ROWS`` (batch x kv heads) rows; why, with the
measurements, is at ``plan._back_rotation_in_combine``.
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


@triton.jit(do_not_specialize=["S_TOT", "ROT_LO", "ROT_HI"])
def _combine_rotated_kernel(
    M_part, L_part, O_part, S_TOT,  # (ROWS, S_TOT), (ROWS, S_TOT), (ROWS, S_TOT, D) float32
    ROT_LO, ROT_HI,  # partial columns [ROT_LO, ROT_HI): accumulators in the rotated basis
    RM, stride_rmh,  # rotation matrix (D, D) float32 row-major; stride_rmh 0: one shared by the heads
    RSIGNS,  # (H, D) float32 +-1, read when HAS_SIGNS
    Out,  # (ROWS, D) float32 / float16 / bfloat16 (cast at the store), ROWS = B * H * R
    Lse,  # (ROWS,) float32, written when STORE_LSE
    H,  # kv heads
    R: tl.constexpr, R_PAD: tl.constexpr, D: tl.constexpr, DJ: tl.constexpr, S_BLOCK: tl.constexpr,
    HAS_SIGNS: tl.constexpr, PRECISION: tl.constexpr, STORE_LSE: tl.constexpr = False,
):
    """:func:`_combine_kernel`'s merge where columns ``[ROT_LO, ROT_HI)`` hold rotated
    accumulators: out = (plain + rot R^T) / l with plain = sum over the other columns of
    2^(m_s - M) acc_s, rot = the same sum over the rotated columns, ``rot R^T = (rot @ M^T) *
    signs`` (:func:`kvcalib.quant.rotation.unrotate`) and l = sum_s 2^(m_s - M) l_s over all.

    Program ``(b * H + h, c)`` writes channels ``[c * DJ, (c + 1) * DJ)`` of the R query rows of
    kv head h: the back-rotation of a channel needs every channel of the rotated sum, and the
    rows of one kv head share its matrix, so a program takes all of them and one (DJ, D) piece of
    the matrix (not all of it: head_dim 256 would need 256 KB). Three passes over the partials:
    the rows' max M (m only), the plain columns' DJ channels with l of all columns, the rotated
    columns' D channels; with M known first, neither sum needs rescaling.
    """
    bh = tl.program_id(0)
    h = bh % H
    offs_r = tl.arange(0, R_PAD)
    r_ok = offs_r < R  # rows past R (R_PAD: a power of two) are computed, never stored
    rows = (bh * R + offs_r).to(tl.int64)  # (R_PAD,) b * H * R + h * R + r
    offs_s = tl.arange(0, S_BLOCK)
    offs_j = tl.program_id(1) * DJ + tl.arange(0, DJ)  # (DJ,) output channels
    offs_d = tl.arange(0, D)
    m_max = tl.full([R_PAD], -1.0e30, tl.float32)
    for s0 in range(0, S_TOT, S_BLOCK):
        ok = r_ok[:, None] & (s0 + offs_s < S_TOT)[None, :]  # (R_PAD, S_BLOCK)
        m = tl.load(M_part + rows[:, None] * S_TOT + s0 + offs_s[None, :], mask=ok, other=-1.0e30)
        m_max = tl.maximum(m_max, tl.max(m, axis=1))
    l_sum = tl.zeros([R_PAD], tl.float32)
    plain = tl.zeros([R_PAD, DJ], tl.float32)
    for s0 in range(0, S_TOT, S_BLOCK):
        s = s0 + offs_s  # (S_BLOCK,) partial columns
        ok = r_ok[:, None] & (s < S_TOT)[None, :]  # (R_PAD, S_BLOCK)
        cell = rows[:, None] * S_TOT + s[None, :]  # (R_PAD, S_BLOCK)
        m = tl.load(M_part + cell, mask=ok, other=-1.0e30)
        l = tl.load(L_part + cell, mask=ok, other=0.0)
        w = tl.where(ok, tl.exp2(m - m_max[:, None]), 0.0)  # (R_PAD, S_BLOCK)
        l_sum += tl.sum(l * w, axis=1)
        unrotated = ok & ((s < ROT_LO) | (s >= ROT_HI))[None, :]  # (R_PAD, S_BLOCK)
        o = tl.load(O_part + (cell * D)[:, :, None] + offs_j[None, None, :], mask=unrotated[:, :, None],
                    other=0.0)  # (R_PAD, S_BLOCK, DJ)
        plain += tl.sum(o * tl.where(unrotated, w, 0.0)[:, :, None], axis=1)
    rot = tl.zeros([R_PAD, D], tl.float32)
    for s0 in range(ROT_LO, ROT_HI, S_BLOCK):
        s = s0 + offs_s
        ok = r_ok[:, None] & (s < ROT_HI)[None, :]  # (R_PAD, S_BLOCK)
        cell = rows[:, None] * S_TOT + s[None, :]  # (R_PAD, S_BLOCK)
        m = tl.load(M_part + cell, mask=ok, other=-1.0e30)
        w = tl.where(ok, tl.exp2(m - m_max[:, None]), 0.0)  # (R_PAD, S_BLOCK)
        o = tl.load(O_part + (cell * D)[:, :, None] + offs_d[None, None, :], mask=ok[:, :, None],
                    other=0.0)  # (R_PAD, S_BLOCK, D)
        rot += tl.sum(o * w[:, :, None], axis=1)
    # transposed product, channels as the MMA's M rows and the few query rows its N (as in the
    # split kernel): back_t[j, r] = sum_i M[j, i] rot[r, i], i.e. (rot @ M^T)^T
    m_rows = tl.load(RM + h * stride_rmh + offs_j[:, None] * D + offs_d[None, :])  # (DJ, D)
    back_t = tl.dot(m_rows, tl.trans(rot), input_precision=PRECISION)  # (DJ, R_PAD) float32
    if HAS_SIGNS:
        back_t = back_t * tl.load(RSIGNS + h * D + offs_j)[:, None]
    out_t = (tl.trans(plain) + back_t) / tl.where(l_sum > 0, l_sum, 1.0)[None, :]  # (DJ, R_PAD)
    out_ptrs = Out + rows[None, :] * D + offs_j[:, None]  # (DJ, R_PAD)
    if Out.dtype.element_ty == tl.float32:
        tl.store(out_ptrs, out_t, mask=r_ok[None, :])
    else:  # round to nearest even, as _combine_kernel
        tl.store(out_ptrs, out_t.to(Out.dtype.element_ty, fp_downcast_rounding="rtne"), mask=r_ok[None, :])
    if STORE_LSE and tl.program_id(1) == 0:  # (the programs of the first channel piece)
        lse = tl.where(l_sum > 0, (m_max + tl.log2(tl.where(l_sum > 0, l_sum, 1.0))) * 0.6931471805599453,
                       float("-inf"))
        tl.store(Lse + rows, lse, mask=r_ok)


def _combine_rotated(m_part, l_part, o_part, s_tot: int, out: torch.Tensor, lse: torch.Tensor | None, h: int,
                     rot_lo: int, rot_hi: int, rot, channels: int | None = None) -> None:
    """Launch :func:`_combine_rotated_kernel` over ``out`` (B, Hq, D) (as :func:`_combine`) from
    ``s_tot`` partials per row of which columns ``[rot_lo, rot_hi)`` hold accumulators rotated by
    ``rot`` = (matrix (D, D) | (H, D, D), signs (H, D) | None) float32, ``h`` kv heads.

    Settings not swept on their own (the whole path was measured against the separate launch:
    :mod:`.plan`'s ``COMBINE_ROTATION_MIN_ROWS``): 4 warps, 16 partials a step, 64 output
    channels a program (head_dim 128: 2 programs per kv head, each reading the rotated partials
    once). Products of the back-rotation in "tf32x3" (float32 accuracy, as :mod:`.rotation`);
    IEEE under Triton's interpreter. A program takes all channels there (its cost is per program and op); ``channels``
    forces the channels per program (tests)."""
    bsz, hq, d = out.shape
    rep = hq // h
    matrix, signs = (None if t is None else t.contiguous() for t in rot)  # (a fitted matrix may come column-major)
    dj = channels or (d if _interpreting() else min(d, 64))
    _COMBINE_ROTATED((bsz * h, d // dj),
                     (m_part, l_part, o_part, s_tot, rot_lo, rot_hi,
                      matrix, matrix.stride(0) if matrix.dim() == 3 else 0, matrix if signs is None else signs,
                      out, out if lse is None else lse, h),
                     {"R": rep, "R_PAD": max(4, triton.next_power_of_2(rep)), "D": d, "DJ": dj, "S_BLOCK": 16,
                      "HAS_SIGNS": signs is not None, "PRECISION": "ieee" if _interpreting() else "tf32x3",
                      "STORE_LSE": lse is not None, "num_warps": 4})


_COMBINE_ROTATED = FastLauncher(_combine_rotated_kernel)
