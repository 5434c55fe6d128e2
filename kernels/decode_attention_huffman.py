"""Split-K flash-decoding over a Huffman-coded KV cache: codes decoded inside the attention loop.

What one call computes (the specification is
:func:`kvcalib_kernels.reference.decode_attention_huffman_reference`, i.e.
:func:`~kvcalib_kernels.reference.decode_attention_reference` on the decoded codes): the same
result as :func:`kvcalib_kernels.decode_attention.decode_attention` on the same quantized cache,
where the packed K and V codes are replaced by Huffman streams (block format v1 of
:mod:`kvcalib.quant.huffman`):

- one stream per (batch, kv head, packed token) and side: the ``D`` codes of the token in channel
  order, stream index ``(b * H + h) * N + n`` (row ``i`` of the ``symbols (B*H*N, D)`` given to
  :func:`~kvcalib.quant.huffman.encode_blocks`);
- keys per channel over groups of ``k_group`` tokens (KIVI, ``k_axis="channel"``), values per
  token over groups of ``v_group`` channels; scales/zeros exactly as in decode_attention.py;
- up to two full-precision segments (sinks, pending window), a per-batch valid packed range and
  a visibility mask, all as in decode_attention.py.

Launches: ``_huffman_split_kernel`` twice -- grid ``(B * H, S_packed)`` for the packed splits
(same split-K scheme as decode_attention.py: all ``R = Hq / H`` query heads of kv head ``h`` in
one program, so each stream is decoded once per GQA group), then grid ``(B * H, S_fp)`` with
``FP_ONLY`` for the full-precision chunks through :func:`kvcalib_kernels.decode.common._fp_chunk`
(apart so that the decode loop does not inherit the fp branch's register allocation) -- then
:func:`kvcalib_kernels.decode.combine._combine` (log-sum-exp merge of all partials).

How the codes get from the stream to the tensor cores (the choice the fixed-width kernel does
not have to make): a program walks its split in blocks of ``BLOCK_N`` tokens; every token of a
block is a *lane* (one per thread) that decodes its own stream with the lane machinery of
:mod:`kvcalib_kernels.huffman_decode` (three payload words and a bit position in registers; one
table lookup decodes 4 codes of a 2-bit codebook, 2 or 1 of a 4-bit one; the ``"f16"`` tables
hold the codes as float16 already, so no integer-to-float conversion per code). The ``D``
channels are decoded in ``D / 32`` chunks of 32 (a runtime loop: small code, compiles in
seconds); each chunk is gathered by ``tl.join`` into a ``(BLOCK_N, 32)`` register tile whose
rows stay in their lanes' registers and fed to ``tl.dot`` like one unpacked plane of the
fixed-width kernel: keys ``(q * s)_chunk @ tile^T`` (per-channel key scales folded into the
query; ``q . zero`` once per key group), values ``(p * s) @ tile`` (per-token value scales folded
into the probabilities, one product per value group of the chunk; the zero terms of all value
groups in one extra product). Triton moves the tile to the MMA operand layout through shared
memory -- the decoded codes never touch global memory (no scratch buffer).

Why not the alternatives: (a) a scratch tile in global memory (decode -> store -> barrier ->
load) would write every decoded code to L2 and back, the round trip this kernel exists to avoid;
(b) building a whole ``(BLOCK_N, D)`` tile with ``tl.where`` over a column index costs ``D``
selects per code; (c) consuming each code at once for keys (``score += q_s[:, c] * code``)
works for keys but not for values, whose accumulator column is the code's channel (a ``tl.where``
over ``D`` columns per code again). Chunks of 32 bound the live tile to 16 registers per lane.

Performance status (H200, Mistral-7B shape, batch 8, 32k context, ``benchmarks/huffman.py``):
correct, but slower than the fixed-width kernel it replaces: ~0.79 ms (2-bit) / ~1.26 ms
(4-bit) against ~0.21 ms fixed-width and ~0.25 ms bf16 SDPA; also slower than the unfused path
(standalone decoder ~0.17 / ~0.33 ms per side + fixed-width kernel). The decode is a chain of
dependent table loads per lane, so it needs many resident warps; the MMA accumulators of the
16 padded query rows, the decode state and the tiles hold ~170 registers per thread (~12 warps
per SM, against ~48 for the standalone decoder). What it buys today is memory: 1.6 / 3.5 coded
bits per 2 / 4-bit code (plus format v1's int64 offset per stream). Next steps: pipeline the
value decode of block i with the key decode of block i + 1 (two independent chains per thread),
4-bit codebooks limited to 6-bit words (two codes per lookup), the cache's compact stream layout
(:mod:`kvcalib.methods.huffman`: per-chunk word index + 1-byte excess per stream instead of
int64 offsets).

Not supported (the launcher raises ValueError, :func:`supports` says why without raising):
per-token keys (``k_axis="token"``), head_dim other than 64 / 128, code widths other than
2 / 4 / 8 bits (8 works but gains little from entropy coding), key groups without a power-of-two
divisor >= 32 (a block must lie in one key group and give every thread its own stream), value
groups not dividing head_dim or smaller than 8 channels, more than 64 query heads per kv head,
streams of a length other than ``D``.

Trust: ``validate=True`` (default) checks the structure of both blocks (offsets start at 0,
never decrease, end inside the payload, raw flags agree with sizes; one device sync per side).
The kernel never reads outside a payload whatever the offsets, but it does not check that each
stream ends exactly at the next offset (:func:`kvcalib_kernels.huffman_decode.huffman_decode`
does): a corrupt payload gives a wrong (finite) result, never a fault or a hang.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvcalib.quant.huffman import Codebook, EncodedBlocks
from kvcalib_kernels.decode.combine import _combine
from kvcalib_kernels.decode.common import (LOG2E, _check_fp, _column, _dot, _dummy, _fp_chunk, _fp_segment_args,
                                           _interpreting, _packed_range, _pow2_divisor, _softcap, _split_range,
                                           _tl_dtype, _visibility)
from kvcalib_kernels.decode.splits import SplitRule, _work_split
from kvcalib_kernels.huffman_decode import (MAX_INDEX_BITS, DecodeTable, _check_block_tensors, _check_device,
                                            _dec_chunk, _dec_start, choose_step, decode_table,
                                            funnel_shift_available, validate_streams)

__all__ = ["HuffmanAttentionConfig", "decode_attention_huffman", "supports"]


# ---------------------------------------------------------------- device helpers


@triton.jit
def _q_plane(q_rows, r_ok, offs_p, COL0: tl.constexpr, qk_scale):
    """Channels [COL0, COL0 + P) of the query rows, float32, times qk_scale: (R_PAD, P)."""
    return tl.load(q_rows[:, None] + COL0 + offs_p[None, :], mask=r_ok[:, None], other=0.0).to(tl.float32) * qk_scale


@triton.jit
def _scaled_p(p, vs_rows, row_ok, DOT_T: tl.constexpr):
    """``p * scale`` of one value group as DOT_T (R_PAD, BLOCK_N); vs_rows (BLOCK_N,) pointers to
    each token's scale of that group. (The zero term is accumulated apart.)"""
    vs = tl.load(vs_rows, mask=row_ok, other=0.0).to(tl.float32)  # (BLOCK_N,)
    return (p * vs[None, :]).to(DOT_T)


@triton.jit
def _zero_column(zacc, offs_z, G: tl.constexpr):
    """Column G of zacc (R_PAD, ZP) as (R_PAD, 1)."""
    return _column(zacc, offs_z, G)[:, None]


@triton.jit
def _tile_to_dot(t, STEP: tl.constexpr, IEEE: tl.constexpr):
    """(S, NL) tile of "f16" table values (STEP float16 codes each, little-endian) -> (S, NL * STEP)
    codes in channel order, float16 (float32 for the IEEE path). The table already holds the codes
    as float16 bit patterns: splitting a word into its 16-bit halves is all that is left (no
    integer-to-float conversion per code)."""
    if STEP == 1:
        c = t.to(tl.float16, bitcast=True)
    elif STEP == 2:
        j = tl.join(t.to(tl.int16).to(tl.float16, bitcast=True), (t >> 16).to(tl.int16).to(tl.float16, bitcast=True))
        c = tl.reshape(j, (t.shape[0], t.shape[1] * 2))  # [.., w, i] = code 2 w + i
    else:
        h0 = t.to(tl.int16).to(tl.float16, bitcast=True)
        h1 = (t >> 16).to(tl.int16).to(tl.float16, bitcast=True)
        h2 = (t >> 32).to(tl.int16).to(tl.float16, bitcast=True)
        h3 = (t >> 48).to(tl.int16).to(tl.float16, bitcast=True)
        j = tl.join(tl.join(h0, h2), tl.join(h1, h3))  # [.., w, a, b] = code 4 w + 2 a + b
        c = tl.reshape(j, (t.shape[0], t.shape[1] * 4))
    if IEEE:
        c = c.to(tl.float32)
    return c


@triton.jit
def _group_mask(offs_c, COL0: tl.constexpr, V_GROUP: tl.constexpr, g: tl.constexpr):
    """(CW,) True for the channels of chunk [COL0, COL0 + CW) that lie in its g-th value group."""
    return ((COL0 + offs_c) // V_GROUP) == (COL0 // V_GROUP + g)


@triton.jit
def _v_chunk(acc, p, c, vs_base, vrows, COL0: tl.constexpr, offs_c, row_ok, V_GROUP: tl.constexpr,
             G: tl.constexpr, DOT_T: tl.constexpr, IEEE: tl.constexpr):
    """``acc + sum_g (p * scale_g) @ codes_g`` for one value chunk (channels [COL0, COL0 + CW)): the
    per-token value scales folded into the probabilities, one product per value group of the chunk
    (G = max(1, CW / V_GROUP); with G > 1 each product sees only its group's columns). The zero
    term is accumulated apart (zacc)."""
    if G == 1:
        return _dot(_scaled_p(p, vs_base + vrows + COL0 // V_GROUP, row_ok, DOT_T), c, acc, IEEE)
    else:
        for g in tl.static_range(G):
            cg = tl.where(_group_mask(offs_c, COL0, V_GROUP, g)[None, :], c, 0.0)
            acc = _dot(_scaled_p(p, vs_base + vrows + COL0 // V_GROUP + g, row_ok, DOT_T), cg, acc, IEEE)
        return acc


@triton.jit
def _v_zero(acc, zacc, offs_z, offs_c, COL0: tl.constexpr, V_GROUP: tl.constexpr, G: tl.constexpr):
    """``acc + sum_n p_n zero_n`` of each channel's value group, from zacc (R_PAD, ZP)."""
    if G == 1:
        return acc + _zero_column(zacc, offs_z, COL0 // V_GROUP)
    else:
        for g in tl.static_range(G):
            acc += tl.where(_group_mask(offs_c, COL0, V_GROUP, g)[None, :],
                            _zero_column(zacc, offs_z, COL0 // V_GROUP + g), 0.0)
        return acc


# ---------------------------------------------------------------- kernel


@triton.jit(do_not_specialize=["S_TOT", "N", "KW", "VW", "K_CSH", "K_RSH", "K_ROFF", "V_CSH", "V_RSH", "V_ROFF",
                               "packed_pos", "F1_LEN", "f1_pos", "F2_LEN", "f2_pos",
                               "num_splits", "split_size", "n_f1_chunks"])
def _huffman_split_kernel(
    # query (B, Hq, D), last dim contiguous
    Q, stride_qb, stride_qh,
    # partial results, contiguous: m, l (B*Hq, S_TOT); acc (B*Hq, S_TOT, D); float32
    M_part, L_part, O_part, S_TOT,
    # key streams: payload (KW,) int32 view of uint32; start bit of stream (b*H+h)*N+n (B*H*N[+1],)
    # int64; raw flags (B*H*N,) uint8; decode tables (huffman_decode.DecodeTable, kind "f16"):
    # KLEN uint8 bits per lookup, KVAL K_STEP float16 codes per lookup; coded entries indexed by the
    # next 32 stream bits >> K_CSH, raw-stream entries from K_ROFF by the next 32 bits >> K_RSH
    KP, KW, KOFF, KRAW, KLEN, KVAL, K_CSH, K_RSH, K_ROFF,
    # key scale/zero (B, H, N / K_GROUP, D) float16, last dim contiguous, same strides
    KS, KZ, stride_ksb, stride_ksh, stride_ksn,
    # value streams, as the keys
    VP, VW, VOFF, VRAW, VLEN, VVAL, V_CSH, V_RSH, V_ROFF,
    # value scale/zero (B, H, N, D / V_GROUP) float16, last dim contiguous, same strides
    VS, VZ, stride_vsb, stride_vsh, stride_vsn,
    # valid packed range per batch [P_LO[b], P_HI[b]) (int32 (B,)), used when HAS_RANGE
    P_LO, P_HI, N,
    # visibility over absolute positions (B|1, L) uint8, used when HAS_MASK; stride_mb 0 = shared
    MASK, stride_mb, packed_pos,
    # full-precision segment 1 (sinks) and 2 (pending window): (B, H, F, D), last dim contiguous
    F1K, F1V, stride_f1kb, stride_f1kh, stride_f1kn, stride_f1vb, stride_f1vh, stride_f1vn, F1_LEN, f1_pos,
    F2K, F2V, stride_f2kb, stride_f2kh, stride_f2kn, stride_f2vb, stride_f2vh, stride_f2vn, F2_LEN, f2_pos,
    # work split: packed splits of split_size tokens (multiple of BLOCK_N), then fp chunks
    num_splits, split_size, n_f1_chunks,
    # softmax: scores * qk_scale are in log2 units (qk_scale = scaling * log2 e) unless softcap
    qk_scale, softcap,
    # shapes
    H, R: tl.constexpr, R_PAD: tl.constexpr, D: tl.constexpr, CW: tl.constexpr, NCH: tl.constexpr,
    # code layout: symbols per table lookup (1, 2 or 4), key / value groups
    K_STEP: tl.constexpr, V_STEP: tl.constexpr, K_GROUP: tl.constexpr, V_GROUP: tl.constexpr,
    G: tl.constexpr, NGV: tl.constexpr, ZP: tl.constexpr,
    # code paths
    HAS_RANGE: tl.constexpr, HAS_MASK: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    DOT_T: tl.constexpr, IEEE: tl.constexpr, FP_T: tl.constexpr, FP_IEEE: tl.constexpr, ASM: tl.constexpr,
    BLOCK_N: tl.constexpr, FP_BLOCK: tl.constexpr, FP_ONLY: tl.constexpr, RESCALE: tl.constexpr = 8.0,
):
    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1)
    if FP_ONLY:  # the second launch: program s is fp chunk s, partial column num_splits + s
        pid_s = pid_s + num_splits
    b = pid_bh // H
    h = pid_bh % H
    offs_r = tl.arange(0, R_PAD)
    r_ok = offs_r < R  # padding rows (tl.dot needs M >= 16) are computed, never stored
    q_rows = Q + b.to(tl.int64) * stride_qb + (h * R + offs_r) * stride_qh  # (R_PAD,) pointers
    part_row = (b * H * R + h * R + offs_r).to(tl.int64) * S_TOT + pid_s  # (R_PAD,)

    if not FP_ONLY:
        # ------------------------------------------------ packed split
        offs_c = tl.arange(0, CW)  # channels of a chunk, relative to its first channel
        offs_z = tl.arange(0, ZP)
        lo, hi, start, end = _split_range(P_LO, P_HI, b, N, pid_s, 1, split_size, BLOCK_N, HAS_RANGE, False)
        stream0 = pid_bh.to(tl.int64) * N  # stream of token 0 of this (b, h)
        ks_base = KS + b.to(tl.int64) * stride_ksb + h.to(tl.int64) * stride_ksh
        kz_base = KZ + b.to(tl.int64) * stride_ksb + h.to(tl.int64) * stride_ksh
        vs_base = VS + b.to(tl.int64) * stride_vsb + h.to(tl.int64) * stride_vsh
        vz_base = VZ + b.to(tl.int64) * stride_vsb + h.to(tl.int64) * stride_vsh

        m_i = tl.full([R_PAD], -1.0e30, tl.float32)  # finite: a fully masked block keeps alpha = 1
        l_i = tl.zeros([R_PAD], tl.float32)
        acc0 = tl.zeros([R_PAD, CW], tl.float32)  # one accumulator per chunk of CW channels
        acc1 = tl.zeros([R_PAD, CW], tl.float32)
        acc2 = tl.zeros([R_PAD, CW], tl.float32)
        acc3 = tl.zeros([R_PAD, CW], tl.float32)
        zacc = tl.zeros([R_PAD, ZP], tl.float32)  # sum_n p * zero, per value group (fold path)
        kbias = tl.zeros([R_PAD], tl.float32)  # q . key zero of the current key group
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            row_ok = offs_n < end
            valid = row_ok & (offs_n >= lo)
            if HAS_MASK:
                vis = tl.load(MASK + b * stride_mb + packed_pos + offs_n, mask=row_ok, other=0)
                valid = valid & (vis != 0)
            tok = stream0 + offs_n  # (BLOCK_N,) stream of each token; lanes past the end decode stream 0 (ignored)
            krow = (n0 // K_GROUP) * stride_ksn  # blocks never straddle a key group
            if ((n0 % K_GROUP) == 0) | (n0 == start):  # a new key group
                kbias = tl.zeros([R_PAD], tl.float32)
                for j in range(NCH):
                    kz = tl.load(kz_base + krow + j * CW + offs_c).to(tl.float32)  # (CW,)
                    kbias += tl.sum(_q_plane(q_rows, r_ok, offs_c + j * CW, 0, qk_scale) * kz[None, :], axis=1)
            # ---- keys: every lane decodes its token's D codes, CW at a time, straight into the
            # products; a runtime loop over the 4 chunks (the folded query chunk q * key scale is
            # rebuilt per chunk from L1: cheaper than holding 4 of them in registers, and it keeps
            # the unrolled code -- and the compile time -- small)
            kstart = tl.load(KOFF + tok, mask=row_ok, other=0)
            kraw = tl.load(KRAW + tok, mask=row_ok, other=0) != 0
            pw, lim, toff, sh, r, s, wa, wb, wc = _dec_start(KP, KW, kstart, kraw, K_CSH, K_RSH, K_ROFF)
            scores = tl.zeros([R_PAD, BLOCK_N], tl.float32)
            for j in range(NCH):
                r, s, wa, wb, wc, t = _dec_chunk(KLEN, KVAL, pw, lim, toff, sh, r, s, wa, wb, wc, 0, 0, CW // K_STEP,
                                                 False, ASM)
                ks = tl.load(ks_base + krow + j * CW + offs_c).to(tl.float32)  # (CW,)
                qs = (_q_plane(q_rows, r_ok, offs_c + j * CW, 0, qk_scale) * ks[None, :]).to(DOT_T)
                scores = _dot(qs, tl.trans(_tile_to_dot(t, K_STEP, IEEE)), scores, IEEE)
            scores = scores + kbias[:, None]
            if HAS_SOFTCAP:
                scores = _softcap(scores, softcap) * 1.4426950408889634
            scores = tl.where(valid[None, :], scores, float("-inf"))
            # ---- online softmax (log2 domain), lazily rescaled as in decode_attention.py: the
            # accumulators are only rescaled when a row's max grew by more than 2^RESCALE
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            if tl.max(m_new - m_i, axis=0) > RESCALE:
                alpha = tl.exp2(m_i - m_new)
                l_i = l_i * alpha
                acc0 = acc0 * alpha[:, None]
                acc1 = acc1 * alpha[:, None]
                acc2 = acc2 * alpha[:, None]
                acc3 = acc3 * alpha[:, None]
                zacc = zacc * alpha[:, None]
                m_i = m_new
            p = tl.exp2(scores - m_i[:, None])  # (R_PAD, BLOCK_N); masked -> 0
            l_i = l_i + tl.sum(p, axis=1)
            # ---- values: the same lane decode, each chunk straight into its accumulator
            vrows = offs_n * stride_vsn
            p_dot = p.to(DOT_T)
            vstart = tl.load(VOFF + tok, mask=row_ok, other=0)
            vraw = tl.load(VRAW + tok, mask=row_ok, other=0) != 0
            pw, lim, toff, sh, r, s, wa, wb, wc = _dec_start(VP, VW, vstart, vraw, V_CSH, V_RSH, V_ROFF)
            # one decoded chunk per iteration of a runtime loop (small code, fast compiles); the
            # uniform branches pick the chunk's accumulator (registers cannot be indexed)
            for j in range(NCH):
                r, s, wa, wb, wc, t = _dec_chunk(VLEN, VVAL, pw, lim, toff, sh, r, s, wa, wb, wc, 0, 0, CW // V_STEP,
                                                 False, ASM)
                c = _tile_to_dot(t, V_STEP, IEEE)
                if j == 0:
                    acc0 = _v_chunk(acc0, p, c, vs_base, vrows, 0, offs_c, row_ok, V_GROUP, G, DOT_T, IEEE)
                elif j == 1:
                    acc1 = _v_chunk(acc1, p, c, vs_base, vrows, CW, offs_c, row_ok, V_GROUP, G, DOT_T, IEEE)
                elif j == 2:
                    acc2 = _v_chunk(acc2, p, c, vs_base, vrows, 2 * CW, offs_c, row_ok, V_GROUP, G, DOT_T, IEEE)
                else:
                    acc3 = _v_chunk(acc3, p, c, vs_base, vrows, 3 * CW, offs_c, row_ok, V_GROUP, G, DOT_T, IEEE)
            # zero term of every value group at once: (R_PAD, BLOCK_N) @ (BLOCK_N, ZP)
            zt = tl.load(vz_base + vrows[:, None] + offs_z[None, :],
                         mask=row_ok[:, None] & (offs_z[None, :] < NGV), other=0.0).to(DOT_T)
            zacc = _dot(p_dot, zt, zacc, IEEE)
        acc0 = _v_zero(acc0, zacc, offs_z, offs_c, 0, V_GROUP, G)
        acc1 = _v_zero(acc1, zacc, offs_z, offs_c, CW, V_GROUP, G)
        if NCH > 2:
            acc2 = _v_zero(acc2, zacc, offs_z, offs_c, 2 * CW, V_GROUP, G)
            acc3 = _v_zero(acc3, zacc, offs_z, offs_c, 3 * CW, V_GROUP, G)
        tl.store(M_part + part_row, m_i, mask=r_ok)
        tl.store(L_part + part_row, l_i, mask=r_ok)
        o_rows = O_part + part_row * D  # (R_PAD,) pointers
        tl.store(o_rows[:, None] + offs_c[None, :], acc0, mask=r_ok[:, None])
        tl.store(o_rows[:, None] + CW + offs_c[None, :], acc1, mask=r_ok[:, None])
        if NCH > 2:
            tl.store(o_rows[:, None] + 2 * CW + offs_c[None, :], acc2, mask=r_ok[:, None])
            tl.store(o_rows[:, None] + 3 * CW + offs_c[None, :], acc3, mask=r_ok[:, None])
    else:
        # ------------------------------------------------ one chunk of a full-precision segment
        c = pid_s - num_splits
        if c < n_f1_chunks:
            _fp_chunk(q_rows, r_ok, part_row, M_part, L_part, O_part,
                      F1K + b.to(tl.int64) * stride_f1kb + h.to(tl.int64) * stride_f1kh,
                      F1V + b.to(tl.int64) * stride_f1vb + h.to(tl.int64) * stride_f1vh,
                      stride_f1kn, stride_f1vn, c * FP_BLOCK, F1_LEN, MASK + b * stride_mb + f1_pos,
                      qk_scale, softcap, R_PAD, D, HAS_MASK, HAS_SOFTCAP, FP_T, FP_IEEE, FP_BLOCK)
        else:
            _fp_chunk(q_rows, r_ok, part_row, M_part, L_part, O_part,
                      F2K + b.to(tl.int64) * stride_f2kb + h.to(tl.int64) * stride_f2kh,
                      F2V + b.to(tl.int64) * stride_f2vb + h.to(tl.int64) * stride_f2vh,
                      stride_f2kn, stride_f2vn, (c - n_f1_chunks) * FP_BLOCK, F2_LEN,
                      MASK + b * stride_mb + f2_pos,
                      qk_scale, softcap, R_PAD, D, HAS_MASK, HAS_SOFTCAP, FP_T, FP_IEEE, FP_BLOCK)


# ---------------------------------------------------------------- launcher


@dataclass(frozen=True)
class HuffmanAttentionConfig:
    """Tuning knobs (results do not depend on them beyond float rounding).

    - ``block_n``: tokens (decode lanes) per loop step; clamped to a divisor of ``k_group`` (the
      key-scale fold needs a block inside one key group), at least 32. ``num_warps`` is clamped to
      ``block_n / 32``: each thread decodes one key and one value stream per step (or several).
    - ``num_warps``, ``num_stages``: launch options of the split kernel.
    - ``programs_per_sm``, ``whole_waves``, ``min_split_blocks``, ``min_splits``, ``min_programs``, ``num_splits``,
      ``fp_block``: the split-K work division (:class:`kvcalib_kernels.decode.splits.SplitRule`; the fp chunks run
      as a second launch of the same kernel, with 4 warps: see the launcher).
    - ``max_index_bits``: decode 4 or 2 symbols per table lookup when that table has at most
      ``2**max_index_bits`` entries (at the default 12: 4 for 2-bit codes, 2 for 4-bit codes whose
      words have <= 6 bits; :func:`kvcalib_kernels.huffman_decode.choose_step`); 0 = one.
    - ``asm``: funnel shift by inline PTX (one instruction per peek); None = where the probe
      :func:`kvcalib_kernels.huffman_decode.funnel_shift_available` passes.
    """

    block_n: int = 64
    num_warps: int = 2
    num_stages: int = 1
    programs_per_sm: float = 16.0
    whole_waves: bool = False  # not re-tuned for this kernel (two warps per program): the rule it was measured with
    num_splits: int | None = None
    fp_block: int = 64
    min_split_blocks: int = 4
    min_splits: int = 1  # not re-tuned for this kernel: the split rule it was measured with
    min_programs: int = 0  # likewise (the few-rows rule of the fixed-width kernel, off)
    max_index_bits: int = MAX_INDEX_BITS
    asm: bool | None = None

    @property
    def split_rule(self) -> SplitRule:
        """The split-K fields as :func:`kvcalib_kernels.decode.splits._split_plan` reads them."""
        return SplitRule(self.programs_per_sm, self.num_splits, self.whole_waves, self.min_split_blocks,
                         self.min_splits, self.min_programs)

    def __post_init__(self) -> None:
        mib = self.max_index_bits
        if isinstance(mib, bool) or not isinstance(mib, int) or not 0 <= mib <= 16:
            raise ValueError(f"max_index_bits must be an int in 0..16, got {self.max_index_bits!r}")
        if self.asm not in (None, True, False):
            raise ValueError(f"asm must be None, True or False, got {self.asm!r}")
        for name in ("block_n", "fp_block"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {v!r}")
        if self.num_warps not in (1, 2, 4, 8):
            raise ValueError(f"num_warps must be 1, 2, 4 or 8, got {self.num_warps!r}")
        if isinstance(self.num_stages, bool) or not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"num_stages must be a positive int, got {self.num_stages!r}")
        if not self.programs_per_sm > 0:
            raise ValueError(f"programs_per_sm must be > 0, got {self.programs_per_sm!r}")
        if not isinstance(self.min_split_blocks, int) or self.min_split_blocks < 1:
            raise ValueError(f"min_split_blocks must be a positive int, got {self.min_split_blocks!r}")
        if not isinstance(self.min_splits, int) or self.min_splits < 1:
            raise ValueError(f"min_splits must be a positive int, got {self.min_splits!r}")
        if self.num_splits is not None and (not isinstance(self.num_splits, int) or self.num_splits < 1):
            raise ValueError(f"num_splits must be None or a positive int, got {self.num_splits!r}")


DEFAULT_CONFIG = HuffmanAttentionConfig()


def supports(*, head_dim: int, k_bits: int, v_bits: int, k_group: int, v_group: int, k_axis: str = "channel",
             rep: int = 1, block_n: int = DEFAULT_CONFIG.block_n) -> str | None:
    """None when :func:`decode_attention_huffman` handles this layout, else the reason it does not."""
    if head_dim not in (64, 128):
        return f"head_dim {head_dim} is not 64 or 128 (the Huffman kernel decodes 4 chunks of 16 or 32 channels)"
    for side, bits in (("k", k_bits), ("v", v_bits)):
        if bits not in (2, 4, 8):
            return f"{side}_bits {bits} is not 2, 4 or 8"
    if k_axis != "channel":
        return f"k_axis {k_axis!r}: only per-channel keys (k_axis='channel', KIVI) are Huffman-decoded in attention"
    if isinstance(k_group, bool) or not isinstance(k_group, int) or k_group < 1 or _pow2_divisor(k_group, block_n) < 32:
        return (f"k_group {k_group} has no power-of-two divisor >= 32 (with block_n {block_n}): a block of tokens "
                f"must lie in one key group and give every thread of a warp its own stream")
    if isinstance(v_group, bool) or not isinstance(v_group, int) or v_group < 1 or head_dim % v_group:
        return f"v_group {v_group} does not divide head_dim {head_dim}"
    if v_group < 8:
        return f"v_group {v_group} < 8 (a 32-channel chunk would need more than 4 products, one per value group)"
    if rep < 1 or rep > 64:
        return f"{rep} query heads per kv head is outside [1, 64]"
    return None


def _side(blocks, codebook, scale, zero, name: str, shape_sc, n_streams: int, d: int, validate: bool,
          max_index_bits: int):
    """Checks of one Huffman-coded side; returns (payload int32, offsets, raw uint8, table)."""
    if not isinstance(blocks, EncodedBlocks):
        raise ValueError(f"{name}_blocks must be EncodedBlocks, got {type(blocks).__name__}")
    if not isinstance(codebook, Codebook):
        raise ValueError(f"{name}_codebook must be a Codebook, got {type(codebook).__name__}")
    if blocks.bits != codebook.bits:
        raise ValueError(f"{name}: blocks hold {blocks.bits}-bit symbols but the codebook is {codebook.bits}-bit")
    if blocks.n_symbols != d or blocks.n_streams != n_streams:
        raise ValueError(f"{name}_blocks must hold B*H*N = {n_streams} streams of D = {d} symbols (one per token, "
                         f"channel order), got {blocks.n_streams} streams of {blocks.n_symbols}")
    _check_block_tensors(blocks.payload, blocks.bit_offsets, blocks.raw_fallback, f"{name}_blocks")
    for what, t in ((f"{name}_scale", scale), (f"{name}_zero", zero)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float16 or tuple(t.shape) != shape_sc:
            got = (t.dtype, tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{what} must be float16 {shape_sc}, got {got}")
        if t.stride(3) != 1:
            raise ValueError(f"{what}: the last dim must be contiguous")
    if scale.stride() != zero.stride():
        raise ValueError(f"{name}_scale and {name}_zero must have the same strides")
    if blocks.payload.device != scale.device:
        raise ValueError(f"{name}_blocks are on {blocks.payload.device}, {name}_scale on {scale.device}")
    if validate:
        validate_streams(blocks.payload, blocks.bit_offsets, blocks.raw_fallback, n_symbols=d, bits=blocks.bits,
                         name=f"{name}_blocks")
    table: DecodeTable = decode_table(codebook, blocks.payload.device, kind="f16",
                                      step=choose_step(codebook, 32, max_index_bits))
    raw = blocks.raw_fallback.view(torch.uint8)
    return blocks.payload.view(torch.int32), blocks.bit_offsets, raw, table


def _launch(q, k_blocks, k_scale, k_zero, v_blocks, v_scale, v_zero, *, k_codebook, v_codebook, k_group, v_group,
            k_axis, scaling, softcap, packed_start, packed_end, packed_position, fp_segments, fp_positions, mask,
            config: HuffmanAttentionConfig, validate: bool) -> torch.Tensor:
    """Check shapes/dtypes/contiguity/layout, launch split + combine kernels.

    Shapes: q (B, Hq, D); k_blocks/v_blocks: B*H*N streams of D symbols, stream (b*H + h)*N + n;
    k_scale/k_zero f16 (B, H, N/k_group, D); v_scale/v_zero f16 (B, H, N, D/v_group);
    fp segments (B, H, F, D); mask (B|1, L) bool/u8; packed_start/end (B,) int. N is read from
    v_scale. Returns float32 (B, Hq, D).
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q must be (B, Hq, D) float16/bfloat16/float32, got "
                         f"{(tuple(q.shape), q.dtype) if isinstance(q, torch.Tensor) else type(q).__name__}")
    _check_device(q)
    if q.stride(2) != 1:
        q = q.contiguous()
    bsz, hq, d = q.shape
    dev = q.device
    if (k_blocks is None) != (v_blocks is None):
        raise ValueError("k_blocks and v_blocks must both be given or both be None")
    fp = [tuple(s) for s in fp_segments if s is not None and s[0] is not None and s[0].shape[2] > 0]
    positions = list(fp_positions) or [0] * len(fp_segments)
    fp_pos = [p for s, p in zip(fp_segments, positions) if s is not None and s[0] is not None and s[0].shape[2] > 0]
    if len(fp) > 2:
        raise ValueError(f"at most two full-precision segments, got {len(fp)}")
    if k_blocks is not None:
        if not isinstance(v_scale, torch.Tensor) or v_scale.dim() != 4:
            raise ValueError("v_scale must be a float16 (B, H, N, D / v_group) tensor")
        h, n = int(v_scale.shape[1]), int(v_scale.shape[2])
    elif fp:
        h, n = fp[0][0].shape[1], 0
    else:
        return torch.zeros((bsz, hq, d), dtype=torch.float32, device=dev)
    if hq % h:
        raise ValueError(f"query heads {hq} are not a multiple of kv heads {h}")
    rep = hq // h
    k_bits = k_codebook.bits if isinstance(k_codebook, Codebook) else None
    v_bits = v_codebook.bits if isinstance(v_codebook, Codebook) else None
    if k_blocks is not None and (k_bits is None or v_bits is None):
        raise ValueError("k_codebook and v_codebook must be Codebooks")
    why = supports(head_dim=d, k_bits=k_bits or 2, v_bits=v_bits or 2, k_group=k_group, v_group=v_group,
                   k_axis=k_axis, rep=rep, block_n=config.block_n)
    if why:
        raise ValueError(f"decode_attention_huffman does not support this layout: {why}")
    for i, pair in enumerate(fp):
        _check_fp(pair, bsz, h, d, i)
    if n:
        if n % k_group:
            raise ValueError(f"per-channel keys: N={n} must be a multiple of k_group={k_group}")
        kp, koff, kraw, ktab = _side(k_blocks, k_codebook, k_scale, k_zero, "k", (bsz, h, n // k_group, d),
                                     bsz * h * n, d, validate, config.max_index_bits)
        vp, voff, vraw, vtab = _side(v_blocks, v_codebook, v_scale, v_zero, "v", (bsz, h, n, d // v_group),
                                     bsz * h * n, d, validate, config.max_index_bits)
    fp_dtype = fp[0][0].dtype if fp else torch.float32
    if fp and any(s[0].dtype != fp_dtype for s in fp):
        raise ValueError("both full-precision segments must share a dtype")

    # ---- compile-time choices
    interp = _interpreting()
    ieee = q.dtype == torch.float32
    dot_t = tl.float32 if ieee else tl.float16
    cw = 32  # channels per decoded chunk (2 or 4 chunks)
    block_n = _pow2_divisor(k_group, config.block_n)
    groups_per_chunk = max(1, cw // v_group)
    ngv = d // v_group
    zp = max(16, triton.next_power_of_2(ngv))
    r_pad = max(16, triton.next_power_of_2(rep))
    fp_t = tl.float32 if (fp_dtype == torch.float32 or interp) else _tl_dtype(fp_dtype)
    fp_ieee = fp_dtype == torch.float32 or interp
    fp_block = max(16, min(config.fp_block, 8192 // d))
    asm = config.asm
    if asm is None:
        asm = dev.type == "cuda" and funnel_shift_available(dev.index or 0)

    # ---- work split
    f_lens = [s[0].shape[2] for s in fp]
    splits, split_size, chunks, s_tot, (m_part, l_part, o_part, out) = _work_split(
        n, block_n, f_lens, fp_block, bsz, h, hq, d, dev, config.split_rule)
    if s_tot == 0:
        return out.zero_()

    # ---- arguments (dummies where a part is absent; their code is never reached)
    if n:
        kss, vss = k_scale.stride()[:3], v_scale.stride()[:3]
        k_args = (kp, kp.numel(), koff, kraw, ktab.lengths, ktab.values, 32 - ktab.coded_bits, 32 - ktab.raw_bits,
                  ktab.raw_off)
        v_args = (vp, vp.numel(), voff, vraw, vtab.lengths, vtab.values, 32 - vtab.coded_bits, 32 - vtab.raw_bits,
                  vtab.raw_off)
        k_step, v_step = ktab.step, vtab.step
        ks, kz, vs, vz = k_scale, k_zero, v_scale, v_zero
    else:
        d32, d64, d8, d16 = (_dummy(dev, t) for t in (torch.int32, torch.int64, torch.uint8, torch.int16))
        k_args = v_args = (d32, 1, d64, d8, d8, d16, 30, 30, 8)
        k_step = v_step = 1
        ks = kz = vs = vz = _dummy(dev, torch.float16)
        kss = vss = (0, 0, 0)
    has_range, lo, hi = _packed_range(packed_start, packed_end, bsz, n, dev)
    has_mask, mk, stride_mb = _visibility(mask, bsz, dev)
    segs = _fp_segment_args(fp, fp_pos, f_lens, fp_dtype, dev)
    n_f1 = chunks[0] if fp else 0
    if softcap:
        qk_scale, cap = float(scaling), float(softcap)
    else:
        qk_scale, cap = float(scaling) * LOG2E, 1.0

    args = (q, q.stride(0), q.stride(1),
            m_part, l_part, o_part, max(s_tot, 1),
            *k_args, ks, kz, *kss,
            *v_args, vs, vz, *vss,
            lo, hi, n,
            mk, stride_mb, int(packed_position),
            *segs[0], *segs[1],
            splits, split_size, n_f1,
            qk_scale, cap, h)
    consts = dict(R=rep, R_PAD=r_pad, D=d, CW=cw, NCH=d // cw,
                  K_STEP=k_step, V_STEP=v_step, K_GROUP=k_group, V_GROUP=v_group, G=groups_per_chunk, NGV=ngv, ZP=zp,
                  HAS_RANGE=has_range, HAS_MASK=has_mask, HAS_SOFTCAP=bool(softcap),
                  DOT_T=dot_t, IEEE=ieee, FP_T=fp_t, FP_IEEE=fp_ieee, ASM=asm,
                  BLOCK_N=block_n, FP_BLOCK=fp_block)
    # Two launches of one kernel: the packed splits, then the fp chunks. One launch would give the
    # decode loop the register allocation of the fp branch ((FP_BLOCK, D) K/V tiles and a (R_PAD, D)
    # accumulator: > 200 registers on one warp), i.e. a fraction of the occupancy it needs to hide
    # the latency of its table lookups.
    if splits:
        # one decode lane per thread at most: a warp with fewer streams than threads would hold
        # replicated lanes, which the GPU compiler's layout conversions have got wrong (Triton 3.6)
        warps = max(1, min(config.num_warps, block_n // 32))
        _huffman_split_kernel[(bsz * h, splits)](*args, **consts, FP_ONLY=False,
                                                 num_warps=warps, num_stages=config.num_stages)
    if s_tot > splits:
        _huffman_split_kernel[(bsz * h, s_tot - splits)](*args, **consts, FP_ONLY=True, num_warps=4, num_stages=1)
    _combine(m_part, l_part, o_part, s_tot, out)
    return out


# ---------------------------------------------------------------- public function


def decode_attention_huffman(
    q: torch.Tensor,
    k_blocks: EncodedBlocks | None,
    k_scale: torch.Tensor | None,
    k_zero: torch.Tensor | None,
    v_blocks: EncodedBlocks | None,
    v_scale: torch.Tensor | None,
    v_zero: torch.Tensor | None,
    *,
    k_codebook: Codebook | None,
    v_codebook: Codebook | None,
    k_group: int,
    v_group: int,
    k_axis: str = "channel",
    scaling: float,
    softcap: float | None = None,
    packed_start: torch.Tensor | None = None,
    packed_end: torch.Tensor | None = None,
    packed_position: int = 0,
    fp_segments: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
    fp_positions: Sequence[int] = (),
    mask: torch.Tensor | None = None,
    config: HuffmanAttentionConfig | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """Attention of one query token per sequence over a Huffman-coded + full-precision KV cache.

    Same arguments and result as :func:`kvcalib_kernels.reference.decode_attention_huffman_reference`
    (float32 ``(B, Hq, D)``); as :func:`kvcalib_kernels.decode_attention.decode_attention` with
    ``k_codes``/``v_codes`` replaced by ``k_blocks``/``v_blocks`` (``B*H*N`` streams of ``D``
    codes, stream ``(b*H + h)*N + n``) and the bit widths by the codebooks, plus ``config``
    (:class:`HuffmanAttentionConfig`, tuning only) and ``validate`` (structure checks of both
    blocks, one device sync each; False for CUDA graphs). Runs on CUDA tensors, or on CPU tensors
    under ``TRITON_INTERPRET=1``. Raises ValueError on shapes, dtypes or layouts it does not
    handle (:func:`supports` says which, without raising) and HuffmanError (a ValueError) on
    corrupt block structure.
    """
    cfg = config or DEFAULT_CONFIG
    if not isinstance(cfg, HuffmanAttentionConfig):
        raise ValueError(f"config must be a HuffmanAttentionConfig, got {type(cfg).__name__}")
    return _launch(q, k_blocks, k_scale, k_zero, v_blocks, v_scale, v_zero, k_codebook=k_codebook,
                   v_codebook=v_codebook, k_group=k_group, v_group=v_group, k_axis=k_axis, scaling=scaling,
                   softcap=softcap, packed_start=packed_start, packed_end=packed_end,
                   packed_position=packed_position, fp_segments=fp_segments, fp_positions=fp_positions, mask=mask,
                   config=cfg, validate=validate)

