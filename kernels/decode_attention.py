"""Split-K flash-decoding over a packed 2/4/8-bit KV cache (one query token per sequence).

What one call computes (the specification is
:func:`kvcalib_kernels.reference.decode_attention_reference`): softmax attention of ``q``
``(B, Hq, D)`` over

- N packed tokens: K codes planar-packed along D with per-channel scales over groups of
  ``k_group`` tokens (KIVI keys, ``k_axis="channel"``) or per-token scales over groups of
  ``k_group`` channels (``k_axis="token"``); V codes with per-token scales over groups of
  ``v_group`` channels. Bits 2, 4 or 8 per side (compile-time constants);
- up to two full-precision segments ``(B, H, F, D)`` (the cache's sinks and pending window),
- an OTT outlier pool ``(B, H, P, D)`` at int32 absolute positions ``(B, H, P)`` (-1 = empty),
  with per-kv-head quant masks of the packed slots (the cache's ``keep`` bytes, one bit per
  token in blocks of ``keep_block``; a 0 bit: the token lives in the pool, its slot is skipped),

with a per-batch valid range of packed tokens and an optional visibility mask over absolute
positions (padding). Packed sides may carry an SKVQ channel permutation ``(H, D)`` (the query is
read at each stored key channel's input channel; value channels are stored back at theirs) and a
TaDA per-token mean ``(B, 1, N, D)`` shared by the kv heads, 16-bit or 8-bit codes with per-token
scale/zero (``q . mean`` joins each score, ``sum p * mean`` each value plane, in the same pass).

Two launches (:func:`decode_attention_parts`: one split launch per stored part, e.g. a PATS tier
store, each writing its own columns of one partial buffer, then one combine):

1. ``_decode_split_kernel``, grid ``(B * H, S_packed + S_fp)`` (fp chunks: sinks, window, pool). Program ``(b*H + h, s)`` holds
   all ``R = Hq / H`` query heads of kv head ``h`` (rows of one ``(R_PAD, .)`` tile, so each K/V
   byte is read once per GQA group). ``s < S_packed``: a contiguous split of the packed tokens,
   walked in blocks of ``BLOCK_N`` tokens with an online softmax; ``s >= S_packed``: one
   ``FP_BLOCK``-token chunk of a full-precision segment (the fp segment runs in the same launch,
   in parallel with the packed splits, instead of serially in the reduction). Each program writes
   a partial ``(m, l, acc)`` (log2 domain) for its rows.
2. ``_combine_kernel``, grid ``(B * Hq, D / DB)``: log-sum-exp merge of all partials of a row,
   channels split over programs (:func:`_combine`).

Arithmetic (what keeps the per-code work small):

- codes become float16 without int->float conversions (which run at a quarter of the integer
  rate). ``unpack=5`` (the default on GPU, once checked per layout): one AND-OR per pair of
  codes -- the 32-bit register of 4 packed bytes holds bytes 0 and 2 in its two 16-bit lanes
  (1 and 3 after one shift), the code bits stay in place and the float16 exponent of 1024 is set
  around them, so a lane reads exactly ``1024 + code * 2**shift``; the 1024 and the 2**shift are
  folded into the key bias / query planes and into the value accumulators (below), the lane
  order (bytes 0, 2, 1, 3) is undone on the query channels (keys) and on the loaded value rows.
  The folded sides unpack every plane of a tile in one PTX block (:func:`_code_planes`: the
  exponent byte set once per 4 bytes by two ``prmt``, then one AND with an immediate per pair of
  codes and plane). ``unpack=6`` is that arithmetic in Triton ops (the interpreter's default). ``unpack=2``: a few
  PTX instructions per 4 codes (``prmt`` into 16-bit lanes, OR the exponent, ``sub.f16x2``);
  ``unpack=3`` reads int32 words and keeps register pairs whole; ``1``/``4`` are those in Triton
  ops; ``unpack=0`` converts with ``.to``.
- per-channel key scales are folded into the query once per key group (blocks never straddle
  a group): ``q . (c * s + z) = (q * s) . c + q . z``, so K needs no per-element
  dequantization; the products run on the tensor cores (float16 operands, float32 accumulation).
- per-token value scales are folded into the probabilities when a plane of channels lies in one
  value group (``v_group >= D * v_bits / 8``): ``sum_n p_n (c_n s_n + z_n) = (p * s) @ c + p @ z``;
  ``p * s`` is built once per value group, the zero term of all groups is one small extra
  product; with the lane unpack, ``sum_n p_n s_n`` per value group takes the 1024 back out.
  Value groups narrower than a plane (at most 4 per head; e.g. 4-bit, head_dim 128, group 32)
  fold per (plane, chunk of ``v_group`` byte columns), one accumulator per value group
  (``V_NCH`` chunks). Smaller value groups (and per-token keys) dequantize per element instead
  (general, about half the speed; they take the byte unpack).
- the online softmax rescales lazily (only when a row's running max grows by more than 2^8).
- float32 queries run the products in IEEE float32 (no tf32), float16/bfloat16 queries in
  float16 with float32 accumulation.
- one warp per program and 4-row query tiles (see :class:`DecodeConfig`), parallelism from many
  split programs.

Performance status (H200, ``artifacts/bench/decode_attention.md``, CUDA-graph time): Mistral-7B
shape, 32k, batch 8: 3.5x over the fastest bf16 SDPA at 2 bits, 2.7x at 4 bits, 1.7x at 4 bits
group 32 (values in per-group accumulators, two key groups per block in halves); batch 1 GPU time
1.35-2.5x at 4k-32k on the three benchmark shapes (``decode_latency.json``); every row of the grid
faster than bf16 (the Qwen shape at 4-bit group 32, batch 1, the closest: 1.02-1.06x); OTT pools
cost 1.24x plain, TaDA means 4.3x (every kv head's program reads the shared mean and runs a
full-width product with it; ``decode_fitted.json``); PATS tier stores
(:func:`decode_attention_parts`, one split launch per store, one combine) 1.26x plain at batch 8 /
32k. Both products run transposed: the key product's M rows are the block's tokens and the value
product's the channels (value codes read as int16 units, loaded as a (units, tokens) tile), the
GQA group's query rows the small N of both; the kernel is bound by instruction issue, not by memory.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import triton
import triton.language as tl

from kvcalib_kernels.launch import FastLauncher

__all__ = ["DecodeConfig", "decode_attention", "decode_attention_parts", "supports", "fast_unpack_available"]

LOG2E = 1.4426950408889634  # exp(x) = exp2(x * log2(e)): the kernels use exp2


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# ---------------------------------------------------------------- device helpers


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """``acc + a @ b``; IEEE float32 products for float32 operands (tf32 would lose ~1e-3)."""
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _unpack_asm(x, SHIFT: tl.constexpr, BITS: tl.constexpr):
    """uint8 tile -> float16 codes ``(x >> SHIFT) & (2**BITS - 1)``, 4 bytes per asm call.

    ``prmt`` spreads bytes 0,1 (2,3) of the 32-bit word into the two 16-bit lanes of one
    register, AND keeps the code bits, OR sets the float16 exponent of 1024 (0x6400: the lane
    reads as 1024 + code exactly), ``sub.f16x2`` removes the 1024. Shift and mask are literals,
    hence one branch per (BITS, SHIFT).
    """
    if BITS == 2:
        if SHIFT == 0:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 r_t, r_a, r_b, r_z, r_k; mov.b32 r_t, $2; mov.b32 r_z, 0; "
                "prmt.b32 r_a, r_t, r_z, 0x4140; prmt.b32 r_b, r_t, r_z, 0x4342; "
                "and.b32 r_a, r_a, 0x00030003; and.b32 r_b, r_b, 0x00030003; "
                "or.b32 r_a, r_a, 0x64006400; or.b32 r_b, r_b, 0x64006400; mov.b32 r_k, 0x64006400; "
                "sub.f16x2 $0, r_a, r_k; sub.f16x2 $1, r_b, r_k; }",
                "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)
        elif SHIFT == 2:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 r_t, r_a, r_b, r_z, r_k; shr.b32 r_t, $2, 2; mov.b32 r_z, 0; "
                "prmt.b32 r_a, r_t, r_z, 0x4140; prmt.b32 r_b, r_t, r_z, 0x4342; "
                "and.b32 r_a, r_a, 0x00030003; and.b32 r_b, r_b, 0x00030003; "
                "or.b32 r_a, r_a, 0x64006400; or.b32 r_b, r_b, 0x64006400; mov.b32 r_k, 0x64006400; "
                "sub.f16x2 $0, r_a, r_k; sub.f16x2 $1, r_b, r_k; }",
                "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)
        elif SHIFT == 4:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 r_t, r_a, r_b, r_z, r_k; shr.b32 r_t, $2, 4; mov.b32 r_z, 0; "
                "prmt.b32 r_a, r_t, r_z, 0x4140; prmt.b32 r_b, r_t, r_z, 0x4342; "
                "and.b32 r_a, r_a, 0x00030003; and.b32 r_b, r_b, 0x00030003; "
                "or.b32 r_a, r_a, 0x64006400; or.b32 r_b, r_b, 0x64006400; mov.b32 r_k, 0x64006400; "
                "sub.f16x2 $0, r_a, r_k; sub.f16x2 $1, r_b, r_k; }",
                "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)
        else:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 r_t, r_a, r_b, r_z, r_k; shr.b32 r_t, $2, 6; mov.b32 r_z, 0; "
                "prmt.b32 r_a, r_t, r_z, 0x4140; prmt.b32 r_b, r_t, r_z, 0x4342; "
                "and.b32 r_a, r_a, 0x00030003; and.b32 r_b, r_b, 0x00030003; "
                "or.b32 r_a, r_a, 0x64006400; or.b32 r_b, r_b, 0x64006400; mov.b32 r_k, 0x64006400; "
                "sub.f16x2 $0, r_a, r_k; sub.f16x2 $1, r_b, r_k; }",
                "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)
    elif BITS == 4:
        if SHIFT == 0:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 r_t, r_a, r_b, r_z, r_k; mov.b32 r_t, $2; mov.b32 r_z, 0; "
                "prmt.b32 r_a, r_t, r_z, 0x4140; prmt.b32 r_b, r_t, r_z, 0x4342; "
                "and.b32 r_a, r_a, 0x000F000F; and.b32 r_b, r_b, 0x000F000F; "
                "or.b32 r_a, r_a, 0x64006400; or.b32 r_b, r_b, 0x64006400; mov.b32 r_k, 0x64006400; "
                "sub.f16x2 $0, r_a, r_k; sub.f16x2 $1, r_b, r_k; }",
                "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)
        else:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 r_t, r_a, r_b, r_z, r_k; shr.b32 r_t, $2, 4; mov.b32 r_z, 0; "
                "prmt.b32 r_a, r_t, r_z, 0x4140; prmt.b32 r_b, r_t, r_z, 0x4342; "
                "and.b32 r_a, r_a, 0x000F000F; and.b32 r_b, r_b, 0x000F000F; "
                "or.b32 r_a, r_a, 0x64006400; or.b32 r_b, r_b, 0x64006400; mov.b32 r_k, 0x64006400; "
                "sub.f16x2 $0, r_a, r_k; sub.f16x2 $1, r_b, r_k; }",
                "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 r_t, r_a, r_b, r_z, r_k; mov.b32 r_t, $2; mov.b32 r_z, 0; "
            "prmt.b32 r_a, r_t, r_z, 0x4140; prmt.b32 r_b, r_t, r_z, 0x4342; "
            "or.b32 r_a, r_a, 0x64006400; or.b32 r_b, r_b, 0x64006400; mov.b32 r_k, 0x64006400; "
            "sub.f16x2 $0, r_a, r_k; sub.f16x2 $1, r_b, r_k; }",
            "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)


@triton.jit
def _unpack_words_asm(w, SHIFT: tl.constexpr, BITS: tl.constexpr):
    """int32 words (4 packed bytes) -> 4 float16 tiles: plane codes of bytes 0..3 of each word.

    Two shifted copies of the word put bytes (0, 2) and (1, 3) into the two 16-bit lanes; AND
    keeps the code bits, OR sets the float16 exponent of 1024, ``sub.f16x2`` removes 1024, and
    the lanes are returned as separate halves: 6 instructions per 4 codes, no byte shuffles.
    """
    if BITS == 2:
        if SHIFT == 0:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 r_a, r_b, r_k; mov.b32 r_a, $4; shr.b32 r_b, $4, 8; "
                "and.b32 r_a, r_a, 0x00030003; and.b32 r_b, r_b, 0x00030003; "
                "or.b32 r_a, r_a, 0x64006400; or.b32 r_b, r_b, 0x64006400; mov.b32 r_k, 0x64006400; "
                "sub.f16x2 r_a, r_a, r_k; sub.f16x2 r_b, r_b, r_k; mov.b32 {$0, $2}, r_a; mov.b32 {$1, $3}, r_b; }",
                "=h,=h,=h,=h,r", [w], dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=1)
        elif SHIFT == 2:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 r_a, r_b, r_k; shr.b32 r_a, $4, 2; shr.b32 r_b, $4, 10; "
                "and.b32 r_a, r_a, 0x00030003; and.b32 r_b, r_b, 0x00030003; "
                "or.b32 r_a, r_a, 0x64006400; or.b32 r_b, r_b, 0x64006400; mov.b32 r_k, 0x64006400; "
                "sub.f16x2 r_a, r_a, r_k; sub.f16x2 r_b, r_b, r_k; mov.b32 {$0, $2}, r_a; mov.b32 {$1, $3}, r_b; }",
                "=h,=h,=h,=h,r", [w], dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=1)
        elif SHIFT == 4:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 r_a, r_b, r_k; shr.b32 r_a, $4, 4; shr.b32 r_b, $4, 12; "
                "and.b32 r_a, r_a, 0x00030003; and.b32 r_b, r_b, 0x00030003; "
                "or.b32 r_a, r_a, 0x64006400; or.b32 r_b, r_b, 0x64006400; mov.b32 r_k, 0x64006400; "
                "sub.f16x2 r_a, r_a, r_k; sub.f16x2 r_b, r_b, r_k; mov.b32 {$0, $2}, r_a; mov.b32 {$1, $3}, r_b; }",
                "=h,=h,=h,=h,r", [w], dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 r_a, r_b, r_k; shr.b32 r_a, $4, 6; shr.b32 r_b, $4, 14; "
                "and.b32 r_a, r_a, 0x00030003; and.b32 r_b, r_b, 0x00030003; "
                "or.b32 r_a, r_a, 0x64006400; or.b32 r_b, r_b, 0x64006400; mov.b32 r_k, 0x64006400; "
                "sub.f16x2 r_a, r_a, r_k; sub.f16x2 r_b, r_b, r_k; mov.b32 {$0, $2}, r_a; mov.b32 {$1, $3}, r_b; }",
                "=h,=h,=h,=h,r", [w], dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=1)
    elif BITS == 4:
        if SHIFT == 0:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 r_a, r_b, r_k; mov.b32 r_a, $4; shr.b32 r_b, $4, 8; "
                "and.b32 r_a, r_a, 0x000F000F; and.b32 r_b, r_b, 0x000F000F; "
                "or.b32 r_a, r_a, 0x64006400; or.b32 r_b, r_b, 0x64006400; mov.b32 r_k, 0x64006400; "
                "sub.f16x2 r_a, r_a, r_k; sub.f16x2 r_b, r_b, r_k; mov.b32 {$0, $2}, r_a; mov.b32 {$1, $3}, r_b; }",
                "=h,=h,=h,=h,r", [w], dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 r_a, r_b, r_k; shr.b32 r_a, $4, 4; shr.b32 r_b, $4, 12; "
                "and.b32 r_a, r_a, 0x000F000F; and.b32 r_b, r_b, 0x000F000F; "
                "or.b32 r_a, r_a, 0x64006400; or.b32 r_b, r_b, 0x64006400; mov.b32 r_k, 0x64006400; "
                "sub.f16x2 r_a, r_a, r_k; sub.f16x2 r_b, r_b, r_k; mov.b32 {$0, $2}, r_a; mov.b32 {$1, $3}, r_b; }",
                "=h,=h,=h,=h,r", [w], dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 r_a, r_b, r_k; mov.b32 r_a, $4; shr.b32 r_b, $4, 8; "
            "and.b32 r_a, r_a, 0x00FF00FF; and.b32 r_b, r_b, 0x00FF00FF; "
            "or.b32 r_a, r_a, 0x64006400; or.b32 r_b, r_b, 0x64006400; mov.b32 r_k, 0x64006400; "
            "sub.f16x2 r_a, r_a, r_k; sub.f16x2 r_b, r_b, r_k; mov.b32 {$0, $2}, r_a; mov.b32 {$1, $3}, r_b; }",
            "=h,=h,=h,=h,r", [w], dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=1)



def _lane_asm(bits: int, shift: int) -> str:
    """PTX for :func:`_unpack_lanes_asm`: one AND-OR (a LOP3) per pair of codes, no shuffles."""
    m = ((1 << bits) - 1) << shift
    mask = f"0x{m:04X}{m:04X}"
    return ("{ .reg .b32 r_h; shr.b32 r_h, $2, 8; "
            f"and.b32 $0, $2, {mask}; or.b32 $0, $0, 0x64006400; "
            f"and.b32 $1, r_h, {mask}; or.b32 $1, $1, 0x64006400; }}")


_LANE_2_0 = tl.constexpr(_lane_asm(2, 0))
_LANE_2_2 = tl.constexpr(_lane_asm(2, 2))
_LANE_2_4 = tl.constexpr(_lane_asm(2, 4))
_LANE_2_6 = tl.constexpr(_lane_asm(2, 6))
_LANE_4_0 = tl.constexpr(_lane_asm(4, 0))
_LANE_4_4 = tl.constexpr(_lane_asm(4, 4))
_LANE_8_0 = tl.constexpr(_lane_asm(8, 0))


@triton.jit
def _unpack_lanes_asm(x, SHIFT: tl.constexpr, BITS: tl.constexpr):
    """uint8 tile -> float16 ``1024 + (x & (mask << SHIFT))``, bytes of each 4 paired by lane.

    The fastest unpack (``unpack=5``): the 32-bit register of 4 bytes b0..b3 already holds b0 and
    b2 in the low bits of its two 16-bit lanes (b1, b3 after one shift by 8, shared by all planes),
    so one AND-OR per pair of codes sets the float16 exponent of 1024 around the code bits left in
    place: the lane reads exactly ``1024 + code * 2**SHIFT``. Neither the 1024 nor the ``2**SHIFT``
    is removed here: the kernel folds both into the key bias / query plane and the value
    accumulator (module doc). The outputs come back as (b0, b2, b1, b3): element k of each 4 holds
    byte :func:`_perm4` (k), which the kernel undoes by permuting the query channels (keys) or the
    loaded token rows (values).
    """
    if BITS == 2:
        if SHIFT == 0:
            return tl.inline_asm_elementwise(_LANE_2_0, "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)
        elif SHIFT == 2:
            return tl.inline_asm_elementwise(_LANE_2_2, "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)
        elif SHIFT == 4:
            return tl.inline_asm_elementwise(_LANE_2_4, "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)
        else:
            return tl.inline_asm_elementwise(_LANE_2_6, "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)
    elif BITS == 4:
        if SHIFT == 0:
            return tl.inline_asm_elementwise(_LANE_4_0, "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)
        else:
            return tl.inline_asm_elementwise(_LANE_4_4, "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)
    else:
        return tl.inline_asm_elementwise(_LANE_8_0, "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)


def _lanes_all_asm(bits: int) -> str:
    """PTX for :func:`_code_planes` (unpack 5): every plane of 4 packed bytes in one block.

    The even bytes b0, b2 already sit in the low bits of the word's two 16-bit lanes, so each of
    their planes is one ``lop3`` ``(x & mask) | 0x64006400`` (code bits kept in place, the float16
    exponent of 1024 set around them); the odd bytes b1, b3 are moved down by one ``prmt`` that
    also writes the exponent bytes, (b1, 0x64, b3, 0x64), and each of their planes is one AND
    with an immediate (its code bits plus the exponent bits). One constant register for both
    (its bytes 0x00, 0x64 are the prmt's fill). 1 + 2 * planes instructions per 4 bytes; the form
    before built the even pair with a second ``prmt`` too (2 + 2 * planes: 2-bit 10 -> 9, 4-bit 6
    -> 5). (The per-plane ``(x & mask) | 0x6400`` of :func:`_lane_asm` with a constant per plane
    had ptxas rematerialize that constant before every use, ~130 register moves per block at
    batch 8 / 32k.)
    """
    src = 2 * (8 // bits)
    if bits == 8:  # one plane: the prmt's (b1, 0x64, b3, 0x64) is the odd lanes as they stand
        return ("{ .reg .b32 r_c; mov.b32 r_c, 0x64006400; "
                f"lop3.b32 $0, ${src}, 0x00FF00FF, r_c, 0xEA; prmt.b32 $1, ${src}, r_c, 0x7351; }}")
    body = ("{ .reg .b32 r_h, r_c; mov.b32 r_c, 0x64006400; "
            f"prmt.b32 r_h, ${src}, r_c, 0x7351; ")
    for s in range(8 // bits):
        m = ((1 << bits) - 1) << (s * bits)
        body += (f"lop3.b32 ${2 * s}, ${src}, 0x{m:04X}{m:04X}, r_c, 0xEA; "
                 f"and.b32 ${2 * s + 1}, r_h, 0x{m | 0x6400:04X}{m | 0x6400:04X}; ")
    return body + "}"


_LANES_ALL_2 = tl.constexpr(_lanes_all_asm(2))
_LANES_ALL_4 = tl.constexpr(_lanes_all_asm(4))
_LANES_ALL_8 = tl.constexpr(_lanes_all_asm(8))


@triton.jit
def _unit_lanes(u, SHIFT: tl.constexpr, BITS: tl.constexpr):
    """uint16 units -> float16 ``1024 + (byte & (mask << SHIFT))`` of the low and of the high byte."""
    M: tl.constexpr = ((1 << BITS) - 1) << SHIFT
    return (((u & 0xFF) & M) | 0x6400).to(tl.float16, bitcast=True), (((u >> 8) & M) | 0x6400).to(tl.float16, bitcast=True)


@triton.jit
def _unit_planes(x, BITS: tl.constexpr, UNPACK: tl.constexpr):
    """All planes of an int16 tile of code units (N, P / 2), unit u = bytes 2u (low) and 2u + 1
    (high) of a token's code row, as float16 lanes ``1024 + (byte & (mask << s * BITS))``: 8 tiles
    (lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3), plane s of the low and of the high byte (tiles past
    8 // BITS repeat plane 0). Unlike the byte tiles of :func:`_code_planes`, this is elementwise
    (one unit in, one code of each plane out), so no register order is assumed: the value tile
    reaches the MMA through ``ldmatrix.trans`` of 16-bit units instead of byte loads and permutes.
    UNPACK 5: the PTX block of :func:`_lanes_all_asm` on 2 units per 32-bit register (its byte
    pairs (0, 2) and (1, 3) are then the low and the high bytes of the two units); 6: Triton ops."""
    if UNPACK == 5:
        if BITS == 2:
            l0, h0, l1, h1, l2, h2, l3, h3 = tl.inline_asm_elementwise(
                _LANES_ALL_2, "=r,=r,=r,=r,=r,=r,=r,=r,r", [x], dtype=(tl.float16,) * 8, is_pure=True, pack=2)
        elif BITS == 4:
            l0, h0, l1, h1 = tl.inline_asm_elementwise(_LANES_ALL_4, "=r,=r,=r,=r,r", [x], dtype=(tl.float16,) * 4,
                                                       is_pure=True, pack=2)
            l2, h2, l3, h3 = l0, h0, l0, h0
        else:
            l0, h0 = tl.inline_asm_elementwise(_LANES_ALL_8, "=r,=r,r", [x], dtype=(tl.float16,) * 2, is_pure=True,
                                               pack=2)
            l1, h1, l2, h2, l3, h3 = l0, h0, l0, h0, l0, h0
    else:
        u = x.to(tl.uint16, bitcast=True)
        l0, h0 = _unit_lanes(u, 0, BITS)
        l1, h1, l2, h2, l3, h3 = l0, h0, l0, h0, l0, h0
        if BITS < 8:
            l1, h1 = _unit_lanes(u, BITS, BITS)
        if BITS < 4:
            l2, h2 = _unit_lanes(u, 2 * BITS, BITS)
            l3, h3 = _unit_lanes(u, 3 * BITS, BITS)
    return l0, h0, l1, h1, l2, h2, l3, h3


@triton.jit
def _code_planes(x, BITS: tl.constexpr, OUT_T: tl.constexpr, UNPACK: tl.constexpr, ONE_BLOCK: tl.constexpr = True):
    """All planes of a uint8 byte tile (N, P): 4 tiles, plane s = :func:`_codes` (x, s * BITS)
    (tiles past 8 // BITS repeat plane 0). UNPACK 5 takes one PTX block for every plane (values
    and lane order as :func:`_unpack_lanes_asm`) unless ONE_BLOCK is off (the probe's per-plane
    variant); other unpacks go plane by plane."""
    if (UNPACK == 5) & ONE_BLOCK:
        if BITS == 2:
            c0, c1, c2, c3 = tl.inline_asm_elementwise(
                _LANES_ALL_2, "=r,=r,=r,=r,=r,=r,=r,=r,r", [x],
                dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=4)
            return c0, c1, c2, c3
        elif BITS == 4:
            c0, c1 = tl.inline_asm_elementwise(_LANES_ALL_4, "=r,=r,=r,=r,r", [x], dtype=(tl.float16, tl.float16),
                                               is_pure=True, pack=4)
            return c0, c1, c0, c0
        else:
            c0 = tl.inline_asm_elementwise(_LANES_ALL_8, "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)
            return c0, c0, c0, c0
    else:
        c0 = _codes(x, 0, BITS, OUT_T, UNPACK)
        c1 = c0
        c2 = c0
        c3 = c0
        if BITS < 8:
            c1 = _codes(x, BITS, BITS, OUT_T, UNPACK)
        if BITS < 4:
            c2 = _codes(x, 2 * BITS, BITS, OUT_T, UNPACK)
            c3 = _codes(x, 3 * BITS, BITS, OUT_T, UNPACK)
        return c0, c1, c2, c3


@triton.jit
def _codes_words(w, SHIFT: tl.constexpr, BITS: tl.constexpr, OUT_T: tl.constexpr, ASM: tl.constexpr):
    """(N, W) int32 words -> (N, 4 W) codes of one plane, column 4 w + k = byte k of word w.

    The four byte tiles are joined along new minor dims and reshaped, so each thread keeps the
    four codes of a word in its own registers (no data movement, no layout change upstream).
    """
    if ASM:
        o0, o1, o2, o3 = _unpack_words_asm(w, SHIFT, BITS)
    else:
        # the same magic-number trick in Triton ops (no int->float conversion instructions)
        m = (1 << BITS) - 1
        o0 = (((w >> SHIFT) & m).to(tl.int16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
        o1 = (((w >> (8 + SHIFT)) & m).to(tl.int16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
        o2 = (((w >> (16 + SHIFT)) & m).to(tl.int16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
        o3 = (((w >> (24 + SHIFT)) & m).to(tl.int16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
    # (N, W, 2, 2), [.., i, j] = byte i + 2 j, so column 4 w + k holds byte 4 w + _perm4(k): the
    # asm's 32-bit registers (bytes 0|2, 1|3) stay whole pairs (no repacking); the kernel reads
    # the matching channels of q and writes its outputs through the same permutation.
    c = tl.join(tl.join(o0, o1), tl.join(o2, o3))
    return tl.reshape(c, (w.shape[0], w.shape[1] * 4)).to(OUT_T)


@triton.jit
def _perm4(k):
    """Swap positions 1 and 2 of every aligned group of 4 (an involution): the channel held by
    column k of a word-unpacked tile (see _codes_words)."""
    return (k & ~3) | ((k & 1) << 1) | ((k >> 1) & 1)


@triton.jit
def _codes(x, SHIFT: tl.constexpr, BITS: tl.constexpr, OUT_T: tl.constexpr, UNPACK: tl.constexpr):
    """Codes of one plane of a packed tile, as exact ``OUT_T`` values (see module doc): x is the
    uint8 byte tile (N, P) for UNPACK 0-2 and 5-6, the int32 word tile (N, P / 4) for 3 (PTX) and 4.
    UNPACK 5/6 return ``1024 + code * 2**SHIFT`` (folded by the caller), the others the codes."""
    if UNPACK == 5:
        return _unpack_lanes_asm(x, SHIFT, BITS)
    elif UNPACK == 6:
        # the values of unpack=5 in Triton ops (no lane swap): 1024 + code * 2**SHIFT, exact
        return ((x & (((1 << BITS) - 1) << SHIFT)).to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True)
    elif UNPACK >= 3:
        return _codes_words(x, SHIFT, BITS, OUT_T, UNPACK == 3)
    elif UNPACK == 2:
        return _unpack_asm(x, SHIFT, BITS).to(OUT_T)
    elif UNPACK == 1:
        c = (x >> SHIFT) & ((1 << BITS) - 1)  # uint8
        # float16 bits 0x6400 | c read as 1024 + c (exact); subtracting 1024 is exact too
        f = (c.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
        return f.to(OUT_T)
    else:
        c = (x >> SHIFT) & ((1 << BITS) - 1)
        return c.to(OUT_T)


@triton.jit
def _softcap(s, softcap):
    """``softcap * tanh(s / softcap)`` with tanh from exp2 (portable to the interpreter)."""
    e = tl.exp2(s * (2.0 * 1.4426950408889634 / softcap))  # exp(2 s / softcap)
    return softcap * (1.0 - 2.0 / (e + 1.0))


@triton.jit
def _q_plane(q_rows, r_ok, offs_p, COL0: tl.constexpr, qk_scale):
    """Channels [COL0, COL0 + P) of the query rows, float32, times qk_scale: (R_PAD, P)."""
    return tl.load(q_rows[:, None] + COL0 + offs_p[None, :], mask=r_ok[:, None], other=0.0).to(tl.float32) * qk_scale


@triton.jit
def _q_plane_t(q_rows, r_ok, offs_p, qk_scale):
    """:func:`_q_plane` transposed: channels ``offs_p`` of the query rows, float32, times qk_scale,
    as (P, R_PAD) -- the N operand of the key products, whose M rows are the tokens."""
    return tl.load(q_rows[None, :] + offs_p[:, None], mask=r_ok[None, :], other=0.0).to(tl.float32) * qk_scale


@triton.jit
def _k_group_fold(q_t, ks_ptr, kz_ptr, offs_p, DOT_T: tl.constexpr, SHIFT: tl.constexpr, LANES: tl.constexpr,
                  col_ok=None, SUB: tl.constexpr = 1):
    """Per-channel key parameters folded into one query plane for a whole key group:
    ``q . (c * s + z) = (q * s) . c + q . z``. Returns ((q * s) as DOT_T (P, R_PAD), the bias
    terms (P, R_PAD) float32 whose column sums are ``q . z``) -- the caller sums the terms of all
    planes in one reduction (a reduction crosses the warp's threads; per plane they were most of
    a 32-token key group's fold).

    LANES (the plane's codes arrive as ``1024 + c * 2**SHIFT``, unpack 5/6): the plane is
    ``(q * s) * 2**-SHIFT`` (exact: a power of two) and the bias terms also take
    ``-1024 * plane``, from the rounded DOT_T values the product uses, so the 1024 cancels
    exactly. q_t (P, R_PAD) float32 (pre-scaled, :func:`_q_plane_t`); ks_ptr/kz_ptr: the plane's
    P parameters, or with SUB > 1 key groups (virtual rows, ``DecodeConfig.key_group_pairs``)
    (SUB,) pointers, one per group.
    """
    if SUB > 1:
        # SUB key groups (ks_ptr/kz_ptr (SUB,) pointers to each group's row, read where col_ok):
        # column v of q_t is query row v % (R_PAD / SUB) folded with group v // (R_PAD / SUB); each
        # parameter is read once and broadcast over the group's rows
        RS: tl.constexpr = q_t.shape[1] // SUB
        ks = tl.load(ks_ptr[None, :, None] + offs_p[:, None, None], mask=col_ok[None, :, None], other=0.0)
        kz = tl.load(kz_ptr[None, :, None] + offs_p[:, None, None], mask=col_ok[None, :, None], other=0.0)
        q3 = tl.reshape(q_t, (q_t.shape[0], SUB, RS))  # (P, SUB, RS)
        qs = tl.reshape(q3 * ks.to(tl.float32), q_t.shape)  # (P, R_PAD): q * s
        terms = tl.reshape(q3 * kz.to(tl.float32), q_t.shape)  # (P, R_PAD)
    else:
        qs = q_t * tl.load(ks_ptr + offs_p).to(tl.float32)[:, None]  # (P, R_PAD): q * s
        terms = q_t * tl.load(kz_ptr + offs_p).to(tl.float32)[:, None]  # (P, R_PAD)
    if LANES:
        qp = (qs * (1.0 / (1 << SHIFT))).to(DOT_T)  # (P, R_PAD)
        return qp, terms - 1024.0 * qp.to(tl.float32)
    else:
        return qs.to(DOT_T), terms


@triton.jit
def _k_fold_planes(q0, q1, q2, q3, ks_ptr, kz_ptr, offs_p, PK: tl.constexpr, BITS: tl.constexpr, DOT_T: tl.constexpr,
                   LANES: tl.constexpr, col_ok=None, SUB: tl.constexpr = 1):
    """Every key plane of one key group folded (:func:`_k_group_fold`): ((q * s) per plane as DOT_T
    (PK, R_PAD) x 4 (planes past 8 // BITS repeat plane 0), the bias (R_PAD,) of all planes in one
    reduction). q0..q3 (PK, R_PAD) float32 query slices; ks_ptr/kz_ptr: the group's parameter row
    (SUB > 1: one per key group, see :func:`_k_group_fold`)."""
    PER: tl.constexpr = 8 // BITS
    qp0, bt = _k_group_fold(q0, ks_ptr, kz_ptr, offs_p, DOT_T, 0, LANES, col_ok, SUB)
    qp1 = qp0
    qp2 = qp0
    qp3 = qp0
    if PER > 1:
        qp1, b1 = _k_group_fold(q1, ks_ptr + PK, kz_ptr + PK, offs_p, DOT_T, BITS, LANES, col_ok, SUB)
        bt += b1
    if PER > 2:
        qp2, b2 = _k_group_fold(q2, ks_ptr + 2 * PK, kz_ptr + 2 * PK, offs_p, DOT_T, 2 * BITS, LANES, col_ok, SUB)
        qp3, b3 = _k_group_fold(q3, ks_ptr + 3 * PK, kz_ptr + 3 * PK, offs_p, DOT_T, 3 * BITS, LANES, col_ok, SUB)
        bt += b2 + b3
    return qp0, qp1, qp2, qp3, tl.sum(bt, axis=0)


@triton.jit
def _k_fold_scores(scores_t, kb, qp0, qp1, qp2, qp3, kbias, BITS: tl.constexpr, DOT_T: tl.constexpr,
                   UNPACK: tl.constexpr, IEEE: tl.constexpr):
    """Transposed scores (rows, R_PAD) + the folded key planes' products: the codes of byte tile
    kb (rows, PK) @ each (q * s) plane, plus the bias."""
    PER: tl.constexpr = 8 // BITS
    c0, c1, c2, c3 = _code_planes(kb, BITS, DOT_T, UNPACK)  # (rows, PK) each
    scores_t = _dot(c0, qp0, scores_t, IEEE)
    if PER > 1:
        scores_t = _dot(c1, qp1, scores_t, IEEE)
    if PER > 2:
        scores_t = _dot(c2, qp2, scores_t, IEEE)
        scores_t = _dot(c3, qp3, scores_t, IEEE)
    return scores_t + kbias[None, :]


@triton.jit
def _k_deq_plane(scores_t, q_t, kb, ks_rows, kz_rows, col0, offs_p, row_ok, GROUP: tl.constexpr,
                 SHIFT: tl.constexpr, BITS: tl.constexpr, DOT_T: tl.constexpr,
                 UNPACK: tl.constexpr, IEEE: tl.constexpr):
    """Transposed scores (BLOCK_N, R_PAD) of one key plane with per-token parameters over groups
    of GROUP channels: dequantize ``c * s + z`` per element, then the product.

    q_t (P, R_PAD) float32; ks_rows/kz_rows (BLOCK_N,) pointers to each token's parameter row;
    col0 = first channel.
    """
    g = (col0 + offs_p) // GROUP  # (P,) parameter column of each channel
    sc = tl.load(ks_rows[:, None] + g[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    ze = tl.load(kz_rows[:, None] + g[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    c = _codes(kb, SHIFT, BITS, DOT_T, UNPACK).to(tl.float32)  # (BLOCK_N, P)
    k = (c * sc + ze).to(DOT_T)
    return _dot(k, q_t.to(DOT_T), scores_t, IEEE)


@triton.jit
def _scaled_p(p, vs_rows, row_ok, DOT_T: tl.constexpr):
    """``p * scale`` of one value group as DOT_T (R_PAD, BLOCK_N); vs_rows (BLOCK_N,) pointers to
    each token's scale of that group. (The zero term is accumulated apart.)"""
    vs = tl.load(vs_rows, mask=row_ok, other=0.0).to(tl.float32)  # (BLOCK_N,)
    return (p * vs[None, :]).to(DOT_T)


@triton.jit
def _scaled_pt(p_t, vs, DOT_T: tl.constexpr):
    """:func:`_scaled_p` on transposed probabilities, scales loaded: ``p * scale`` as DOT_T
    (BLOCK_N, R_PAD); vs (BLOCK_N,) each token's scale of the group (float16)."""
    return (p_t * vs.to(tl.float32)[:, None]).to(DOT_T)


@triton.jit
def _v_group_product(acc, acc_hi, zacc, p_t, codes, codes_hi, vs, offs_z, G: tl.constexpr,
                     SHIFT: tl.constexpr, DOT_T: tl.constexpr, IEEE: tl.constexpr, LANES: tl.constexpr,
                     HI: tl.constexpr, T: tl.constexpr = False):
    """Value group G's codes (BLOCK_N, W) (a chunk of a plane lying in that group) into its
    accumulator (VR, W): ``acc + (p * scale) @ codes``, the scaled probabilities built from p_t
    (VR, BLOCK_N), the products' operand already (one layout change per block, not per group);
    HI (value units): the group's high-byte codes ``codes_hi`` into ``acc_hi`` too. LANES (codes
    ``1024 + c * 2**SHIFT``; the accumulators are scaled by ``2**-SHIFT`` at the end): column G of
    zacc (VR, ZW) gets ``-1024 * 2**-SHIFT * sum_n (p * scale)`` from a product of the same rounded
    operand with a constant tile (exact), not from a reduction across the warp. vs (BLOCK_N,) each
    token's scale of the group (float16, loaded). T (transposed value products): p_t is (BLOCK_N,
    VR), codes (W, BLOCK_N) loaded transposed, acc (W, VR), zacc (ZW, VR). Returns (acc, acc_hi, zacc)."""
    return _v_scaled_product(acc, acc_hi, zacc, _p_times_scale(p_t, vs, DOT_T, T), codes, codes_hi,
                             offs_z, G, SHIFT, DOT_T, IEEE, LANES, HI, T)


@triton.jit
def _p_times_scale(p_t, vs, DOT_T: tl.constexpr, T: tl.constexpr = False):
    """``p * scale`` (VR, BLOCK_N) of one value group in the products' operand type, scaled there:
    p_t (VR, BLOCK_N) DOT_T, vs (BLOCK_N,) each token's scale of the group (float16, loaded);
    T (transposed value products): p_t and the result (BLOCK_N, VR)."""
    if T:
        return p_t * vs.to(DOT_T)[:, None]
    else:
        return p_t * vs.to(DOT_T)[None, :]


@triton.jit
def _v_scaled_product(acc, acc_hi, zacc, a, codes, codes_hi, offs_z, COL: tl.constexpr, SHIFT: tl.constexpr,
                      DOT_T: tl.constexpr, IEEE: tl.constexpr, LANES: tl.constexpr, HI: tl.constexpr,
                      T: tl.constexpr = False):
    """``acc + a @ codes`` for a (VR, BLOCK_N) = p * scale (see :func:`_v_group_product`), HI:
    ``acc_hi + a @ codes_hi``; LANES: column COL of zacc (VR, ZW) += ``-1024 * 2**-SHIFT * sum_n a``
    by a product with a constant tile. T (transposed value products, ``DecodeConfig.value_products_t``):
    ``acc + codes @ a`` with a (BLOCK_N, VR), codes (W, BLOCK_N) loaded transposed, acc (W, VR),
    zacc (ZW, VR): the channels are the MMA's M rows and the few query rows only its N (padded to
    8, not to 16 as an M). Returns (acc, acc_hi, zacc)."""
    if T:
        acc = _dot(codes, a, acc, IEEE)
        if HI:
            acc_hi = _dot(codes_hi, a, acc_hi, IEEE)
    else:
        acc = _dot(a, codes, acc, IEEE)
        if HI:
            acc_hi = _dot(a, codes_hi, acc_hi, IEEE)
    if LANES:
        e = tl.where(offs_z == COL, -1024.0 / (1 << SHIFT), 0.0).to(DOT_T)  # (ZW,)
        zacc = _lane_product(zacc, a, e, IEEE, T)
    return acc, acc_hi, zacc


@triton.jit
def _lane_product(zacc, a, e, IEEE: tl.constexpr, T: tl.constexpr):
    """``zacc + a @ tile`` with tile (BLOCK_N, ZW) = e (ZW,) on every row, a (VR, BLOCK_N); T:
    ``zacc + tile^T @ a`` with a (BLOCK_N, VR), zacc (ZW, VR)."""
    if T:
        return _dot(tl.broadcast_to(e[:, None], (e.shape[0], a.shape[0])), a, zacc, IEEE)
    else:
        return _dot(a, tl.broadcast_to(e[None, :], (a.shape[1], e.shape[0])), zacc, IEEE)


@triton.jit
def _lane_terms(offs_z, G: tl.constexpr, PV: tl.constexpr, V_GROUP: tl.constexpr, V_BITS: tl.constexpr,
                PLANES: tl.constexpr, DOT_T: tl.constexpr):
    """The row (ZW,) of the constant tile whose product with value group G's ``p * scale``
    (:func:`_lane_product`) puts each of its planes' 1024 terms into zacc: column 4 + s holds
    ``-1024 * 2**-(s * V_BITS)`` for the planes s (< PLANES) lying in group G
    (``(s * PV) // V_GROUP == G``), 0 elsewhere."""
    s = offs_z - 4  # (ZW,) plane of each column
    on = (s >= 0) & (s < PLANES) & ((s * PV) // V_GROUP == G)
    return tl.where(on, -1024.0 * tl.exp2(-(s * V_BITS).to(tl.float32)), 0.0).to(DOT_T)  # (ZW,)


@triton.jit
def _group_operand(prev, p_t, zsum, zacc, pt, vs, vz, offs_z, G: tl.constexpr, G_PREV: tl.constexpr,
                   PV: tl.constexpr, V_GROUP: tl.constexpr, V_BITS: tl.constexpr, PLANES: tl.constexpr,
                   DOT_T: tl.constexpr, IEEE: tl.constexpr, LANES: tl.constexpr, T: tl.constexpr = False):
    """A folded value plane's ``p * scale`` operand (VR, BLOCK_N): the previous plane's ``prev``
    where both lie in group G, else built from p_t (VR, BLOCK_N) with group G's scales, its zero
    sum ``zsum + sum_n p * zero`` (a reduction of pt (BLOCK_N, VR)) and, LANES, its planes' 1024
    terms into zacc by one product (:func:`_lane_terms`). vs, vz (BLOCK_N,) each token's scale
    and zero of group G (float16, loaded). T (transposed value products): p_t and the operand are
    (BLOCK_N, VR), the probabilities in the key products' output orientation, zacc (ZW, VR).
    Returns (operand, zsum, zacc)."""
    b = prev
    if G != G_PREV:
        b = _p_times_scale(p_t, vs, DOT_T, T)
        zsum += tl.sum(pt * vz.to(tl.float32)[:, None], axis=0)
        if LANES:
            zacc = _lane_product(zacc, b, _lane_terms(offs_z, G, PV, V_GROUP, V_BITS, PLANES, DOT_T), IEEE, T)
    return b, zsum, zacc


@triton.jit
def _v_fold_product(acc, a, codes, IEEE: tl.constexpr, T: tl.constexpr):
    """A folded value plane's product with a (BLOCK_N, VR) = p * scale: ``acc + a^T @ codes``
    (codes (BLOCK_N, W), acc (VR, W)), or with T ``acc + codes @ a`` (codes loaded transposed,
    (W, BLOCK_N); acc (W, VR); :func:`_v_scaled_product`)."""
    if T:
        return _dot(codes, a, acc, IEEE)
    else:
        return _dot(tl.trans(a), codes, acc, IEEE)


@triton.jit
def _row_scaled(x, alpha, T: tl.constexpr):
    """x * alpha per query row: x (VR, W), or (W, VR) when T (transposed accumulators)."""
    if T:
        return x * alpha[None, :]
    else:
        return x * alpha[:, None]


@triton.jit
def _value_scales(vs_base, vz_base, vrows, row_ok, offs_z, G1: tl.constexpr, G2: tl.constexpr, G3: tl.constexpr,
                  NACC: tl.constexpr, V_NCH: tl.constexpr, T: tl.constexpr = False):
    """A block's per-token value scales and zeros (float16), loaded where the caller wants their
    latency to start: (vs0, vz0, .., vs3, vz3, zt). Value-group accumulators (V_NCH > 1): vs g is
    group g's scale (g < NACC) and zt (BLOCK_N, 16) every group's zero (column g; T: (16, BLOCK_N),
    row g); a folded layout:
    vs s / vz s are plane s's group's (G1, G2, G3: groups of planes 1-3; one load per distinct
    group). vrows (BLOCK_N,) each token's row offset, row_ok (BLOCK_N,) its mask."""
    vs0 = tl.load(vs_base + vrows, mask=row_ok, other=0.0)  # (BLOCK_N,)
    vz0 = tl.zeros_like(vs0)
    vs1 = vs0
    vz1 = vz0
    vs2 = vs0
    vz2 = vz0
    vs3 = vs0
    vz3 = vz0
    zt = tl.zeros([vrows.shape[0], offs_z.shape[0]], vs0.dtype)  # (BLOCK_N, ZW)
    if T:
        zt = tl.zeros([offs_z.shape[0], vrows.shape[0]], vs0.dtype)  # (ZW, BLOCK_N)
    if V_NCH > 1:
        if T:  # transposed value products: the zeros are the M operand of their product, (ZW, BLOCK_N)
            z_ok = (offs_z < NACC)[:, None] & row_ok[None, :]
            zt = tl.load(vz_base + offs_z[:, None] + vrows[None, :], mask=z_ok, other=0.0)
        else:
            z_ok = row_ok[:, None] & (offs_z < NACC)[None, :]
            zt = tl.load(vz_base + vrows[:, None] + offs_z[None, :], mask=z_ok, other=0.0)
        vs1 = tl.load(vs_base + vrows + 1, mask=row_ok, other=0.0)
        if NACC > 2:
            vs2 = tl.load(vs_base + vrows + 2, mask=row_ok, other=0.0)
            vs3 = tl.load(vs_base + vrows + 3, mask=row_ok, other=0.0)
    else:
        vz0 = tl.load(vz_base + vrows, mask=row_ok, other=0.0)
        if G1 != 0:
            vs1 = tl.load(vs_base + vrows + G1, mask=row_ok, other=0.0)
            vz1 = tl.load(vz_base + vrows + G1, mask=row_ok, other=0.0)
        else:
            vz1 = vz0
        vs2 = vs1
        vz2 = vz1
        if G2 != G1:
            vs2 = tl.load(vs_base + vrows + G2, mask=row_ok, other=0.0)
            vz2 = tl.load(vz_base + vrows + G2, mask=row_ok, other=0.0)
        vs3 = vs2
        vz3 = vz2
        if G3 != G2:
            vs3 = tl.load(vs_base + vrows + G3, mask=row_ok, other=0.0)
            vz3 = tl.load(vz_base + vrows + G3, mask=row_ok, other=0.0)
    return vs0, vz0, vs1, vz1, vs2, vz2, vs3, vz3, zt


@triton.jit
def _v_deq_plane(acc, p_dot, vb, vs_rows, vz_rows, col0, offs_p, row_ok, GROUP: tl.constexpr,
                 SHIFT: tl.constexpr, BITS: tl.constexpr, DOT_T: tl.constexpr,
                 UNPACK: tl.constexpr, IEEE: tl.constexpr):
    """``acc + p @ (c * s + z)`` for one value plane spanning several value groups."""
    g = (col0 + offs_p) // GROUP  # (P,)
    sc = tl.load(vs_rows[:, None] + g[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    ze = tl.load(vz_rows[:, None] + g[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    c = _codes(vb, SHIFT, BITS, DOT_T, UNPACK).to(tl.float32)  # (BLOCK_N, P)
    v = (c * sc + ze).to(DOT_T)
    return _dot(p_dot, v, acc, IEEE)


@triton.jit
def _plane_channels(offs_p, P: tl.constexpr, PLANES: tl.constexpr, perm_row, PERM: tl.constexpr,
                    NCH: tl.constexpr = 1):
    """Input channel of each column of tiles 0..3, in ``offs_p``'s column order: the stored
    channel itself, or ``perm_row[j]`` (the kv head's SKVQ permutation, int32 (D,)) when PERM.
    NCH = 1: tile s is plane s (stored channels ``[s * P, (s + 1) * P)``); NCH > 1 (value groups
    narrower than a plane): tile g is chunk ``g % NCH`` of plane ``g // NCH``, ``P / NCH``
    columns. Tiles past PLANES * NCH are returned unpermuted (unused)."""
    W: tl.constexpr = P // NCH
    c0 = offs_p
    c1 = (1 // NCH) * P + (1 % NCH) * W + offs_p
    c2 = (2 // NCH) * P + (2 % NCH) * W + offs_p
    c3 = (3 // NCH) * P + (3 % NCH) * W + offs_p
    if PERM:
        c0 = tl.load(perm_row + c0)
        if PLANES * NCH > 1:
            c1 = tl.load(perm_row + c1)
        if PLANES * NCH > 2:
            c2 = tl.load(perm_row + c2)
            c3 = tl.load(perm_row + c3)
    return c0, c1, c2, c3


@triton.jit
def _mean_tile(rows, cols, row_ok, MEAN: tl.constexpr, DOT_T: tl.constexpr):
    """A TaDA mean tile (BLOCK_N, P) as DOT_T: rows (BLOCK_N, 1) pointers to each token's mean
    row, cols (P,) channels; 8-bit codes (MEAN 8, exact) or float16 values (MEAN 16)."""
    x = tl.load(rows + cols[None, :], mask=row_ok[:, None], other=0)
    if MEAN == 8:
        return _codes(x, 0, 8, DOT_T, 1)
    else:
        return x.to(DOT_T)


@triton.jit
def _merge_virtual_rows(x, w, K_SUB: tl.constexpr, R_PAD: tl.constexpr, W: tl.constexpr):
    """(K_SUB * R_PAD, W) rows of K_SUB virtual row sets -> (R_PAD, W): ``sum_g w[g] * x[g]``
    with w (K_SUB, R_PAD) the log-sum-exp weights of each set."""
    return tl.sum(tl.reshape(x, (K_SUB, R_PAD, W)) * w[:, :, None], axis=0)


@triton.jit
def _before(offs, end, WHOLE: tl.constexpr):
    """``offs < end``; WHOLE (every packed block of the call whole and visible,
    DecodeConfig.whole_blocks): an all-true constant, which the compiler drops from the loads'
    predicates and the score mask."""
    if WHOLE:
        return tl.full(offs.shape, 1, tl.int1)
    else:
        return offs < end


@triton.jit
def _column(x, offs_z, G: tl.constexpr):
    """Column G of x (rows, ZW) as (rows,)."""
    return tl.sum(tl.where(offs_z[None, :] == G, x, 0.0), axis=1)


@triton.jit
def _zero_column(zacc, offs_z, G: tl.constexpr):
    """Column G of zacc (R_PAD, ZP) as (R_PAD, 1)."""
    return _column(zacc, offs_z, G)[:, None]


@triton.jit
def _fp_chunk(q_rows, r_ok, part_row, M_part, L_part, O_part, k_base, v_base, skn, svn, c0, flen, mask_base,
              qk_scale, softcap, R_PAD: tl.constexpr, D: tl.constexpr, HAS_MASK: tl.constexpr,
              HAS_SOFTCAP: tl.constexpr, FP_T: tl.constexpr, FP_IEEE: tl.constexpr, FP_BLOCK: tl.constexpr,
              pos_base=None, HAS_POS: tl.constexpr = False):
    """Partial (m, l, acc) of tokens [c0, c0 + FP_BLOCK) of one full-precision segment.

    k_base/v_base point at the segment's (b, h) rows (F, D); mask_base at the visibility of its
    first token. HAS_POS (the OTT pools): the tokens sit at the int32 absolute positions at
    ``pos_base`` (F,) instead, -1 = empty slot, and mask_base points at position 0.
    Products in FP_T (the segment's dtype on GPU; float32 in the interpreter).
    """
    offs_d = tl.arange(0, D)
    offs_f = c0 + tl.arange(0, FP_BLOCK)
    f_ok = offs_f < flen
    valid = f_ok
    at = offs_f
    if HAS_POS:
        at = tl.load(pos_base + offs_f, mask=f_ok, other=-1)
        valid = valid & (at >= 0)
    if HAS_MASK:
        vis = tl.load(mask_base + at, mask=valid, other=0)
        valid = valid & (vis != 0)
    q = tl.load(q_rows[:, None] + offs_d[None, :], mask=r_ok[:, None], other=0.0).to(tl.float32) * qk_scale
    k = tl.load(k_base + offs_f[:, None] * skn + offs_d[None, :], mask=f_ok[:, None], other=0.0)
    s = _dot(q.to(FP_T), tl.trans(k.to(FP_T)), tl.zeros([R_PAD, FP_BLOCK], tl.float32), FP_IEEE)
    if HAS_SOFTCAP:
        s = _softcap(s, softcap) * 1.4426950408889634
    s = tl.where(valid[None, :], s, float("-inf"))
    m = tl.maximum(tl.max(s, axis=1), -1.0e30)
    p = tl.exp2(s - m[:, None])  # (R_PAD, FP_BLOCK)
    l = tl.sum(p, axis=1)
    v = tl.load(v_base + offs_f[:, None] * svn + offs_d[None, :], mask=f_ok[:, None], other=0.0)
    acc = _dot(p.to(FP_T), v.to(FP_T), tl.zeros([R_PAD, D], tl.float32), FP_IEEE)  # (R_PAD, D)
    tl.store(M_part + part_row, m, mask=r_ok)
    tl.store(L_part + part_row, l, mask=r_ok)
    tl.store((O_part + part_row * D)[:, None] + offs_d[None, :], acc, mask=r_ok[:, None])


# ---------------------------------------------------------------- kernels


@triton.jit(do_not_specialize=["S_TOT", "S_OFF", "N", "packed_pos", "F1_LEN", "f1_pos", "F2_LEN", "f2_pos", "F3_LEN",
                               "num_splits", "split_size", "n_f1_chunks", "n_f2_chunks"])
def _decode_split_kernel(
    # query (B, Hq, D), last dim contiguous
    Q, stride_qb, stride_qh,
    # partial results, contiguous: m, l (B*Hq, S_TOT); acc (B*Hq, S_TOT, D); float32. This call's
    # programs write columns [S_OFF, S_OFF + grid[1]) (several calls can share one buffer)
    M_part, L_part, O_part, S_TOT, S_OFF,
    # packed keys: codes (B, H, N, PK) uint8; scale/zero float16, last dim contiguous, same strides
    KC, stride_kcb, stride_kch, stride_kcn,
    KS, KZ, stride_ksb, stride_ksh, stride_ksn,
    # packed values: codes (B, H, N, PV) uint8; scale/zero (B, H, N, D / V_GROUP) float16
    VC, stride_vcb, stride_vch, stride_vcn,
    VS, VZ, stride_vsb, stride_vsh, stride_vsn,
    # valid packed range per batch [P_LO[b], P_HI[b]) (int32 (B,)), used when HAS_RANGE
    P_LO, P_HI, N,
    # visibility over absolute positions (B|1, L) uint8, used when HAS_MASK; stride_mb 0 = shared
    MASK, stride_mb, packed_pos,
    # full-precision segment 1 (sinks) and 2 (pending window): (B, H, F, D), last dim contiguous
    F1K, F1V, stride_f1kb, stride_f1kh, stride_f1kn, stride_f1vb, stride_f1vh, stride_f1vn, F1_LEN, f1_pos,
    F2K, F2V, stride_f2kb, stride_f2kh, stride_f2kn, stride_f2vb, stride_f2vh, stride_f2vn, F2_LEN, f2_pos,
    # OTT: outlier pool K/V (B, H, P, D) (last dim contiguous) at int32 positions (B, H, P) (-1 =
    # empty), used when F3_LEN > 0; quant masks uint8 (B, H, R) of the packed slots, used when HAS_KEEP
    F3K, F3V, stride_f3kb, stride_f3kh, stride_f3kn, stride_f3vb, stride_f3vh, stride_f3vn, F3_LEN,
    F3P, stride_f3pb, stride_f3ph,
    KEEP, stride_keepb, stride_keeph,
    # SKVQ channel permutations, int32 (H, D) contiguous: stored channel j = channel perm[h, j]
    KP, VP,
    # TaDA means per token, shared by the kv heads: (B, 1, N, D) float16 (MEAN 16) or uint8 codes
    # with per-token float16 scale/zero (B, 1, N, 1) (MEAN 8); last dim contiguous
    KM, KMS, KMZ, stride_kmb, stride_kmn, stride_kmsb, stride_kmsn,
    VM, VMS, VMZ, stride_vmb, stride_vmn, stride_vmsb, stride_vmsn,
    # work split: packed splits of split_size tokens (multiple of BLOCK_N), then fp chunks
    # (segment 1, segment 2, the pool)
    num_splits, split_size, n_f1_chunks, n_f2_chunks,
    # softmax: scores * qk_scale are in log2 units (qk_scale = scaling * log2 e) unless softcap
    qk_scale, softcap,
    # shapes
    H, R: tl.constexpr, R_PAD: tl.constexpr, D: tl.constexpr,
    # packed layout
    K_BITS: tl.constexpr, V_BITS: tl.constexpr, PK: tl.constexpr, PV: tl.constexpr,
    K_GROUP: tl.constexpr, V_GROUP: tl.constexpr, K_FOLD: tl.constexpr, V_FOLD: tl.constexpr,
    # code paths
    HAS_RANGE: tl.constexpr, HAS_MASK: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    DOT_T: tl.constexpr, IEEE: tl.constexpr, FP_T: tl.constexpr, FP_IEEE: tl.constexpr,
    K_UNPACK: tl.constexpr, V_UNPACK: tl.constexpr, BLOCK_N: tl.constexpr, FP_BLOCK: tl.constexpr,
    K_PERM: tl.constexpr = False, V_PERM: tl.constexpr = False, K_MEAN: tl.constexpr = 0,
    V_MEAN: tl.constexpr = 0, MASK_PACKED: tl.constexpr = True, HAS_KEEP: tl.constexpr = False,
    KEEP_BLOCK: tl.constexpr = 8, RESCALE: tl.constexpr = 8.0, V_NCH: tl.constexpr = 1, K_SUB: tl.constexpr = 1,
    GDC: tl.constexpr = False, V_UNITS: tl.constexpr = False, K_HALVES: tl.constexpr = False,
    V_SUM_DOTS: tl.constexpr = False, V_EARLY: tl.constexpr = 0, V_T: tl.constexpr = False,
    WHOLE: tl.constexpr = False,
):
    if GDC:  # programmatic dependent launch: the combine kernel may be launched now (it waits for this grid)
        tl.extra.cuda.gdc_launch_dependents()
    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_r = tl.arange(0, R_PAD)
    r_ok = offs_r < R  # padding rows (R < 16: tl.dot needs M >= 16) are computed, never stored
    q_rows = Q + b.to(tl.int64) * stride_qb + (h * R + offs_r) * stride_qh  # (R_PAD,) pointers
    part_row = (b * H * R + h * R + offs_r).to(tl.int64) * S_TOT + S_OFF + pid_s  # (R_PAD,)
    PER_K: tl.constexpr = 8 // K_BITS
    PER_V: tl.constexpr = 8 // V_BITS
    # value accumulators: one per plane (V_NCH 1), or, with value groups narrower than a plane
    # (fold path, V_NCH = PV / V_GROUP chunks of V_GROUP byte columns), one per value group
    # g = plane * V_NCH + chunk, each AW = PV / V_NCH channels wide; V_UNITS (values read as int16
    # units of two code bytes): acc g the low bytes of plane (or group) g, acc 4 + g the high ones,
    # AW = PV / (2 V_NCH) wide
    NACC: tl.constexpr = PER_V * V_NCH
    AW: tl.constexpr = PV // (2 * V_NCH) if V_UNITS else PV // V_NCH
    tl.static_assert(not (V_UNITS and (K_SUB > 1)), "value units: one key group per block")
    tl.static_assert((not V_UNITS) or (AW >= 16), "value units: >= 16 units per accumulator (tl.dot's N)")
    # virtual rows of the packed loop: with K_SUB key groups per block (per-channel keys of groups
    # shorter than a block), row v = g * R_PAD + r is query row r over the tokens of the block's key
    # group g only -- its own online softmax and accumulators, merged into row r at the end like a
    # split -- so one key product (its N = the virtual rows) covers the block's K_SUB groups
    VR: tl.constexpr = R_PAD * K_SUB
    offs_v = tl.arange(0, VR)
    v_ok = (offs_v % R_PAD) < R
    q_rows_v = Q + b.to(tl.int64) * stride_qb + (h * R + offs_v % R_PAD) * stride_qh  # (VR,) pointers

    if pid_s < num_splits:
        # ------------------------------------------------ packed split
        WORDS: tl.constexpr = (K_UNPACK == 3) | (K_UNPACK == 4)  # both sides then (launcher)
        K_LANES: tl.constexpr = (K_UNPACK == 5) | (K_UNPACK == 6)  # codes as 1024 + c * 2**shift
        V_LANES: tl.constexpr = (V_UNPACK == 5) | (V_UNPACK == 6)
        offs_pk = tl.arange(0, PK)
        offs_pv = tl.arange(0, PV)
        offs_bn = tl.arange(0, BLOCK_N)  # row of each loaded value token in the block
        if WORDS:  # codes read as int32 words (the launcher passes int32 views)
            offs_kw = tl.arange(0, PK // 4)
            offs_vw = tl.arange(0, PV // 4)
            offs_pk = _perm4(offs_pk)  # channel of each column of an unpacked plane
            offs_pv = _perm4(offs_pv)
        else:
            offs_kw = offs_pk
            offs_vw = offs_pv
            if K_UNPACK == 5:  # the PTX lane unpack returns bytes (0, 2, 1, 3) of each 4 columns
                offs_pk = _perm4(offs_pk)
            if V_UNPACK == 5:  # ... of each 4 token rows: load the rows in that order, so they return in order
                offs_bn = _perm4(offs_bn)
        G1: tl.constexpr = PV // V_GROUP  # value group of plane 1, 2, 3 (fold path: a plane lies in one)
        G2: tl.constexpr = (2 * PV) // V_GROUP
        G3: tl.constexpr = (3 * PV) // V_GROUP
        # zacc (below) holds per-group sums: value-group accumulators, or the planes' lane terms
        # (V_SUM_DOTS) of a folded layout
        V_PLANE_LANES: tl.constexpr = V_FOLD & V_SUM_DOTS & V_LANES & (V_NCH == 1)
        V_ZACC: tl.constexpr = (V_NCH > 1) | V_PLANE_LANES
        lo = 0
        hi = N
        if HAS_RANGE:
            lo = tl.load(P_LO + b)
            hi = tl.load(P_HI + b)
        s0 = pid_s * split_size
        start = tl.maximum(s0, (lo // BLOCK_N) * BLOCK_N)  # skip whole blocks of left padding
        end = tl.minimum(s0 + split_size, hi)
        # query channel of each column of key plane s (stored channels [s*PK, (s+1)*PK)); with an
        # SKVQ permutation, stored channel j holds input channel perm[h, j]
        qc0, qc1, qc2, qc3 = _plane_channels(offs_pk, PK, PER_K, KP + h * D, K_PERM)
        # the query, one transposed slice (PK, VR) per key plane, pre-scaled, float32: the key
        # products run transposed, scores^T = codes (BLOCK_N, PK) @ q^T, so the block's tokens fill
        # the MMA rows (the R query rows are only its small N; as M they were padded to 16 rows and
        # the kernel spent more on moving fragments than on unpacking: 1.4x slower at batch 8 /
        # 32k, kernels/bench/probe_swap.py). Per-token keys use the slices as is; per-channel keys
        # fold the scales in once per key group.
        q0 = _q_plane_t(q_rows_v, v_ok, qc0, qk_scale)
        q1 = q0
        q2 = q0
        q3 = q0
        if PER_K > 1:
            q1 = _q_plane_t(q_rows_v, v_ok, qc1, qk_scale)
        if PER_K > 2:
            q2 = _q_plane_t(q_rows_v, v_ok, qc2, qk_scale)
            q3 = _q_plane_t(q_rows_v, v_ok, qc3, qk_scale)
        # output channel of each column of value accumulator s (scattered back when V is permuted)
        offs_av = offs_pv  # (AW,) byte column of each accumulator column within its chunk
        if V_NCH > 1:
            offs_av = tl.arange(0, AW)
        if V_UNITS:  # column u of acc g: the low byte of unit u of its chunk (byte column 2u); of acc 4 + g: 2u + 1
            offs_av = 2 * tl.arange(0, AW)
        vc0, vc1, vc2, vc3 = _plane_channels(offs_av, PV, PER_V, VP + h * D, V_PERM, V_NCH)
        vh0 = vc0
        vh1 = vc1
        vh2 = vc2
        vh3 = vc3
        if V_UNITS:
            vh0, vh1, vh2, vh3 = _plane_channels(offs_av + 1, PV, PER_V, VP + h * D, V_PERM, V_NCH)
        # TaDA means (input channel order, one (N, D) mean per sequence shared by the kv heads):
        # the key mean adds q . mean_n to each score; the value mean adds sum_n p_n mean_n into
        # each value plane's accumulator, read at the plane's output channels (vc*)
        offs_d = tl.arange(0, D)
        qm = tl.zeros([D, VR], DOT_T)
        qm_sum = tl.zeros([VR], tl.float32)
        if K_MEAN != 0:
            qm32 = _q_plane_t(q_rows_v, v_ok, offs_d, qk_scale)  # (D, VR)
            qm = qm32.to(DOT_T)
            qm_sum = tl.sum(qm32, axis=0)
        km_base = KM + b.to(tl.int64) * stride_kmb
        kms_base = KMS + b.to(tl.int64) * stride_kmsb
        kmz_base = KMZ + b.to(tl.int64) * stride_kmsb
        vm_base = VM + b.to(tl.int64) * stride_vmb
        vms_base = VMS + b.to(tl.int64) * stride_vmsb
        vmz_base = VMZ + b.to(tl.int64) * stride_vmsb
        mzacc = tl.zeros([VR], tl.float32)  # sum_n p_n * zero_n of 8-bit value means
        # with a permuted V, the value mean accumulates apart in input channel order (a mean tile
        # read at each plane's permuted channels is a byte gather: 7x slower at batch 8 / 32k);
        # so does it with value-group accumulators (V_NCH > 1)
        VM_APART: tl.constexpr = (V_PERM | (V_NCH > 1) | V_UNITS) & (V_MEAN != 0)
        macc = tl.zeros([VR, D], tl.float32)  # sum_n p_n mean_n, used when VM_APART
        kc_base = KC + b.to(tl.int64) * stride_kcb + h.to(tl.int64) * stride_kch
        ks_base = KS + b.to(tl.int64) * stride_ksb + h.to(tl.int64) * stride_ksh
        kz_base = KZ + b.to(tl.int64) * stride_ksb + h.to(tl.int64) * stride_ksh
        vc_base = VC + b.to(tl.int64) * stride_vcb + h.to(tl.int64) * stride_vch
        vs_base = VS + b.to(tl.int64) * stride_vsb + h.to(tl.int64) * stride_vsh
        vz_base = VZ + b.to(tl.int64) * stride_vsb + h.to(tl.int64) * stride_vsh
        keep_base = KEEP + b.to(tl.int64) * stride_keepb + h.to(tl.int64) * stride_keeph

        m_i = tl.full([VR], -1.0e30, tl.float32)  # finite: a fully masked block keeps alpha = 1
        l_i = tl.zeros([VR], tl.float32)
        # V_T (transposed value products, DecodeConfig.value_products_t): the accumulators are
        # (AW, VR), channels as the MMA's M rows, transposed back once after the loop
        tl.static_assert((not V_T) or ((V_FOLD | (V_NCH > 1)) & V_UNITS & (V_MEAN == 0)),
                         "transposed value products: folded planes or value-group chunks read as units, no mean")
        AR: tl.constexpr = AW if V_T else VR  # accumulator shape (AR, AC)
        AC: tl.constexpr = VR if V_T else AW
        acc0 = tl.zeros([AR, AC], tl.float32)  # one accumulator per value plane (or group, NACC)
        acc1 = tl.zeros([AR, AC], tl.float32)
        acc2 = tl.zeros([AR, AC], tl.float32)
        acc3 = tl.zeros([AR, AC], tl.float32)
        acc4 = tl.zeros([AR, AC], tl.float32)  # V_UNITS: the high bytes' halves of planes 0..3
        acc5 = tl.zeros([AR, AC], tl.float32)
        acc6 = tl.zeros([AR, AC], tl.float32)
        acc7 = tl.zeros([AR, AC], tl.float32)
        # value groups narrower than a plane (V_NCH > 1): column g = group g's sum_n p * zero (and,
        # V_LANES, its 1024 term), accumulated by products (ZW: tl.dot's smallest N); folded planes
        # with V_PLANE_LANES: column 4 + s = plane s's 1024 term (see _lane_terms)
        ZW: tl.constexpr = 16
        offs_z = tl.arange(0, ZW)
        zacc = tl.zeros([ZW, VR] if V_T else [VR, ZW], tl.float32)  # (V_T: transposed)
        zsum0 = tl.zeros([VR], tl.float32)  # sum_n p * zero of value accumulator s's group (fold path)
        zsum1 = zsum0
        zsum2 = zsum0
        zsum3 = zsum0
        asum0 = tl.zeros([VR], tl.float32)  # sum_n (p * scale) per value plane (V_LANES: the 1024 to remove)
        asum1 = asum0
        asum2 = asum0
        asum3 = asum0
        # per-channel keys: (q * scale) per plane and q . zero, refreshed at each key group
        qp0 = tl.zeros([PK, VR], DOT_T)
        qp1 = qp0
        qp2 = qp0
        qp3 = qp0
        kbias = tl.zeros([VR], tl.float32)
        V_SCALED: tl.constexpr = (V_NCH > 1) | V_FOLD  # paths that take the scales from _value_scales
        if V_SCALED & (V_EARLY == 2):  # the first block's value scales; each block loads the next one's
            offs_x = start + tl.arange(0, BLOCK_N)
            nvs0, nvz0, nvs1, nvz1, nvs2, nvz2, nvs3, nvz3, nzt = _value_scales(
                vs_base, vz_base, offs_x * stride_vsn, offs_x < end, offs_z, G1, G2, G3, NACC, V_NCH, V_T)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            row_ok = _before(offs_n, end, WHOLE)  # (BLOCK_N,)
            if WHOLE:  # (no range: lo = 0)
                valid = row_ok
            else:
                valid = row_ok & (offs_n >= lo)
            if HAS_MASK and MASK_PACKED:
                vis = tl.load(MASK + b * stride_mb + packed_pos + offs_n, mask=row_ok, other=0)
                valid = valid & (vis != 0)
            if HAS_KEEP:  # OTT: this kv head's slots of pool entrants are masked out
                KEEP_BYTES: tl.constexpr = (KEEP_BLOCK + 7) // 8
                in_blk = offs_n % KEEP_BLOCK
                kbyte = tl.load(keep_base + (offs_n // KEEP_BLOCK) * KEEP_BYTES + in_blk // 8, mask=row_ok, other=0)
                valid = valid & (((kbyte.to(tl.int32) >> (in_blk % 8)) & 1) != 0)
            vrows = offs_n * stride_vsn  # (BLOCK_N,) each token's row of value scales / zeros
            if V_SCALED & (V_EARLY == 1):  # issued before the key work, whose time hides their latency
                vsc0, vze0, vsc1, vze1, vsc2, vze2, vsc3, vze3, zt = _value_scales(vs_base, vz_base, vrows, row_ok,
                                                                                    offs_z, G1, G2, G3, NACC, V_NCH, V_T)
            if V_SCALED & (V_EARLY == 2):  # loaded by the block before; issue the next block's
                vsc0, vze0, vsc1, vze1, vsc2, vze2, vsc3, vze3, zt = nvs0, nvz0, nvs1, nvz1, nvs2, nvz2, nvs3, nvz3, nzt
                offs_x = offs_n + BLOCK_N
                nvs0, nvz0, nvs1, nvz1, nvs2, nvz2, nvs3, nvz3, nzt = _value_scales(
                    vs_base, vz_base, offs_x * stride_vsn, offs_x < end, offs_z, G1, G2, G3, NACC, V_NCH, V_T)
            # ---- scores: all key planes from one (BLOCK_N, PK) byte tile
            if not K_HALVES:  # (halves load their own (BLOCK_N / 2, PK) tiles below)
                kb = tl.load(kc_base + offs_n[:, None] * stride_kcn + offs_kw[None, :], mask=row_ok[:, None], other=0)
            scores = tl.zeros([BLOCK_N, VR], tl.float32)  # transposed: token rows
            valid2 = valid[:, None]  # (BLOCK_N, 1 | VR) tokens each virtual row sees
            if K_HALVES:
                # two key groups per block, one per half: each half's codes times its own folded
                # planes (every block starts a group), the two (HB, VR) score tiles stacked into
                # the block's (a layout change of the small score tile, not of the codes)
                HB: tl.constexpr = BLOCK_N // 2
                offs_h = n0 + tl.arange(0, HB)
                krow = (n0 // K_GROUP) * stride_ksn
                krow_b = tl.minimum(n0 // K_GROUP + 1, (end - 1) // K_GROUP) * stride_ksn  # (past the end: masked)
                qa0, qa1, qa2, qa3, kbias_a = _k_fold_planes(q0, q1, q2, q3, ks_base + krow, kz_base + krow, offs_pk,
                                                             PK, K_BITS, DOT_T, K_LANES)
                qb0, qb1, qb2, qb3, kbias_b = _k_fold_planes(q0, q1, q2, q3, ks_base + krow_b, kz_base + krow_b,
                                                             offs_pk, PK, K_BITS, DOT_T, K_LANES)
                ka = tl.load(kc_base + offs_h[:, None] * stride_kcn + offs_kw[None, :], mask=_before(offs_h, end, WHOLE)[:, None],
                             other=0)  # (HB, PK)
                kbb = tl.load(kc_base + (offs_h + HB)[:, None] * stride_kcn + offs_kw[None, :],
                              mask=_before(offs_h + HB, end, WHOLE)[:, None], other=0)
                sa = _k_fold_scores(tl.zeros([HB, VR], tl.float32), ka, qa0, qa1, qa2, qa3, kbias_a, K_BITS, DOT_T,
                                    K_UNPACK, IEEE)
                sb = _k_fold_scores(tl.zeros([HB, VR], tl.float32), kbb, qb0, qb1, qb2, qb3, kbias_b, K_BITS, DOT_T,
                                    K_UNPACK, IEEE)
                scores = tl.reshape(tl.permute(tl.join(sa, sb), (2, 0, 1)), (BLOCK_N, VR))
            elif K_FOLD & (K_SUB == 1):
                if ((n0 % K_GROUP) == 0) | (n0 == start):  # a new key group (blocks never straddle one)
                    krow = (n0 // K_GROUP) * stride_ksn
                    qp0, qp1, qp2, qp3, kbias = _k_fold_planes(q0, q1, q2, q3, ks_base + krow, kz_base + krow, offs_pk,
                                                               PK, K_BITS, DOT_T, K_LANES)
                scores = _k_fold_scores(scores, kb, qp0, qp1, qp2, qp3, kbias, K_BITS, DOT_T, K_UNPACK, IEEE)
            elif K_FOLD:
                # K_SUB key groups per block: virtual row v takes the scales of group g = v // R_PAD
                offs_g = tl.arange(0, K_SUB)
                krow = ((n0 // K_GROUP) + offs_g) * stride_ksn  # (K_SUB,) parameter row of each group
                k_ok = _before(n0 + offs_g * K_GROUP, end, WHOLE)  # (K_SUB,) groups that hold tokens here
                qp0, qp1, qp2, qp3, kbias = _k_fold_planes(q0, q1, q2, q3, ks_base + krow, kz_base + krow, offs_pk,
                                                           PK, K_BITS, DOT_T, K_LANES, k_ok, K_SUB)
                scores = _k_fold_scores(scores, kb, qp0, qp1, qp2, qp3, kbias, K_BITS, DOT_T, K_UNPACK, IEEE)
                # a token counts only in the virtual rows of its key group
                valid2 = valid2 & ((tl.arange(0, BLOCK_N) // K_GROUP)[:, None] == (offs_v // R_PAD)[None, :])
            else:
                ks_rows = ks_base + offs_n * stride_ksn
                kz_rows = kz_base + offs_n * stride_ksn
                scores = _k_deq_plane(scores, q0, kb, ks_rows, kz_rows, 0, offs_pk, row_ok, K_GROUP,
                                      0, K_BITS, DOT_T, K_UNPACK, IEEE)
                if PER_K > 1:
                    scores = _k_deq_plane(scores, q1, kb, ks_rows, kz_rows, PK, offs_pk, row_ok, K_GROUP,
                                          K_BITS, K_BITS, DOT_T, K_UNPACK, IEEE)
                if PER_K > 2:
                    scores = _k_deq_plane(scores, q2, kb, ks_rows, kz_rows, 2 * PK, offs_pk, row_ok, K_GROUP,
                                          2 * K_BITS, K_BITS, DOT_T, K_UNPACK, IEEE)
                    scores = _k_deq_plane(scores, q3, kb, ks_rows, kz_rows, 3 * PK, offs_pk, row_ok, K_GROUP,
                                          3 * K_BITS, K_BITS, DOT_T, K_UNPACK, IEEE)
            if K_MEAN == 16:
                km = tl.load(km_base + offs_n[:, None] * stride_kmn + offs_d[None, :], mask=row_ok[:, None],
                             other=0.0).to(DOT_T)  # (BLOCK_N, D)
                scores = _dot(km, qm, scores, IEEE)
            elif K_MEAN == 8:  # q . (c * s + z) = s * (q . c) + z * sum(q)
                km = _codes(tl.load(km_base + offs_n[:, None] * stride_kmn + offs_d[None, :], mask=row_ok[:, None],
                                    other=0), 0, 8, DOT_T, 1)  # (BLOCK_N, D) codes, exact in float16
                kms = tl.load(kms_base + offs_n * stride_kmsn, mask=row_ok, other=0.0).to(tl.float32)
                kmz = tl.load(kmz_base + offs_n * stride_kmsn, mask=row_ok, other=0.0).to(tl.float32)
                sm = _dot(km, qm, tl.zeros([BLOCK_N, VR], tl.float32), IEEE)
                scores = scores + sm * kms[:, None] + qm_sum[None, :] * kmz[:, None]
            if HAS_SOFTCAP:
                scores = _softcap(scores, softcap) * 1.4426950408889634
            scores = tl.where(valid2, scores, float("-inf"))  # (BLOCK_N, VR)
            # ---- online softmax (log2 domain), lazily rescaled: the running max only moves (and
            # the accumulators are only rescaled) when a row's max grew by more than 2^RESCALE;
            # until then p <= 2^RESCALE, harmless in float32 sums and float16 products.
            m_new = tl.maximum(m_i, tl.max(scores, axis=0))
            if tl.max(m_new - m_i, axis=0) > RESCALE:
                alpha = tl.exp2(m_i - m_new)
                l_i = l_i * alpha
                acc0 = _row_scaled(acc0, alpha, V_T)
                if NACC > 1:
                    acc1 = _row_scaled(acc1, alpha, V_T)
                if NACC > 2:
                    acc2 = _row_scaled(acc2, alpha, V_T)
                    acc3 = _row_scaled(acc3, alpha, V_T)
                if V_UNITS:
                    acc4 = _row_scaled(acc4, alpha, V_T)
                    if NACC > 1:
                        acc5 = _row_scaled(acc5, alpha, V_T)
                    if NACC > 2:
                        acc6 = _row_scaled(acc6, alpha, V_T)
                        acc7 = _row_scaled(acc7, alpha, V_T)
                if V_ZACC:
                    zacc = _row_scaled(zacc, alpha, V_T)
                if V_FOLD:
                    zsum0 = zsum0 * alpha
                    zsum1 = zsum1 * alpha
                    zsum2 = zsum2 * alpha
                    zsum3 = zsum3 * alpha
                if V_LANES:
                    asum0 = asum0 * alpha
                    asum1 = asum1 * alpha
                    asum2 = asum2 * alpha
                    asum3 = asum3 * alpha
                if V_MEAN != 0:
                    mzacc = mzacc * alpha
                if VM_APART:
                    macc = macc * alpha[:, None]
                m_i = m_new
            pt = tl.exp2(scores - m_i[None, :])  # (BLOCK_N, VR), transposed; masked -> 0
            l_i = l_i + tl.sum(pt, axis=0)
            # ---- values: all planes from one (BLOCK_N, PV) byte tile; the products take the
            # transposed probabilities back as their (VR, BLOCK_N) M operand, or with V_T (units)
            # the (PV / 2, BLOCK_N) unit tile's planes are the M operand and pt (BLOCK_N, VR) the N
            offs_nv = n0 + offs_bn  # (BLOCK_N,) token of each loaded value row (see offs_bn)
            if V_SCALED & (V_EARLY == 0):
                vsc0, vze0, vsc1, vze1, vsc2, vze2, vsc3, vze3, zt = _value_scales(vs_base, vz_base, vrows, row_ok,
                                                                                    offs_z, G1, G2, G3, NACC, V_NCH, V_T)
            if V_NCH > 1:
                # value groups narrower than a plane: chunk c of the byte columns holds, in plane s,
                # channels of group s * V_NCH + c only, so each (plane, chunk) tile folds its
                # group's (p * scale) like a whole plane does below (4-bit: groups 0, 1 from the
                # low nibbles, 2, 3 from the high ones; 8-bit: one group per chunk); V_UNITS: a chunk
                # is AW int16 units, its low and high bytes' tiles share the group's (p * scale)
                if V_UNITS:
                    nv_ok = row_ok[:, None]
                    vrow_ptr = vc_base + offs_n[:, None] * stride_vcn + tl.arange(0, AW)[None, :]  # (BLOCK_N, AW)
                    if V_T:  # loaded transposed (AW, BLOCK_N): the planes are the products' M operand
                        nv_ok = row_ok[None, :]
                        vrow_ptr = vc_base + tl.arange(0, AW)[:, None] + offs_n[None, :] * stride_vcn
                    u00, w00, u01, w01, _, _, _, _ = _unit_planes(tl.load(vrow_ptr, mask=nv_ok, other=0), V_BITS,
                                                                  V_UNPACK)
                    u10, w10, u11, w11, _, _, _, _ = _unit_planes(tl.load(vrow_ptr + AW, mask=nv_ok, other=0),
                                                                  V_BITS, V_UNPACK)
                else:
                    nv_ok = _before(offs_nv, end, WHOLE)[:, None]
                    vrow_ptr = vc_base + offs_nv[:, None] * stride_vcn + offs_av[None, :]  # (BLOCK_N, AW)
                    u00, u01, _, _ = _code_planes(tl.load(vrow_ptr, mask=nv_ok, other=0), V_BITS, DOT_T, V_UNPACK)
                    u10, u11, _, _ = _code_planes(tl.load(vrow_ptr + AW, mask=nv_ok, other=0), V_BITS, DOT_T,
                                                  V_UNPACK)
                    w00 = u00  # (high-byte tiles: value units only)
                    w01 = u01
                    w10 = u10
                    w11 = u11
                # the probabilities, unscaled, as the products' operand (VR, BLOCK_N); the zero points
                # of all groups in one product: column g of zacc += sum_n p * zero_g (asum stays 0)
                if V_T:  # transposed: p stays (BLOCK_N, VR), zacc (ZW, VR) += zt^T @ p
                    p_t = pt.to(DOT_T)
                    zacc = _dot(zt.to(DOT_T), p_t, zacc, IEEE)  # zt (ZW, BLOCK_N): every group's zero
                else:
                    p_t = tl.trans(pt.to(DOT_T))
                    zacc = _dot(p_t, zt.to(DOT_T), zacc, IEEE)  # zt (BLOCK_N, ZW): every group's zero
                acc0, acc4, zacc = _v_group_product(acc0, acc4, zacc, p_t, u00, w00, vsc0, offs_z,
                                                    0, 0, DOT_T, IEEE, V_LANES, V_UNITS, V_T)
                acc1, acc5, zacc = _v_group_product(acc1, acc5, zacc, p_t, u10, w10, vsc1,
                                                    offs_z, 1, (1 // V_NCH) * V_BITS, DOT_T, IEEE, V_LANES, V_UNITS, V_T)
                if PER_V > 1:  # (then V_NCH == 2)
                    acc2, acc6, zacc = _v_group_product(acc2, acc6, zacc, p_t, u01, w01, vsc2,
                                                        offs_z, 2, V_BITS, DOT_T, IEEE, V_LANES, V_UNITS, V_T)
                    acc3, acc7, zacc = _v_group_product(acc3, acc7, zacc, p_t, u11, w11, vsc3,
                                                        offs_z, 3, V_BITS, DOT_T, IEEE, V_LANES, V_UNITS, V_T)
                elif V_NCH > 2:
                    if V_UNITS:
                        u20, w20, _, _, _, _, _, _ = _unit_planes(tl.load(vrow_ptr + 2 * AW, mask=nv_ok, other=0),
                                                                  V_BITS, V_UNPACK)
                        u30, w30, _, _, _, _, _, _ = _unit_planes(tl.load(vrow_ptr + 3 * AW, mask=nv_ok, other=0),
                                                                  V_BITS, V_UNPACK)
                    else:
                        u20, _, _, _ = _code_planes(tl.load(vrow_ptr + 2 * AW, mask=nv_ok, other=0), V_BITS, DOT_T,
                                                    V_UNPACK)
                        u30, _, _, _ = _code_planes(tl.load(vrow_ptr + 3 * AW, mask=nv_ok, other=0), V_BITS, DOT_T,
                                                    V_UNPACK)
                        w20 = u20
                        w30 = u30
                    acc2, acc6, zacc = _v_group_product(acc2, acc6, zacc, p_t, u20, w20, vsc2,
                                                        offs_z, 2, 0, DOT_T, IEEE, V_LANES, V_UNITS, V_T)
                    acc3, acc7, zacc = _v_group_product(acc3, acc7, zacc, p_t, u30, w30, vsc3,
                                                        offs_z, 3, 0, DOT_T, IEEE, V_LANES, V_UNITS, V_T)
            elif V_FOLD:
                if V_UNITS:  # (BLOCK_N, PV / 2) int16 units (the launcher passes an int16 view), tokens in order
                    offs_u = tl.arange(0, PV // 2)
                    if V_T:  # loaded transposed, (PV / 2, BLOCK_N): the planes are the products' M operand as is
                        vu = tl.load(vc_base + offs_u[:, None] + offs_n[None, :] * stride_vcn, mask=row_ok[None, :],
                                     other=0)
                    else:
                        vu = tl.load(vc_base + offs_n[:, None] * stride_vcn + offs_u[None, :], mask=row_ok[:, None],
                                     other=0)
                    vcode0, vhi0, vcode1, vhi1, vcode2, vhi2, vcode3, vhi3 = _unit_planes(vu, V_BITS, V_UNPACK)
                else:
                    vb = tl.load(vc_base + offs_nv[:, None] * stride_vcn + offs_vw[None, :],
                                 mask=_before(offs_nv, end, WHOLE)[:, None], other=0)
                    vcode0, vcode1, vcode2, vcode3 = _code_planes(vb, V_BITS, DOT_T, V_UNPACK)  # (BLOCK_N, PV) each
                    vhi0 = vcode0  # (high-byte tiles: value units only)
                    vhi1 = vcode1
                    vhi2 = vcode2
                    vhi3 = vcode3
                if V_SUM_DOTS:
                    # plane s lies in value group Gs = (s * PV) // V_GROUP: the probabilities change
                    # layout once and (p * scale) is built once per group, in the products' operand;
                    # V_LANES: column 4 + s of zacc gets plane s's 1024 term from one product per
                    # group with a constant tile (_lane_terms), not from a reduction of p * scale.
                    # Each group's sum_n p * zero stays a reduction of p (one per group): as a
                    # product with a (BLOCK_N, 16) zero-point tile it took as many instructions
                    # (Mistral shape, groups 128: 2-bit 1,231 vs 1,227, 4-bit 1,352 vs 1,339 per 64 tokens).
                    # V_T: transposed, acc s (AW, VR) += codes^T @ (p * scale) (BLOCK_N, VR), p not transposed
                    p_t = pt.to(DOT_T) if V_T else tl.trans(pt.to(DOT_T))  # (BLOCK_N, VR) | (VR, BLOCK_N)
                    b0, zsum0, zacc = _group_operand(p_t, p_t, zsum0, zacc, pt, vsc0, vze0,
                                                     offs_z, 0, -1, PV, V_GROUP, V_BITS, PER_V, DOT_T, IEEE,
                                                     V_LANES, V_T)
                    acc0, acc4, zacc = _v_scaled_product(acc0, acc4, zacc, b0, vcode0, vhi0, offs_z, 4, 0, DOT_T, IEEE,
                                                         False, V_UNITS, V_T)
                    if PER_V > 1:
                        b1, zsum1, zacc = _group_operand(b0, p_t, zsum1, zacc, pt, vsc1,
                                                         vze1, offs_z, G1, 0, PV, V_GROUP,
                                                         V_BITS, PER_V, DOT_T, IEEE, V_LANES, V_T)
                        acc1, acc5, zacc = _v_scaled_product(acc1, acc5, zacc, b1, vcode1, vhi1, offs_z, 5, V_BITS,
                                                             DOT_T, IEEE, False, V_UNITS, V_T)
                    if PER_V > 2:
                        b2, zsum2, zacc = _group_operand(b1, p_t, zsum2, zacc, pt, vsc2,
                                                         vze2, offs_z, G2, G1, PV, V_GROUP,
                                                         V_BITS, PER_V, DOT_T, IEEE, V_LANES, V_T)
                        acc2, acc6, zacc = _v_scaled_product(acc2, acc6, zacc, b2, vcode2, vhi2, offs_z, 6, 2 * V_BITS,
                                                             DOT_T, IEEE, False, V_UNITS, V_T)
                        b3, zsum3, zacc = _group_operand(b2, p_t, zsum3, zacc, pt, vsc3,
                                                         vze3, offs_z, G3, G2, PV, V_GROUP,
                                                         V_BITS, PER_V, DOT_T, IEEE, V_LANES, V_T)
                        acc3, acc7, zacc = _v_scaled_product(acc3, acc7, zacc, b3, vcode3, vhi3, offs_z, 7, 3 * V_BITS,
                                                             DOT_T, IEEE, False, V_UNITS, V_T)
                else:
                    # plane s lies in value group (s * PV) // V_GROUP: (p * scale) is built once per group,
                    # and so is sum_n p * zero (added to every channel of the plane at the end);
                    # V_LANES: the plane's codes are 1024 + c * 2**shift, sum(p * scale) takes the 1024 out
                    a0 = _scaled_pt(pt, vsc0, DOT_T)  # (BLOCK_N, VR)
                    zsum0 += tl.sum(pt * vze0.to(tl.float32)[:, None], axis=0)
                    acc0 = _v_fold_product(acc0, a0, vcode0, IEEE, V_T)
                    if V_UNITS:
                        acc4 = _v_fold_product(acc4, a0, vhi0, IEEE, V_T)
                    if V_LANES:
                        sa0 = tl.sum(a0.to(tl.float32), axis=0)
                        asum0 += sa0
                    if PER_V > 1:
                        a1 = a0
                        if G1 != 0:
                            a1 = _scaled_pt(pt, vsc1, DOT_T)
                            zsum1 += tl.sum(pt * vze1.to(tl.float32)[:, None], axis=0)
                        acc1 = _v_fold_product(acc1, a1, vcode1, IEEE, V_T)
                        if V_UNITS:
                            acc5 = _v_fold_product(acc5, a1, vhi1, IEEE, V_T)
                        if V_LANES:
                            sa1 = sa0
                            if G1 != 0:
                                sa1 = tl.sum(a1.to(tl.float32), axis=0)
                            asum1 += sa1
                    if PER_V > 2:
                        a2 = a1
                        if G2 != G1:
                            a2 = _scaled_pt(pt, vsc2, DOT_T)
                            zsum2 += tl.sum(pt * vze2.to(tl.float32)[:, None], axis=0)
                        acc2 = _v_fold_product(acc2, a2, vcode2, IEEE, V_T)
                        if V_UNITS:
                            acc6 = _v_fold_product(acc6, a2, vhi2, IEEE, V_T)
                        a3 = a2
                        if G3 != G2:
                            a3 = _scaled_pt(pt, vsc3, DOT_T)
                            zsum3 += tl.sum(pt * vze3.to(tl.float32)[:, None], axis=0)
                        acc3 = _v_fold_product(acc3, a3, vcode3, IEEE, V_T)
                        if V_UNITS:
                            acc7 = _v_fold_product(acc7, a3, vhi3, IEEE, V_T)
                        if V_LANES:
                            sa2 = sa1
                            if G2 != G1:
                                sa2 = tl.sum(a2.to(tl.float32), axis=0)
                            sa3 = sa2
                            if G3 != G2:
                                sa3 = tl.sum(a3.to(tl.float32), axis=0)
                            asum2 += sa2
                            asum3 += sa3
            else:
                vb = tl.load(vc_base + offs_nv[:, None] * stride_vcn + offs_vw[None, :],
                             mask=_before(offs_nv, end, WHOLE)[:, None], other=0)
                p_dot = tl.trans(pt.to(DOT_T))  # (VR, BLOCK_N)
                vs_rows = vs_base + vrows
                vz_rows = vz_base + vrows
                acc0 = _v_deq_plane(acc0, p_dot, vb, vs_rows, vz_rows, 0, offs_pv, row_ok, V_GROUP,
                                    0, V_BITS, DOT_T, V_UNPACK, IEEE)
                if PER_V > 1:
                    acc1 = _v_deq_plane(acc1, p_dot, vb, vs_rows, vz_rows, PV, offs_pv, row_ok, V_GROUP,
                                        V_BITS, V_BITS, DOT_T, V_UNPACK, IEEE)
                if PER_V > 2:
                    acc2 = _v_deq_plane(acc2, p_dot, vb, vs_rows, vz_rows, 2 * PV, offs_pv, row_ok, V_GROUP,
                                        2 * V_BITS, V_BITS, DOT_T, V_UNPACK, IEEE)
                    acc3 = _v_deq_plane(acc3, p_dot, vb, vs_rows, vz_rows, 3 * PV, offs_pv, row_ok, V_GROUP,
                                        3 * V_BITS, V_BITS, DOT_T, V_UNPACK, IEEE)
            if V_MEAN != 0:
                pm = pt  # (BLOCK_N, VR)
                if V_MEAN == 8:  # sum_n p_n (c_n * s_n + z_n) = (p * s) @ c + sum_n p_n z_n
                    vms = tl.load(vms_base + offs_n * stride_vmsn, mask=row_ok, other=0.0).to(tl.float32)
                    vmz = tl.load(vmz_base + offs_n * stride_vmsn, mask=row_ok, other=0.0).to(tl.float32)
                    pm = pt * vms[:, None]
                    mzacc += tl.sum(pt * vmz[:, None], axis=0)
                # plane s: p @ mean[:, vc_s]; a lane-folded plane is scaled by 2**-(s * V_BITS) at the
                # end, so its mean term goes in times 2**(s * V_BITS) (exact)
                vm_rows = vm_base + offs_n[:, None] * stride_vmn  # (BLOCK_N, 1)
                if VM_APART:  # input channel order, added to the stored output at the end
                    macc = _dot(tl.trans(pm.to(DOT_T)), _mean_tile(vm_rows, offs_d, row_ok, V_MEAN, DOT_T), macc, IEEE)
                else:
                    acc0 = _dot(tl.trans(pm.to(DOT_T)), _mean_tile(vm_rows, vc0, row_ok, V_MEAN, DOT_T), acc0, IEEE)
                if (PER_V > 1) & (not VM_APART):
                    acc1 = _dot(tl.trans((pm * (1 << V_BITS) if V_LANES else pm).to(DOT_T)),
                                _mean_tile(vm_rows, vc1, row_ok, V_MEAN, DOT_T), acc1, IEEE)
                if (PER_V > 2) & (not VM_APART):
                    acc2 = _dot(tl.trans((pm * (1 << (2 * V_BITS)) if V_LANES else pm).to(DOT_T)),
                                _mean_tile(vm_rows, vc2, row_ok, V_MEAN, DOT_T), acc2, IEEE)
                    acc3 = _dot(tl.trans((pm * (1 << (3 * V_BITS)) if V_LANES else pm).to(DOT_T)),
                                _mean_tile(vm_rows, vc3, row_ok, V_MEAN, DOT_T), acc3, IEEE)
        if V_T:  # the transposed accumulators back to (VR, AW), (VR, ZW)
            acc0 = tl.trans(acc0)
            acc1 = tl.trans(acc1)
            acc2 = tl.trans(acc2)
            acc3 = tl.trans(acc3)
            acc4 = tl.trans(acc4)
            acc5 = tl.trans(acc5)
            acc6 = tl.trans(acc6)
            acc7 = tl.trans(acc7)
            zacc = tl.trans(zacc)
        if V_LANES:  # codes were 1024 + c * 2**(plane * V_BITS): remove both (exact scalings)
            acc0 = acc0 - 1024.0 * asum0[:, None]
            if NACC > 1:
                acc1 = (acc1 - 1024.0 * asum1[:, None]) * (1.0 / (1 << ((1 // V_NCH) * V_BITS)))
            if NACC > 2:
                acc2 = (acc2 - 1024.0 * asum2[:, None]) * (1.0 / (1 << ((2 // V_NCH) * V_BITS)))
                acc3 = (acc3 - 1024.0 * asum3[:, None]) * (1.0 / (1 << ((3 // V_NCH) * V_BITS)))
            if V_UNITS:  # the high bytes' planes (groups), scaled as the low bytes' are
                acc4 = acc4 - 1024.0 * asum0[:, None]
                if NACC > 1:
                    acc5 = (acc5 - 1024.0 * asum1[:, None]) * (1.0 / (1 << ((1 // V_NCH) * V_BITS)))
                if NACC > 2:
                    acc6 = (acc6 - 1024.0 * asum2[:, None]) * (1.0 / (1 << ((2 // V_NCH) * V_BITS)))
                    acc7 = (acc7 - 1024.0 * asum3[:, None]) * (1.0 / (1 << ((3 // V_NCH) * V_BITS)))
        if VM_APART:
            macc += mzacc[:, None]
        elif V_MEAN == 8:  # the 8-bit means' zero points, one per token, on every channel
            acc0 += mzacc[:, None]
            if PER_V > 1:
                acc1 += mzacc[:, None]
            if PER_V > 2:
                acc2 += mzacc[:, None]
                acc3 += mzacc[:, None]
        if V_FOLD:  # planes of one value group share its zero sum
            if V_NCH > 1:
                zsum0 = _column(zacc, offs_z, 0)
                zsum1 = _column(zacc, offs_z, 1)
                zsum2 = _column(zacc, offs_z, 2)
                zsum3 = _column(zacc, offs_z, 3)
            else:
                if G1 == 0:
                    zsum1 = zsum0
                if G2 == G1:
                    zsum2 = zsum1
                if G3 == G2:
                    zsum3 = zsum2
                if V_PLANE_LANES:  # plane s's 1024 term, column 4 + s (scaled by 2**-shift already)
                    zsum0 = zsum0 + _column(zacc, offs_z, 4)
                    zsum1 = zsum1 + _column(zacc, offs_z, 5)
                    zsum2 = zsum2 + _column(zacc, offs_z, 6)
                    zsum3 = zsum3 + _column(zacc, offs_z, 7)
            acc0 += zsum0[:, None]
            if NACC > 1:
                acc1 += zsum1[:, None]
            if NACC > 2:
                acc2 += zsum2[:, None]
                acc3 += zsum3[:, None]
            if V_UNITS:
                acc4 += zsum0[:, None]
                if NACC > 1:
                    acc5 += zsum1[:, None]
                if NACC > 2:
                    acc6 += zsum2[:, None]
                    acc7 += zsum3[:, None]
        if K_SUB > 1:  # each query row's K_SUB virtual rows merged by log-sum-exp (as splits are)
            m_sub = tl.reshape(m_i, (K_SUB, R_PAD))
            m_i = tl.max(m_sub, axis=0)  # (R_PAD,)
            w_sub = tl.exp2(m_sub - m_i[None, :])  # (K_SUB, R_PAD)
            l_i = tl.sum(tl.reshape(l_i, (K_SUB, R_PAD)) * w_sub, axis=0)
            acc0 = _merge_virtual_rows(acc0, w_sub, K_SUB, R_PAD, AW)
            if NACC > 1:
                acc1 = _merge_virtual_rows(acc1, w_sub, K_SUB, R_PAD, AW)
            if NACC > 2:
                acc2 = _merge_virtual_rows(acc2, w_sub, K_SUB, R_PAD, AW)
                acc3 = _merge_virtual_rows(acc3, w_sub, K_SUB, R_PAD, AW)
            if VM_APART:
                macc = _merge_virtual_rows(macc, w_sub, K_SUB, R_PAD, D)
        tl.store(M_part + part_row, m_i, mask=r_ok)
        tl.store(L_part + part_row, l_i, mask=r_ok)
        o_rows = O_part + part_row * D  # (R_PAD,) pointers
        tl.store(o_rows[:, None] + vc0[None, :], acc0, mask=r_ok[:, None])
        if NACC > 1:
            tl.store(o_rows[:, None] + vc1[None, :], acc1, mask=r_ok[:, None])
        if NACC > 2:
            tl.store(o_rows[:, None] + vc2[None, :], acc2, mask=r_ok[:, None])
            tl.store(o_rows[:, None] + vc3[None, :], acc3, mask=r_ok[:, None])
        if V_UNITS:
            tl.store(o_rows[:, None] + vh0[None, :], acc4, mask=r_ok[:, None])
            if NACC > 1:
                tl.store(o_rows[:, None] + vh1[None, :], acc5, mask=r_ok[:, None])
            if NACC > 2:
                tl.store(o_rows[:, None] + vh2[None, :], acc6, mask=r_ok[:, None])
                tl.store(o_rows[:, None] + vh3[None, :], acc7, mask=r_ok[:, None])
        if VM_APART:  # add the value mean (input channel order) onto the planes just stored
            tl.debug_barrier()  # other threads of the program stored them
            o_nat = o_rows[:, None] + offs_d[None, :]  # (R_PAD, D) pointers
            tl.store(o_nat, tl.load(o_nat, mask=r_ok[:, None], other=0.0) + macc, mask=r_ok[:, None])
    else:
        # ------------------------------------------------ one chunk of a full-precision segment
        c = pid_s - num_splits
        POOL_MASK: tl.constexpr = HAS_MASK & MASK_PACKED  # pool tokens come from the packed range
        if c >= n_f1_chunks + n_f2_chunks:
            _fp_chunk(q_rows, r_ok, part_row, M_part, L_part, O_part,
                      F3K + b.to(tl.int64) * stride_f3kb + h.to(tl.int64) * stride_f3kh,
                      F3V + b.to(tl.int64) * stride_f3vb + h.to(tl.int64) * stride_f3vh,
                      stride_f3kn, stride_f3vn, (c - n_f1_chunks - n_f2_chunks) * FP_BLOCK, F3_LEN,
                      MASK + b * stride_mb,
                      qk_scale, softcap, R_PAD, D, POOL_MASK, HAS_SOFTCAP, FP_T, FP_IEEE, FP_BLOCK,
                      F3P + b.to(tl.int64) * stride_f3pb + h.to(tl.int64) * stride_f3ph, True)
        elif c < n_f1_chunks:
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


@triton.jit(do_not_specialize=["S_TOT"])
def _combine_kernel(
    M_part, L_part, O_part, S_TOT,  # (ROWS, S_TOT), (ROWS, S_TOT), (ROWS, S_TOT, D) float32
    Out,  # (ROWS, D) float32 / float16 / bfloat16 (cast at the store), ROWS = B * Hq
    Lse,  # (ROWS,) float32, written when STORE_LSE
    D: tl.constexpr, DB: tl.constexpr, S_BLOCK: tl.constexpr, STORE_LSE: tl.constexpr = False,
    GDC: tl.constexpr = False,
):
    """out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s; 0 where nothing was visible.
    STORE_LSE: also the row's log-sum-exp of the scores in natural-log units (-inf: nothing
    visible), written by the programs of the first channel block.

    GDC: launched with programmatic dependent launch (``launch_pdl``) after the split kernel: wait
    until that grid has finished and its partials are visible before reading them.

    Program ``(row, c)`` merges channels ``[c * DB, (c + 1) * DB)`` of one row, S_BLOCK partials
    at a time with a running max (one pass; :func:`_combine` picks the sizes). Splitting the
    channels over programs keeps the merge parallel when there are few rows and many partials
    (batch 1: 32 rows x 256 splits), where one program per row was most of the call's time.
    """
    if GDC:
        tl.extra.cuda.gdc_wait()
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
             pdl: bool = False, channels: int | None = None) -> None:
    """Launch :func:`_combine_kernel` over ``out`` (B, Hq, D) (float32, or the caller's 16-bit dtype:
    the merge runs in float32 and rounds once at the store) from ``s_tot`` partials per row.
    ``lse`` (B, Hq) float32, when given, receives each row's log-sum-exp. ``pdl``: launched as the
    split kernel's programmatic dependent (that kernel was launched with ``GDC``).

    One warp per program, up to 128 partials a step, 16 channels a program (32 with <= 64
    partials): the best of 27 (step, channels, warps) choices within 1% at every (rows, partials)
    of the benchmark grid's shapes on an H200 (``artifacts/bench/combine_sweep.json``). The earlier
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
             {"D": d, "DB": db, "S_BLOCK": s_block, "STORE_LSE": lse is not None, "GDC": pdl, "num_warps": 1,
              **({"launch_pdl": True} if pdl else {})})


_COMBINE = FastLauncher(_combine_kernel)


# ---------------------------------------------------------------- launcher


@dataclass(frozen=True)
class DecodeConfig:
    """Tuning knobs (results do not depend on them beyond float rounding).

    - ``block_n``: packed tokens per loop step (for per-channel keys clamped to one key group, or
      two with ``key_group_pairs``: each key group of a block has its own virtual query rows).
    - ``num_warps``, ``num_stages``: Triton launch options of the split kernel.
    - ``unpack``: how codes become float16: 0 ``.to`` conversion; 1 magic-number float16 in
      Triton ops; 2 inline PTX on bytes; 3 inline PTX on int32 words (4 bytes per element, the
      planes of a word unpacked in registers, no byte shuffles); 4 the word path in Triton ops.
      5 inline PTX "lanes": one AND-OR per pair of codes, the code bits left in place and the
      1024 offset and ``2**shift`` plane scale folded into the key bias / query planes and the
      value accumulators (folded sides only; a side that dequantizes per element takes 2);
      6 the values of 5 in Triton ops (what the interpreter runs by default).
      2/3/5 are GPU only (fall back to 1/4/6 where their probe fails); None = 5, else 2, else 3
      on GPU (probes in order), 6 elsewhere.
    Defaults: the best of the sweep in ``kernels/bench/bench_decode.py`` on an H200 (Mistral-7B
    shape, 32k context, batch 1 and 8).
    - ``programs_per_sm``: target number of split programs per SM (split-K parallelism). 8: one
      wave of the loop's one-warp programs at ~255 registers (8 fit on an SM); 16 before, two
      waves: one is faster wherever the splits stay long (Qwen shape batch 1 / 128k 4-bit group
      32 46.0 -> 40.1 us, Mistral batch 1 / 32k 2-bit 22.8 -> 19.9 us; ``decode_sweep_ppsm8-*.json``).
    - ``whole_waves``: the packed split programs of all (batch, kv head) rows stay within
      ``programs_per_sm`` x SMs (splits per row rounded down, not up): a few programs past a
      whole wave run as a wave of their own (Mistral shape batch 8 / 128k at 8 per SM: 17 splits
      per row, 1088 programs, 1.6x slower than 16; batch 32 / 32k at 16 per SM: 9 -> 8 splits,
      0.481 -> 0.398 ms; ``decode_sweep_waves-mistral.json``).
      Why one warp per program by default: with 16 query rows (tl.dot's minimum M) Triton gives
      each warp whole rows of chained dots, so extra warps only repeat the same products and
      softmax; parallelism comes from more programs instead.
    - ``min_split_blocks``: fewest blocks per split (bounds the partials written and merged),
      unless that leaves fewer than ``min_splits`` splits or fewer than ``min_programs`` split
      programs in all (batch x kv heads x splits): then down to one block per split.
    - ``min_programs``: below half this many packed split programs at ``block_n`` with one
      block each (this many when a side has 8 bits, whose blocks cost more: Mistral shape, batch
      1 / 4k, 8-bit 12.0 -> 10.6 us on an H200, ``decode_sweep_b1-8bit.json``), blocks of
      ``small_block_n`` tokens instead (more, shorter splits; few kv heads at batch 1 and short
      contexts).
    - ``num_splits``: force the number of packed splits (tests); None = from programs_per_sm.
    - ``fp_block``: tokens per full-precision chunk program.
    - ``min_rows``: fewest query rows of a tile (the GQA group padded up to it). 16 fills one
      MMA tile with zero rows; smaller tiles leave the padding to Triton (rows are broadcast
      into the MMA fragment), which holds fewer registers but moves more.
    - ``maxnreg``: register cap per thread passed to ptxas (None: ptxas decides; with one warp
      per program it takes all 255, which caps occupancy at 8 warps per SM).
    - ``value_chunks``: value groups narrower than a plane of codes (e.g. 4-bit, head_dim 128,
      v_group 32) fold their scales per (plane, chunk of v_group byte columns) into one
      accumulator per group (at most 4 groups per head): the probabilities change layout once
      per block and are scaled per group in the products' operand; each group's zero sum (and
      lane 1024) accumulate by small products into one (rows, 16) tile, not by reductions across
      the warp (Mistral shape, keys 128 / values 32: 2,392 -> 1,605 SASS instructions per 64
      tokens; batch 8 / 32k 173.8 -> 130.7 us, ``decode_sweep_vg32-*-mistral.json``). Off: they
      dequantize per element (the slower path, kept for comparison: ``bench_decode.py --mode groups``).
    - ``key_group_pairs``: per-channel key groups shorter than ``block_n`` (e.g. 32 tokens) run in
      blocks of two key groups: the query rows are doubled into virtual rows, one set per key
      group (each folded with its group's scales, seeing only its group's tokens, with its own
      online softmax and accumulators), so one key product and one softmax cover the block, and
      the two sets merge by log-sum-exp at the end. False: blocks of one key group. None
      (default): on for head_dim <= 64 with <= 4 padded query rows and <= 4 bits, where it
      measured faster on an H200 (``decode_sweep_pairs-smol.json``, SmolLM2 shape, groups of 32,
      CUDA-graph time: batch 8 / 32k 4-bit 64.8 -> 45.2 us, 2-bit 82.9 -> 41.9 us; batch 1 / 128k
      37.0 -> 28.2 / 46.7 -> 26.2 us), off elsewhere: at head_dim 128 the doubled rows cost more
      registers than the halved per-block work saves (``decode_groups.json``, Mistral shape,
      batch 8 / 32k: 4-bit groups 32 / 32 211 -> 221 us, 8-bit 257 -> 285 us; only keys of 32
      with values of 128 gain, 182 -> 161 us; ``decode_sweep_pairs-b1.json``: Qwen shape (8
      padded rows) batch 1 / 128k 46 -> 57 us).
    - ``value_units``: the lane unpack (5, 6) reads the value codes of a folded layout (a plane in
      one value group, or value groups of >= 32 channels per chunk) as int16 units of two bytes,
      each unpacked elementwise into the codes of every plane of its low and its high byte
      (:func:`_unit_planes`), two accumulators per plane (or value group).
      A 16-bit tile reaches the value MMA's operand by ``ldmatrix.trans``; a byte tile took one
      shared-memory load per byte and permutes to pair consecutive tokens (loop body of the
      Mistral-7B shape, 2-bit: 1,456 -> 1,281 SASS instructions per 64 tokens,
      ``scripts/compile_sm90.py``). Needs value rows of >= 32 bytes (head_dim 128 at 2 bits, 64 at 4).
      On an H200 (``decode_sweep_units-*.json``): Mistral shape batch 8 / 32k 107.8 -> 99.6 us
      (2-bit), 128.3 -> 113.0 us (4-bit); the Qwen shape at batch 1 2-5% slower. Not used (the
      launcher keeps byte tiles) with two key groups per block (SmolLM2 group 32: 0.93x,
      ``decode_units_everywhere.json``) nor with a TaDA value mean and no permutation (the mean
      would accumulate apart: 1.18x, ``decode_fitted_units_everywhere.json``).
    - ``key_group_halves``: per-channel key groups of half a block (32 tokens in 64-token blocks)
      where ``key_group_pairs`` is off: each half of a block is one key group, its codes times its
      own folded query planes, the two score tiles stacked, so the softmax, value products and
      loop overhead run per 64 tokens instead of per 32 (Mistral shape, groups 32 / 32: 2 x 994
      -> 1,903 SASS instructions per 64 tokens; H200 batch 8 / 32k 194.8 -> 159.0 us, batch 1 /
      32k 32.5 -> 28.0 us, ``decode_sweep_halves-mistral.json``). Where a split would run a
      single block, one group per block instead if that gives at least ``halves_split_gain``
      times the splits and at most ``halves_max_splits`` splits per (batch, kv head) row (more
      parallelism, but not so many partials that their merge costs more): Mistral shape batch 1
      / 4k 10.8 -> 9.9 us without halves (62 -> 124 splits), while the Qwen shape kept them faster:
      batch 1 / 16k 12.7 -> 11.8 us (without them 512 splits a row to merge), 32k 15.8 -> 15.0 us
      and batch 8 / 4k 14.1 -> 13.7 us (without them no more splits), on an H200
      (``decode_sweep_halves-gain-*.json``).
    - ``value_sum_products``: folded value planes (a plane in one value group) build ``p * scale``
      in the products' float16 operand (the probabilities change layout once per block, as with
      value-group accumulators) and take each plane's lane 1024 term from one small product per
      group with a constant tile (:func:`_lane_terms`) instead of a float32 ``p * scale`` tile and
      its reduction across the warp; the zero sums stay reductions of p. Offline SASS per 64
      tokens (``KV_SUMDOTS=0/1 scripts/compile_sm90.py B 64 1 5 2 4``): Mistral shape 2-bit
      1,281 -> 1,198. On an H200 it pays at 2 bits only (``decode_sweep_sums3-*.json``, off -> on
      in one run, CUDA-graph time): Mistral batch 8 / 32k 99.5 -> 96.6 us (again 99.3 -> 96.1 in
      ``decode_sweep_sums2-mistral.json``), batch 1 / 32k 19.3 -> 18.6 us, SmolLM2 groups 64 batch 8
      39.0 -> 37.1 us, Qwen within +-1% (batch 1 / 4k 6.3 -> 6.6 us); 4-bit within +-1%, 8-bit 1-2%
      slower, SmolLM2 groups 32 (two key groups per block) 3-4% slower. An earlier form of the
      same computation (the group helper inlined: 1,227 instructions) measured slower even at 2
      bits (``decode_sweep_sums-*.json``: 99.5 -> 102.5 us): the gain is the compiler's schedule
      more than the work removed, and small.
      None (default): on for 2-bit values with one key group per block; True / False force it.
    - ``pdl``: launch the combine kernel as the split kernel's programmatic dependent (Hopper and
      later, triton with ``launch_pdl``; ignored elsewhere): each split program lets it launch at
      once and the combine waits on the device for the split grid, so its launch overlaps the
      split's tail instead of following it. Off by default: on an H200 it took 0.5-0.7 us off the
      shortest calls (batch 1 / 4k: Qwen shape 4-bit group 32 8.2 -> 7.5 us, 2-bit 6.5 -> 6.0 us;
      ``decode_sweep_pdl-*.json``), nothing at 16k and beyond or at batch 8, and whole CUDA-graph
      decode steps were no faster (``profile_step.json``, within the runs' noise).
    - ``early_value_scales``: where each block's per-token value scales and zeros load (16-bit
      loads, too narrow for Triton's asynchronous copies, so never pipelined): 0 where the value
      products use them, just after the softmax; 1 (default) at the top of the block, before the
      key work, whose time hides their latency; 2 one block ahead (loop-carried). Same arithmetic,
      so the same result (the CPU test checks exact equality). Nsight Compute on an H200
      (``kernels/bench/profile_ncu.py``, ``gpu_bench.sh ncu``; ``artifacts/bench/ncu_split*.json``)
      put 17% of the 2-bit kernel's warp stall samples on their first uses at 0 (waiting on DRAM,
      two warps per scheduler to hide it). On an H200 (``decode_sweep_early2-*.json``, one run,
      CUDA-graph time) 0 -> 1: Mistral shape batch 8 / 32k 2-bit 90.9 -> 81.5 us, 4-bit 109.2 ->
      100.1 us, groups 32 158.3 -> 144.6 us, batch 1 / 32k 2-bit 17.6 -> 16.1 us; Qwen shape batch 1
      group 32 16k / 32k 11.8 -> 11.2 / 15.1 -> 14.7 us. 2: within 1.5% of 1 at batch 8, slower at
      batch 1 group 32 (Mistral 32k 26.0 -> 27.4 us, Qwen 16k 11.2 -> 11.6 us). Loading the next
      key group's scales a block ahead as well (folded after the block's key product) measured no
      faster (81.3 -> 82.4 us, ``decode_sweep_early-keys-mistral.json``), nor did issuing each key
      group's parameters at the top of its block and folding them after the codes' unpack
      (within -0.7% / +1.3%, ``decode_sweep_earlyk-*.json``); neither was kept.
    - ``deep_pipeline_blocks``: one more pipeline stage (``num_stages`` + 1: the code tiles of
      two blocks ahead in flight, not one) where every packed split runs at least this many
      blocks, with one key group per block, one value accumulator per plane and no TaDA means.
      With two stages the next block's copies are issued at the end of a block and waited for at
      the top of the next, a few hundred instructions later: Nsight Compute put 8.1% of the 2-bit
      kernel's stall samples on that wait (``ncu_split.json``). On an H200
      (``decode_sweep_stages-*.json``, 2 -> 3 stages in one run, CUDA-graph time): Mistral shape
      batch 8 / 32k (32 blocks per split) 2-bit 81.0 -> 78.4 us, 4-bit 99.6 -> 95.8 us; batch 1 /
      32k (4 blocks per split) 1.5-4% slower, Qwen batch 1 0.2-1.5% slower; groups 32 (halves,
      value-group accumulators) 1.3-1.6x slower (the rule leaves them out). None: never.
      Layouts of <= 4 bits only, and ``early_value_scales`` only for values of <= 4 bits: at 8 bits
      the groups table (``decode_groups.json``, Mistral batch 8 / 32k) went 156 -> 192 us (group
      128), 209 -> 259 us (groups 32) and 307 -> 457 us (key pairs) across the two changes, and the
      sm_90 compile (``scripts/compile_sm90.py``, Triton 3.9) shows why: three stages of 8-bit code
      tiles take 52 KB of shared memory per program against 36 KB with two (4 instead of 6 programs
      fit an SM), and the early scales of 8-bit value groups 28.7 KB against 27.1 KB (groups 32) and
      26.6 KB (pairs), past the 28.2 KB at which 8 programs fit.
    - ``value_products_t``: the value products of folded planes read as int16 units (one value
      group per plane) run transposed, ``acc^T (channels, rows) += codes^T @ (p * scale)``: the
      value codes are loaded as a (units, tokens) tile, so the unpacked planes are the MMA's M
      operand as they stand, the probabilities stay in the key products' (tokens, rows) output
      orientation (no transposition of p per block), and the 4 query rows of a GQA group are the
      small N (padded to 8 by the MMA) instead of an M padded to 16: the value MMAs halve (sm_90
      compile, Mistral shape, per 64 tokens: HMMA 100 -> 68; instructions 2-bit 1,232 -> 1,083,
      4-bit 1,347 -> 1,240, 8-bit 1,647 -> 1,471; Qwen shape 2-bit 1,332 -> 1,190) and the
      accumulators take half the registers. On an H200 (``decode_sweep_vt-*.json``, CUDA-graph
      time, off -> on in one run): Mistral shape batch 8 / 32k 2-bit 78.0 -> 70.4 us, 4-bit
      97.5 -> 87.1, 8-bit 152.7 -> 140.2, keys 32 / values 128 115.7 -> 108.8; batch 1 / 32k 16.0
      -> 14.9 (2-bit), 19.8 -> 17.6 (4-bit); Qwen shape batch 8 / 32k 27.7 -> 25.2 / 33.4 -> 29.5.
      (A transposed value product was slower in ``kernels/bench/probe_swap.py`` on byte tiles, whose
      transposed operand went through shared memory after the unpack.) Value-group accumulators
      read as units (e.g. 4-bit, values in groups of 32) take it too, their zero points by one
      product with the transposed (16, BLOCK_N) zero tile: 4-bit groups 32 / 32 1,863 -> 1,664
      instructions, keys 128 / values 32 1,603 -> 1,367, 8-bit groups 32 2,060 -> 1,832. Byte
      tiles and a TaDA value mean keep the untransposed products. None (default): on wherever it
      applies but for value-group accumulators of <= 4 bits beside keys in block halves (4-bit
      groups 32 / 32, the KIVI presets' and ``kvcalib export``'s default), which measured no
      faster (``decode_sweep_vt-chunks-*.json``: Mistral batch 8 / 32k 145.6 -> 143.7 us, batch 1
      26.2 -> 27.2, Qwen batch 8 48.7 vs 47.7) against 4-bit keys 128 / values 32 118.9 -> 108.2
      and 8-bit groups 32 200.8 -> 189.8 (batch 8 / 32k). True / False: wherever it applies / never.
    - ``whole_blocks``: where every packed block of a call is whole and visible (packed length a
      multiple of ``block_n``, no packed range, no mask over the packed tokens, no OTT keep mask:
      the common decode step of equal-length sequences, eager or CUDA-graph), the loop runs without
      bounds masks: the token-index compares, the predicated loads and the score mask drop out of
      every block (the compiler folds the constant masks away). sm_90 compile
      (``scripts/compile_sm90.py``, per 64 tokens, after the one-``prmt`` lane unpack of
      :func:`_lanes_all_asm`): Mistral shape 2-bit 1,053 -> 974 instructions, 4-bit 1,177 -> 1,069,
      8-bit 1,215 -> 1,017, groups 32 / 32 (4-bit, key halves) 1,798 -> 1,663, keys 128 / values 32
      1,306 -> 1,140, 8-bit groups 32 1,570 -> 1,401; Qwen shape 2-bit 1,160 -> 1,083. On an H200
      (``decode_sweep_whole-*.json``, off -> on in one run, CUDA-graph time): Mistral batch 8 / 32k
      2-bit 69.0 -> 65.7 us, 4-bit 85.3 -> 84.5, 8-bit 138.0 -> 137.7 (at 92% of the copy
      bandwidth: memory-bound, fewer instructions do not show), groups 32 / 32 143.7 -> 130.5, keys
      128 / values 32 104.7 -> 102.8, 8-bit groups 32 185.4 -> 176.7; batch 1 / 32k within 4% (2-bit
      14.8 -> 14.4); Qwen shape batch 8 2-bit 24.8 -> 24.3 but 4-bit 29.1 -> 29.7 and groups 32 / 32
      46.9 -> 49.2, again in a second run (``decode_sweep_d64-new-*.json``: 28.9 -> 29.6, 47.3 ->
      49.2), and the SmolLM2 shape (head_dim 64, 3 query rows) 4-bit groups 32 / 32 38.6 -> 40.0 us
      at batch 8 / 32k, 23.5 -> 24.0 at batch 32 / 4k. Same arithmetic: the result is identical
      (the CPU test checks exact equality). None (default): on at head_dim >= 128 with <= 4 padded
      query rows (the Mistral-7B shape's GQA group of 4), or at 2 bits (Qwen 2-bit gained); True /
      False: wherever every block is whole / never.
    """

    block_n: int = 64
    num_warps: int = 1
    num_stages: int = 2
    unpack: int | None = None
    programs_per_sm: float = 8.0
    whole_waves: bool = True
    num_splits: int | None = None
    fp_block: int = 64
    min_split_blocks: int = 2  # 4 before: at batch 1 / 4k it halved the splits (0.031 -> 0.015 ms, artifacts/bench/decode_splits.json)
    min_splits: int = 64  # batch 1 / 4k: 31 -> 62 splits, 0.0131 -> 0.0109 ms (decode_splits.json)
    min_programs: int = 640  # Qwen2.5-1.5B shape (2 kv heads) at batch 1, 2-bit: 16k 13.7 -> 11.8 us (decode_splits_qwen2.5-1.5b.json)
    small_block_n: int = 32  # ... and 4k 8.5 -> 7.5 us
    min_rows: int = 4  # 16 before: 0.196 -> 0.159 ms at batch 8 / 32k, 2-bit, with unpack 5 (artifacts/bench/decode_tune.json)
    maxnreg: int | None = None
    value_chunks: bool = True
    key_group_pairs: bool | None = None
    pdl: bool = False
    value_units: bool = True
    key_group_halves: bool = True
    value_sum_products: bool | None = None
    halves_split_gain: float = 1.5
    halves_max_splits: int = 256
    early_value_scales: int = 1
    deep_pipeline_blocks: int | None = 16
    value_products_t: bool | None = None
    whole_blocks: bool | None = None

    def __post_init__(self) -> None:
        for name in ("block_n", "fp_block"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {v!r}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps!r}")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"num_stages must be a positive int, got {self.num_stages!r}")
        if self.unpack not in (None, 0, 1, 2, 3, 4, 5, 6):
            raise ValueError(f"unpack must be None or 0..6, got {self.unpack!r}")
        if not self.programs_per_sm > 0:
            raise ValueError(f"programs_per_sm must be > 0, got {self.programs_per_sm!r}")
        if not isinstance(self.min_splits, int) or self.min_splits < 1:
            raise ValueError(f"min_splits must be a positive int, got {self.min_splits!r}")
        if not isinstance(self.min_programs, int) or self.min_programs < 0:
            raise ValueError(f"min_programs must be an int >= 0, got {self.min_programs!r}")
        if not isinstance(self.small_block_n, int) or self.small_block_n < 16 or self.small_block_n & (self.small_block_n - 1):
            raise ValueError(f"small_block_n must be a power of two >= 16, got {self.small_block_n!r}")
        if not isinstance(self.min_split_blocks, int) or self.min_split_blocks < 1:
            raise ValueError(f"min_split_blocks must be a positive int, got {self.min_split_blocks!r}")
        if self.min_rows not in (1, 2, 4, 8, 16):
            raise ValueError(f"min_rows must be 1, 2, 4, 8 or 16, got {self.min_rows!r}")
        if self.maxnreg is not None and (not isinstance(self.maxnreg, int) or not 24 <= self.maxnreg <= 255):
            raise ValueError(f"maxnreg must be None or an int in [24, 255], got {self.maxnreg!r}")
        if not self.halves_split_gain > 0:
            raise ValueError(f"halves_split_gain must be > 0, got {self.halves_split_gain!r}")
        if not isinstance(self.halves_max_splits, int) or self.halves_max_splits < 1:
            raise ValueError(f"halves_max_splits must be a positive int, got {self.halves_max_splits!r}")
        if self.deep_pipeline_blocks is not None and (not isinstance(self.deep_pipeline_blocks, int)
                                                      or self.deep_pipeline_blocks < 1):
            raise ValueError(f"deep_pipeline_blocks must be None or a positive int, got {self.deep_pipeline_blocks!r}")
        if self.early_value_scales not in (0, 1, 2):
            raise ValueError(f"early_value_scales must be 0, 1 or 2, got {self.early_value_scales!r}")
        if self.num_splits is not None and (not isinstance(self.num_splits, int) or self.num_splits < 1):
            raise ValueError(f"num_splits must be None or a positive int, got {self.num_splits!r}")


DEFAULT_CONFIG = DecodeConfig()


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # plain Python: triton.cdiv is a (slow) constexpr-function wrapper


def _pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two <= cap dividing n."""
    b = 1
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b


def supports(*, head_dim: int, k_bits: int, v_bits: int, k_group: int, v_group: int,
             k_axis: str = "channel", rep: int = 1, block_n: int = DEFAULT_CONFIG.block_n) -> str | None:
    """None when :func:`decode_attention` handles this layout, else the reason it does not."""
    d = head_dim
    if d < 16 or d & (d - 1) or d > 512:
        return f"head_dim {d} is not a power of two in [16, 512]"
    for side, bits in (("k", k_bits), ("v", v_bits)):
        if bits not in (2, 4, 8):
            return f"{side}_bits {bits} is not 2, 4 or 8"
        if d * bits // 8 < 16:
            return f"{side}: {bits}-bit codes of head_dim {d} pack into fewer than 16 bytes (tl.dot needs >= 16)"
    if k_axis not in ("channel", "token"):
        return f"k_axis {k_axis!r} is not 'channel' or 'token'"
    if k_axis == "channel" and _pow2_divisor(k_group, block_n) < 16:
        return f"k_group {k_group} has no power-of-two divisor >= 16 (the key-scale fold needs one)"
    if k_axis == "token" and d % k_group:
        return f"k_group {k_group} does not divide head_dim {d}"
    if d % v_group:
        return f"v_group {v_group} does not divide head_dim {d}"
    if rep < 1 or rep > 64:
        return f"{rep} query heads per kv head is outside [1, 64]"
    return None


@triton.jit
def _probe_unpack_kernel(X, W, Y, SHIFT: tl.constexpr, BITS: tl.constexpr, N: tl.constexpr, P: tl.constexpr,
                         WORDS: tl.constexpr):
    if WORDS:
        offs_w = tl.arange(0, N)[:, None] * (P // 4) + tl.arange(0, P // 4)[None, :]
        offs_y = tl.arange(0, N)[:, None] * P + _perm4(tl.arange(0, P))[None, :]  # column k holds byte _perm4(k)
        tl.store(Y + offs_y, _codes_words(tl.load(W + offs_w), SHIFT, BITS, tl.float16, True))
    else:
        offs = tl.arange(0, N)[:, None] * P + tl.arange(0, P)[None, :]
        tl.store(Y + offs, _unpack_asm(tl.load(X + offs), SHIFT, BITS))


FAST_UNPACK_ERROR: dict[str, str] = {}  # kind -> why fast_unpack_available(kind=...) said False
_PROBING_LANES = False  # set while _lanes_verified runs the kernel with unpack=5 (no recursion)


def _lanes_mismatch(dev: torch.device, d: int, rep: int, k_bits: int, v_bits: int, k_group: int, v_group: int,
                    k_axis: str, config: DecodeConfig) -> str | None:
    """Run the split kernel of this layout and config with the PTX lane unpack (5) and with the
    same arithmetic in Triton ops (6) on random packed K/V; None when they agree, else what
    differed. The lane order the kernel undoes depends on how Triton lays the MMA operand
    registers out for the tile (seen to differ with two warps on one layout), so each compiled
    variant is checked on the device once before it is used. Two splits of several blocks each:
    with one block per split (what the plan gives so short a cache) two warps' lanes agreed here
    and were wrong across blocks (error 2.0 on the GPU grid case d=64, GQA 3, K8V2)."""
    global _PROBING_LANES

    gen = torch.Generator(device="cpu").manual_seed(0)
    h = 2
    n = 4 * k_group * max(1, 256 // k_group) if k_axis == "channel" else 512  # whole key groups
    q = torch.randn(1, h * rep, d, generator=gen).to(dev, torch.float16)

    def side(bits, group, per_token):
        codes = torch.randint(0, 256, (1, h, n, d * bits // 8), generator=gen, dtype=torch.uint8).to(dev)
        shape = (1, h, n, d // group) if per_token else (1, h, n // group, d)
        scale = (torch.rand(shape, generator=gen) * 0.2 + 0.01).to(dev, torch.float16)
        zero = torch.randn(shape, generator=gen).to(dev, torch.float16)
        return codes, scale, zero

    kc, ks, kz = side(k_bits, k_group, k_axis == "token")
    vc, vs, vz = side(v_bits, v_group, True)
    outs = []
    _PROBING_LANES = True
    try:
        for unpack in (5, 6):
            outs.append(_launch(q, kc, ks, kz, vc, vs, vz, k_bits=k_bits, v_bits=v_bits, k_group=k_group,
                                v_group=v_group, k_axis=k_axis, scaling=d ** -0.5, softcap=None, packed_start=None,
                                packed_end=None, packed_position=0, fp_segments=[], fp_positions=[], mask=None,
                                config=replace(config, unpack=unpack, num_splits=2)))
    finally:
        _PROBING_LANES = False
        _plan.cache_clear()  # plans made while probing trusted the lanes
    err = (outs[0] - outs[1]).abs().max().item()
    if not err <= 1e-3 * max(1.0, outs[1].abs().max().item()):
        return f"lane unpack differs from the Triton-ops lanes by {err:.3g}"
    return None


LANES_REFUSED: dict[tuple, str] = {}  # (layout, config) -> why its lane unpack was not used


@functools.lru_cache(maxsize=None)
def _lanes_verified(dev_index, d, rep, k_bits, v_bits, k_group, v_group, k_axis, config) -> bool:
    """Whether the lane unpack (5) of this layout and config compiles and agrees with unpack 6 on
    this GPU (once per variant; the reason for a refusal is kept in ``LANES_REFUSED``)."""
    key = (d, rep, k_bits, v_bits, k_group, v_group, k_axis, config)
    try:
        why = _lanes_mismatch(torch.device("cuda", dev_index), d, rep, k_bits, v_bits, k_group, v_group, k_axis,
                              config)
    except Exception as err:  # noqa: BLE001 - any compile/launch failure means "do not use it"
        why = f"{type(err).__name__}: {err}"[:2000]
    if why:
        LANES_REFUSED[key] = why
    return why is None


@functools.lru_cache(maxsize=None)
def fast_unpack_available(device_index: int = 0, kind: str = "words") -> bool:
    """Whether an inline-PTX unpack (``kind="bytes"``: ``unpack=2``; ``"words"``: ``unpack=3``)
    compiles and is exact on this GPU.

    Checked once per device on random bytes against ``(x >> shift) & mask``; False on CPU / in
    the interpreter (no inline assembly there) or if anything fails (the reason is kept in
    ``FAST_UNPACK_ERROR[kind]``).
    """
    if _interpreting() or not torch.cuda.is_available():
        FAST_UNPACK_ERROR[kind] = "no CUDA device (or the interpreter)"
        return False
    try:
        dev = torch.device("cuda", device_index)
        if kind == "lanes":  # the Mistral-7B layout at the default config
            why = _lanes_mismatch(dev, 128, 4, 2, 2, 128, 128, "channel", DEFAULT_CONFIG)
            if why is None:
                why = _lanes_mismatch(dev, 128, 4, 4, 4, 128, 128, "channel", DEFAULT_CONFIG)
            if why:
                FAST_UNPACK_ERROR[kind] = why
            return why is None
        x = torch.randint(0, 256, (64, 32), dtype=torch.uint8, device=dev)
        for bits in (2, 4, 8):
            for shift in range(0, 8, bits):
                y = torch.empty(x.shape, dtype=torch.float16, device=dev)
                _probe_unpack_kernel[(1,)](x, x.view(torch.int32), y, shift, bits, 64, 32, kind == "words")
                want = ((x >> shift) & ((1 << bits) - 1)).half()
                if not torch.equal(y, want):
                    FAST_UNPACK_ERROR[kind] = f"wrong codes for bits={bits} shift={shift}"
                    return False
        return True
    except Exception as err:  # noqa: BLE001 - any compile/launch failure means "not available here"
        FAST_UNPACK_ERROR[kind] = f"{type(err).__name__}: {err}"[:2000]
        return False


@functools.lru_cache(maxsize=None)
def _dummy(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A 1-element tensor standing in for an absent input (cached: no allocation per call)."""
    return torch.zeros(1, dtype=dtype, device=device)


def _tl_dtype(dt: torch.dtype):
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[dt]


def _check_fp(pair, b: int, h: int, d: int, i: int):
    k, v = pair
    if k.dim() != 4 or v.shape != k.shape or k.shape[0] != b or k.shape[1] != h or k.shape[3] != d:
        raise ValueError(f"fp segment {i}: k/v must both be (B={b}, H={h}, F, D={d}), got "
                         f"{tuple(k.shape)} / {tuple(v.shape)}")
    if k.dtype not in (torch.float16, torch.bfloat16, torch.float32) or v.dtype != k.dtype:
        raise ValueError(f"fp segment {i}: k/v must share a float16/bfloat16/float32 dtype, got {k.dtype}/{v.dtype}")
    if k.stride(3) != 1 or v.stride(3) != 1:
        raise ValueError(f"fp segment {i}: the last dim of k and v must be contiguous")


@functools.lru_cache(maxsize=None)
def _check_layout(d, rep, k_bits, v_bits, k_group, v_group, k_axis, block_n) -> None:
    why = supports(head_dim=d, k_bits=k_bits, v_bits=v_bits, k_group=k_group, v_group=v_group,
                   k_axis=k_axis, rep=rep, block_n=block_n)
    if why:
        raise ValueError(f"decode_attention does not support this layout: {why}")


def value_fold(head_dim: int, v_bits: int, v_group: int, chunks: bool = True) -> tuple[bool, int]:
    """How the split kernel reads values of this layout: ``(fold, chunks)``. ``(True, 1)``: a plane
    of codes lies in one value group, ``p * scale`` folds in once per plane; ``(True, c)``: value
    groups narrower than a plane (at most 4 per head, ``chunks`` allowed) fold per (plane, chunk
    of ``v_group`` byte columns), one accumulator per group; ``(False, 1)``: per-element
    dequantization."""
    pv = head_dim * v_bits // 8
    if v_group >= pv and v_group % pv == 0:
        return True, 1
    if chunks and pv % v_group == 0 and head_dim // v_group <= 4 and v_group >= 16:
        return True, pv // v_group
    return False, 1


@functools.lru_cache(maxsize=None)
def _plan(d, rep, k_bits, v_bits, k_group, v_group, k_axis, q_dtype, fp_dtype, dev_type, dev_index, config,
          interp):
    """The kernel's compile-time choices for one layout (cached): see the module docstring."""
    pk, pv = d * k_bits // 8, d * v_bits // 8
    ieee = q_dtype == torch.float32
    dot_t = tl.float32 if ieee else tl.float16
    unpack = config.unpack
    words_ok = pk % 4 == 0 and pv % 4 == 0  # int32 views of the code rows
    cuda = dev_type == "cuda"
    if ieee:
        unpack = 0  # exact float32 codes; the float16 tricks are for the float16 products
    elif unpack is None:  # the fastest that works here (DecodeConfig.unpack)
        if cuda and (_PROBING_LANES or _lanes_verified(dev_index, d, rep, k_bits, v_bits, k_group, v_group, k_axis,
                                                        config)):
            unpack = 5
        elif cuda and fast_unpack_available(dev_index, "bytes"):
            unpack = 2
        elif cuda and words_ok and fast_unpack_available(dev_index, "words"):
            unpack = 3
        else:
            unpack = 6
    elif unpack == 3 and not (cuda and fast_unpack_available(dev_index, "words")):
        unpack = 4  # no inline PTX here: the same trick in Triton ops
    elif unpack == 2 and not (cuda and fast_unpack_available(dev_index, "bytes")):
        unpack = 1
    elif unpack == 5 and not (cuda and (_PROBING_LANES or _lanes_verified(dev_index, d, rep, k_bits, v_bits, k_group,
                                                                          v_group, k_axis, config))):
        unpack = 2 if (cuda and fast_unpack_available(dev_index, "bytes")) else 6
    if unpack in (3, 4) and not words_ok:
        unpack = 1
    r_pad = max(config.min_rows, triton.next_power_of_2(rep))
    block_n = config.block_n
    if k_axis == "channel":  # blocks of one key group, or of two when key groups are shorter (key_group_pairs)
        kgb = _pow2_divisor(k_group, config.block_n)
        pairs = config.key_group_pairs
        if pairs is None:  # where it measured faster (DecodeConfig.key_group_pairs)
            pairs = d <= 64 and r_pad <= 4 and max(k_bits, v_bits) <= 4
        # key_group_halves: two groups per block without virtual rows, one per half of the block
        k_halves = (not pairs) and config.key_group_halves and 2 * kgb == config.block_n
        block_n = min(config.block_n, 2 * kgb) if (pairs or k_halves) else kgb
    else:
        k_halves = False
    k_fold = k_axis == "channel"
    # (not with the int32-word reads of unpack 3/4, whose columns come in words)
    v_fold, v_chunks = value_fold(d, v_bits, v_group, config.value_chunks and unpack not in (3, 4))
    # the lane unpacks (5 PTX, 6 Triton ops) leave 1024 + c * 2**shift for the folds to remove; a
    # side that dequantizes per element (no fold) takes the byte unpack of the same kind instead
    plain = 2 if (unpack == 5 and cuda and fast_unpack_available(dev_index, "bytes")) else 1
    k_unpack = plain if (unpack in (5, 6) and not k_fold) else unpack
    v_unpack = plain if (unpack in (5, 6) and not v_fold) else unpack
    # the interpreter's tl.dot has no bfloat16 (stored as uint16 there): float32 products instead
    fp_t = tl.float32 if (fp_dtype == torch.float32 or interp) else _tl_dtype(fp_dtype)
    fp_ieee = fp_dtype == torch.float32 or interp
    fp_block = max(16, min(config.fp_block, 8192 // d))  # (FP_BLOCK, D) K and V tiles: keep them <= 8K elements
    return (k_unpack, v_unpack), dot_t, ieee, block_n, k_fold, v_fold, v_chunks, r_pad, fp_t, fp_ieee, fp_block, k_halves


@functools.lru_cache(maxsize=None)
def _with_block_n(config: DecodeConfig, block_n: int) -> DecodeConfig:
    """``config`` with another ``block_n`` (one object per pair: the plan cache keys on it)."""
    return replace(config, block_n=block_n)


@functools.lru_cache(maxsize=None)
def _without_halves(config: DecodeConfig) -> DecodeConfig:
    """``config`` with ``key_group_halves`` off (one object per config: the plan cache keys on it)."""
    return replace(config, key_group_halves=False)


def _split_plan(n, block_n, f_lens, fp_block, bsz, h, dev, config):
    """Split-K plan shared by the fixed-width and Huffman kernels: ``n`` packed tokens in splits of
    whole ``block_n`` blocks (about ``programs_per_sm`` programs per SM, at least
    ``min_split_blocks`` blocks each), full-precision segments of ``f_lens`` tokens in ``fp_block``
    chunks. Returns (splits, split_size, chunks per segment, total partials)."""
    if n:
        n_blocks = _cdiv(n, block_n)
        if config.num_splits is not None:
            splits = min(config.num_splits, n_blocks)
        else:
            sms = _sm_count(dev.index or 0) if dev.type == "cuda" else 4
            cap = max(1, n_blocks // max(1, config.min_split_blocks))
            if cap < config.min_splits:  # short caches: down to one block per split
                cap = min(n_blocks, config.min_splits)
            if bsz * h * cap < config.min_programs:  # few (batch, kv head) rows: one block per split
                cap = n_blocks
            per_row = config.programs_per_sm * sms / (bsz * h)  # split programs per (batch, kv head) row
            splits = max(1, min(cap, math.floor(per_row) if config.whole_waves else math.ceil(per_row)))
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


def _work_split(n, block_n, f_lens, fp_block, bsz, h, hq, d, dev, config):
    """:func:`_split_plan` plus its buffers (:func:`_partials`): (splits, split_size, chunks per
    segment, total partials, (m, l, acc, out))."""
    splits, split_size, chunks, s_tot = _split_plan(n, block_n, f_lens, fp_block, bsz, h, dev, config)
    return splits, split_size, chunks, s_tot, _partials(bsz, hq, d, s_tot, dev)


@functools.lru_cache(maxsize=None)
def _pdl_available(dev: torch.device) -> bool:
    """Programmatic dependent launch: a CUDA device of compute capability >= 9 (Hopper) and a
    triton with ``tl.extra.cuda.gdc_wait`` and the ``launch_pdl`` option (not the interpreter)."""
    if dev.type != "cuda" or _interpreting():
        return False
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except Exception:
        return False
    return torch.cuda.get_device_capability(dev)[0] >= 9


def _reg_cap(config: DecodeConfig) -> dict:
    """``maxnreg`` launch option when the config sets one (not in the interpreter)."""
    return {} if config.maxnreg is None or _interpreting() else {"maxnreg": config.maxnreg}


def _check_perm(name: str, perm, h: int, d: int, dev) -> torch.Tensor:
    """An SKVQ permutation as the kernel reads it: int32 (H, D) contiguous on ``dev``."""
    if perm.dim() != 2 or tuple(perm.shape) != (h, d) or perm.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be an int32/int64 (H={h}, D={d}) permutation, got "
                         f"{perm.dtype} {tuple(perm.shape)}")
    if perm.device != dev:
        raise ValueError(f"{name} is on {perm.device}, the query on {dev}")
    return perm if (perm.dtype == torch.int32 and perm.is_contiguous()) else perm.to(torch.int32).contiguous()


def _check_mean(name: str, mean, b: int, n: int, d: int):
    """A TaDA mean as the kernel reads it: ``(bits, values, scale, zero)``. ``mean`` is float16
    ``(B, 1, N, D)`` (16-bit) or a tuple ``(codes uint8 (B, 1, N, D), scale, zero float16
    (B, 1, N, 1))`` (8-bit per-token codes over all D channels)."""
    if isinstance(mean, torch.Tensor):
        if mean.dtype != torch.float16 or tuple(mean.shape) != (b, 1, n, d) or mean.stride(3) != 1:
            raise ValueError(f"{name} must be float16 (B={b}, 1, N={n}, D={d}) with a contiguous last dim, got "
                             f"{mean.dtype} {tuple(mean.shape)}")
        return 16, mean, None, None
    if not isinstance(mean, (tuple, list)) or len(mean) != 3:
        raise ValueError(f"{name} must be a float16 tensor or a (codes, scale, zero) tuple")
    codes, scale, zero = mean
    if codes.dtype != torch.uint8 or tuple(codes.shape) != (b, 1, n, d) or codes.stride(3) != 1:
        raise ValueError(f"{name}: codes must be uint8 (B={b}, 1, N={n}, D={d}), got {codes.dtype} {tuple(codes.shape)}")
    for part, t in (("scale", scale), ("zero", zero)):
        if t.dtype != torch.float16 or tuple(t.shape) != (b, 1, n, 1):
            raise ValueError(f"{name}: {part} must be float16 (B={b}, 1, N={n}, 1), got {t.dtype} {tuple(t.shape)}")
    if scale.stride() != zero.stride():
        raise ValueError(f"{name}: scale and zero must have the same strides")
    return 8, codes, scale, zero


@dataclass
class _SplitCall:
    """One planned launch of :func:`_decode_split_kernel`: its grid ``(B * H, s_tot)`` and every
    argument after the query and the partial buffers."""

    bh: int
    s_tot: int
    args: tuple
    meta: dict


def _prepare(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, *, k_bits, v_bits, k_group, v_group,
             k_axis, scaling, softcap, packed_start, packed_end, packed_position, fp_segments, fp_positions,
             mask, config: DecodeConfig, k_perm=None, v_perm=None, k_mean=None, v_mean=None,
             mask_packed: bool = True, keep=None, keep_block: int = 0, pool=None) -> _SplitCall | None:
    """Check shapes/dtypes/contiguity, pick the code path and plan the split kernel's launch
    (None: nothing to attend to). ``q`` must have a contiguous last dim.

    Shapes: q (B, Hq, D); k_codes (B, H, N, PK) u8, PK = D*k_bits/8; k_scale/k_zero f16
    (B, H, N/k_group, D) [channel] or (B, H, N, D/k_group) [token]; v_codes (B, H, N, PV) u8;
    v_scale/v_zero f16 (B, H, N, D/v_group); fp segments (B, H, F, D); mask (B|1, L) bool/u8;
    packed_start/end (B,) int; k_perm/v_perm (H, D) int; k_mean/v_mean see :func:`_check_mean`;
    keep (B, H, R) u8 quant masks in blocks of keep_block tokens; pool (k, v (B, H, P, D), pos (B, H, P)).
    """
    bsz, hq, d = q.shape
    dev = q.device
    fp = [tuple(s) for s in fp_segments if s is not None and s[0] is not None and s[0].shape[2] > 0]
    positions = list(fp_positions) or [0] * len(fp_segments)
    fp_pos = [p for s, p in zip(fp_segments, positions) if s is not None and s[0] is not None and s[0].shape[2] > 0]
    if len(fp) > 2:
        raise ValueError(f"at most two full-precision segments, got {len(fp)}")
    n = 0 if k_codes is None else int(k_codes.shape[2])
    if pool is not None and pool[0].shape[2] == 0:
        pool = None
    if k_codes is not None:
        h = k_codes.shape[1]
    elif fp:
        h = fp[0][0].shape[1]
    elif pool is not None:
        h = pool[0].shape[1]
    else:
        return None
    if hq % h:
        raise ValueError(f"query heads {hq} are not a multiple of kv heads {h}")
    rep = hq // h
    _check_layout(d, rep, k_bits, v_bits, k_group, v_group, k_axis, config.block_n)
    for i, pair in enumerate(fp):
        _check_fp(pair, bsz, h, d, i)
    pk, pv = d * k_bits // 8, d * v_bits // 8
    if n:
        for name, t, shape in (("k_codes", k_codes, (bsz, h, n, pk)), ("v_codes", v_codes, (bsz, h, n, pv))):
            if t is None or t.dtype != torch.uint8 or tuple(t.shape) != shape:
                raise ValueError(f"{name} must be uint8 {shape}, got {None if t is None else (t.dtype, tuple(t.shape))}")
            if t.stride(3) != 1:
                raise ValueError(f"{name}: the packed (last) dim must be contiguous")
        kshape = (bsz, h, n // k_group, d) if k_axis == "channel" else (bsz, h, n, d // k_group)
        if k_axis == "channel" and n % k_group:
            raise ValueError(f"per-channel keys: N={n} must be a multiple of k_group={k_group}")
        vshape = (bsz, h, n, d // v_group)
        for name, t, shape in (("k_scale", k_scale, kshape), ("k_zero", k_zero, kshape),
                               ("v_scale", v_scale, vshape), ("v_zero", v_zero, vshape)):
            if t is None or t.dtype != torch.float16 or tuple(t.shape) != shape:
                raise ValueError(f"{name} must be float16 {shape}, got {None if t is None else (t.dtype, tuple(t.shape))}")
            if t.stride(3) != 1:
                raise ValueError(f"{name}: the last dim must be contiguous")
        if k_scale.stride() != k_zero.stride() or v_scale.stride() != v_zero.stride():
            raise ValueError("k_scale/k_zero (and v_scale/v_zero) must have the same strides")

    if keep is not None and n:
        if keep_block < 1:
            raise ValueError(f"keep needs keep_block >= 1 (tokens per quant-mask block), got {keep_block}")
        rows = _cdiv(n, keep_block) * _cdiv(keep_block, 8)
        if keep.dtype != torch.uint8 or keep.dim() != 3 or tuple(keep.shape[:2]) != (bsz, h) or keep.shape[2] < rows:
            raise ValueError(f"keep must be uint8 (B={bsz}, H={h}, >= {rows}), got {keep.dtype} {tuple(keep.shape)}")
        if keep.stride(2) != 1:
            raise ValueError("keep: the last dim must be contiguous")
    if pool is not None:
        _check_fp(pool[:2], bsz, h, d, "pool")
        slots = pool[2]  # (B, H, P) int32 positions
        if slots.dtype != torch.int32 or tuple(slots.shape) != tuple(pool[0].shape[:3]) or slots.stride(2) != 1:
            raise ValueError(f"pool positions must be int32 {tuple(pool[0].shape[:3])} with a contiguous last dim, "
                             f"got {slots.dtype} {tuple(slots.shape)}")

    # ---- code paths (decided once per layout / dtype / config / device: no per-step Python cost)
    fp_all = fp + ([pool[:2]] if pool is not None else [])
    # without fp segments their (unreached) code still shapes the kernel's register allocation: a
    # float32 fp branch made the packed loop of a window-less call (a PATS tier store) 1.3x slower
    fp_dtype = fp_all[0][0].dtype if fp_all else q.dtype
    if fp_all and any(s[0].dtype != fp_dtype for s in fp_all):
        raise ValueError("the full-precision segments (and the outlier pool) must share a dtype")
    interp = _interpreting()
    ((k_unpack, v_unpack), dot_t, ieee, block_n, k_fold, v_fold, v_chunks, r_pad, fp_t, fp_ieee, fp_block,
     k_halves) = _plan(
        d, rep, k_bits, v_bits, k_group, v_group, k_axis, q.dtype, fp_dtype, dev.type, dev.index or 0,
        config, interp)

    # ---- work split
    f_lens = [s[0].shape[2] for s in fp_all]  # sinks, window, pool (those present)
    small = config.small_block_n
    few = config.min_programs if max(k_bits, v_bits) == 8 else config.min_programs // 2
    if (n and config.num_splits is None and small < block_n and bsz * h * _cdiv(n, block_n) < few
            and (k_axis != "channel" or k_group % small == 0)):
        # few rows and a short cache: shorter blocks give more split programs; planned again, so
        # the lane unpack is verified for the block in use (its register order depends on the
        # tile: with two warps a 64-token check passed where 32-token blocks were wrong)
        ((k_unpack, v_unpack), dot_t, ieee, block_n, k_fold, v_fold, v_chunks, r_pad, fp_t, fp_ieee,
         fp_block, k_halves) = _plan(d, rep, k_bits, v_bits, k_group, v_group, k_axis, q.dtype, fp_dtype, dev.type,
                           dev.index or 0, _with_block_n(config, small), interp)
    splits, split_size, chunks, s_tot = _split_plan(n, block_n, f_lens, fp_block, bsz, h, dev, config)
    if k_halves and splits and split_size <= block_n:
        # one block per split: one group per block where that gives the splits more programs and
        # leaves few enough partials to merge (DecodeConfig.halves_split_gain, halves_max_splits)
        plan = _plan(d, rep, k_bits, v_bits, k_group, v_group, k_axis, q.dtype, fp_dtype, dev.type, dev.index or 0,
                     _without_halves(config), interp)
        split = _split_plan(n, plan[3], f_lens, plan[10], bsz, h, dev, config)
        if split[0] >= config.halves_split_gain * splits and split[0] <= config.halves_max_splits:
            ((k_unpack, v_unpack), dot_t, ieee, block_n, k_fold, v_fold, v_chunks, r_pad, fp_t, fp_ieee, fp_block,
             k_halves) = plan
            splits, split_size, chunks, s_tot = split
    if s_tot == 0:
        return None

    # ---- arguments (dummies where a part is absent; their code is never reached)
    dummy8 = _dummy(dev, torch.uint8)
    dummy16 = _dummy(dev, torch.float16)
    # key groups per block as virtual row sets (1 with key_group_halves: two groups, one per half)
    k_sub = block_n // _pow2_divisor(k_group, block_n) if (k_fold and not k_halves) else 1
    # folded value planes' lane terms by products (DecodeConfig.value_sum_products): by default at
    # 2 bits with one key group per block, where it measured faster
    v_sum_dots = config.value_sum_products
    if v_sum_dots is None:
        v_sum_dots = v_bits == 2 and k_sub == 1
    if n:
        kc, ks, kz, vc, vs, vz = k_codes, k_scale, k_zero, v_codes, v_scale, v_zero
        if k_unpack in (3, 4):  # read the code rows as int32 words: 4 packed bytes per load element
            kc, vc = kc.view(torch.int32), vc.view(torch.int32)
        # (not with two key groups per block, nor a value mean without a permutation: both measured
        # slower with units on an H200, DecodeConfig.value_units)
        # (>= 16 units per value group's tile: tl.dot's N; a value mean with chunks accumulates apart anyway)
        v_units = (config.value_units and v_fold and v_unpack in (5, 6) and d * v_bits // 8 >= 32 * v_chunks
                   and k_sub == 1 and (v_mean is None or v_perm is not None or v_chunks > 1)
                   and vc.stride(3) == 1 and vc.storage_offset() % 2 == 0 and all(st % 2 == 0 for st in vc.stride()[:3]))
        if v_units:  # value code rows as int16 units of two bytes (DecodeConfig.value_units)
            vc = vc.view(torch.int16)
        kcs, kss, vcs, vss = kc.stride()[:3], ks.stride()[:3], vc.stride()[:3], vs.stride()[:3]
    else:
        kc = vc = dummy8
        ks = kz = vs = vz = dummy16
        kcs = kss = vcs = vss = (0, 0, 0)
        v_units = False
    # SKVQ permutations and TaDA means of the packed tokens (absent: dummies, code not compiled)
    dummy32 = _dummy(dev, torch.int32)
    kp = _check_perm("k_perm", k_perm, h, d, dev) if (n and k_perm is not None) else dummy32
    vp = _check_perm("v_perm", v_perm, h, d, dev) if (n and v_perm is not None) else dummy32
    means = []
    for name, mean in (("k_mean", k_mean), ("v_mean", v_mean)):
        if n and mean is not None:
            bits, mv, ms, mz = _check_mean(name, mean, bsz, n, d)
            if ms is None:
                ms = mz = dummy16
                mss = (0, 0)
            else:
                mss = (ms.stride(0), ms.stride(2))
            means.append((bits, (mv, ms, mz, mv.stride(0), mv.stride(2), *mss)))
        else:
            means.append((0, (dummy16, dummy16, dummy16, 0, 0, 0, 0)))
    has_range = packed_start is not None or packed_end is not None
    if has_range:
        lo = (torch.zeros(bsz, dtype=torch.int32, device=dev) if packed_start is None
              else packed_start.to(device=dev, dtype=torch.int32).contiguous())
        hi = (torch.full((bsz,), n, dtype=torch.int32, device=dev) if packed_end is None
              else packed_end.to(device=dev, dtype=torch.int32).clamp(max=n).contiguous())
    else:
        lo = hi = _dummy(dev, torch.int32)
    has_mask = mask is not None
    if has_mask:
        if mask.dim() != 2 or mask.shape[0] not in (1, bsz):
            raise ValueError(f"mask must be (B|1, L) bool, got {tuple(mask.shape)}")
        mk = mask if mask.stride(1) == 1 else mask.contiguous()
        mk = mk.view(torch.uint8) if mk.dtype == torch.bool else mk.to(torch.uint8)
        stride_mb = 0 if mk.shape[0] == 1 else mk.stride(0)
    else:
        mk, stride_mb = dummy8, 0
    segs = []
    for i in range(2):
        if i < len(fp):
            fk, fv = fp[i]
            segs.append((fk, fv, *fk.stride()[:3], *fv.stride()[:3], f_lens[i], int(fp_pos[i])))
        else:
            z = _dummy(dev, fp_dtype)
            segs.append((z, z, 0, 0, 0, 0, 0, 0, 0, 0))
    n_f1 = chunks[0] if fp else 0
    n_f2 = chunks[1] if len(fp) > 1 else 0
    if pool is not None:
        pool_k, pool_v, pool_pos = pool  # (B, H, P, D) x 2, (B, H, P) int32
        pool_args = (pool_k, pool_v, *pool_k.stride()[:3], *pool_v.stride()[:3], pool_k.shape[2], pool_pos,
                     pool_pos.stride(0), pool_pos.stride(1))
    else:
        z = _dummy(dev, fp_dtype)
        pool_args = (z, z, 0, 0, 0, 0, 0, 0, 0, dummy32, 0, 0)
    has_keep = keep is not None and n > 0
    keep_args = (keep, keep.stride(0), keep.stride(1)) if has_keep else (dummy8, 0, 0)
    if softcap:
        qk_scale, cap = float(scaling), float(softcap)
    else:
        qk_scale, cap = float(scaling) * LOG2E, 1.0

    args = (kc, *kcs, ks, kz, *kss,
            vc, *vcs, vs, vz, *vss,
            lo, hi, n,
            mk, stride_mb, int(packed_position),
            *segs[0], *segs[1], *pool_args, *keep_args,
            kp, vp, *means[0][1], *means[1][1],
            splits, split_size, n_f1, n_f2,
            qk_scale, cap,
            h)
    # a third pipeline stage for long splits of the plain folded layout at <= 4 bits, and the
    # value scales loaded early for values of <= 4 bits (DecodeConfig.deep_pipeline_blocks,
    # early_value_scales: at 8 bits either one takes shared memory that fewer programs per SM share)
    deep_layout = (k_fold and k_sub == 1 and v_chunks == 1 and not means[0][0] and not means[1][0]
                   and max(k_bits, v_bits) <= 4)
    stages = _stages(config, split_size // block_n if splits else 0, deep_layout)
    v_early = int(config.early_value_scales) if v_bits <= 4 else 0
    meta = dict(R=rep, R_PAD=r_pad, D=d,
                K_BITS=k_bits, V_BITS=v_bits, PK=pk, PV=pv, K_GROUP=k_group, V_GROUP=v_group,
                K_FOLD=k_fold, V_FOLD=v_fold,
                HAS_RANGE=has_range, HAS_MASK=has_mask, HAS_SOFTCAP=bool(softcap),
                DOT_T=dot_t, IEEE=ieee, FP_T=fp_t, FP_IEEE=fp_ieee,
                K_UNPACK=k_unpack, V_UNPACK=v_unpack, BLOCK_N=block_n, FP_BLOCK=fp_block,
                K_PERM=kp is not dummy32, V_PERM=vp is not dummy32, K_MEAN=means[0][0], V_MEAN=means[1][0],
                MASK_PACKED=bool(mask_packed), HAS_KEEP=has_keep, KEEP_BLOCK=max(1, int(keep_block)), V_NCH=v_chunks,
                K_SUB=k_sub,
                GDC=config.pdl and _pdl_available(dev), V_UNITS=v_units, K_HALVES=k_halves,
                V_SUM_DOTS=bool(v_sum_dots), V_EARLY=v_early,
                V_T=_value_products_t(config, v_units, v_chunks, k_halves, v_bits, means[1][0]),
                WHOLE=bool(_whole_blocks(config, d, r_pad, k_bits, v_bits) and n and n % block_n == 0
                           and split_size % block_n == 0 and not has_range and not (has_mask and mask_packed)
                           and not has_keep),
                num_warps=config.num_warps, num_stages=stages, **_reg_cap(config))
    return _SplitCall(bsz * h, s_tot, args, meta)


def _whole_blocks(config: DecodeConfig, d: int, r_pad: int, k_bits: int, v_bits: int) -> bool:
    """Whether a call whose packed blocks are all whole runs unmasked (DecodeConfig.whole_blocks):
    by default (None) at head_dim >= 128 with <= 4 padded query rows, or at 2 bits, where it
    measured faster; True / False force it."""
    if config.whole_blocks is None:
        return d >= 128 and (r_pad <= 4 or k_bits == v_bits == 2)
    return bool(config.whole_blocks)


def _value_products_t(config: DecodeConfig, v_units: bool, v_chunks: int, k_halves: bool, v_bits: int,
                      v_mean: int) -> bool:
    """Whether the value products run transposed (DecodeConfig.value_products_t): only on value
    codes read as units without a TaDA value mean; by default (None) everywhere there but for
    value-group accumulators of <= 4 bits beside keys in block halves, where it measured no faster."""
    if not v_units or v_mean:
        return False
    if config.value_products_t is None:
        return not (v_chunks > 1 and k_halves and v_bits <= 4)
    return bool(config.value_products_t)


def _run(q: torch.Tensor, calls: list[_SplitCall | None], return_lse: bool, out_dtype=torch.float32):
    """Launch the planned split kernels into one partial buffer (each call its own columns),
    then one combine over all of them: the calls must cover disjoint tokens of one cache.
    Returns (B, Hq, D) ``out_dtype`` (0 where nothing is visible), with ``return_lse`` also the
    rows' log-sum-exp (B, Hq) float32 (-inf there)."""
    bsz, hq, d = q.shape
    calls = [c for c in calls if c is not None]
    s_all = sum(c.s_tot for c in calls)
    m_part, l_part, o_part, out = _partials(bsz, hq, d, s_all, q.device, _check_out_dtype(out_dtype))
    if s_all == 0:
        out.zero_()
        return (out, torch.full((bsz, hq), float("-inf"), device=q.device)) if return_lse else out
    s_off = 0
    for c in calls:
        _SPLIT((c.bh, c.s_tot), (q, q.stride(0), q.stride(1), m_part, l_part, o_part, s_all, s_off, *c.args), c.meta)
        s_off += c.s_tot
    lse = torch.empty((bsz, hq), dtype=torch.float32, device=q.device) if return_lse else None  # (B, Hq)
    # the combine waits on the last split launch only: the ones before it completed before it began
    _combine(m_part, l_part, o_part, s_all, out, lse, pdl=calls[-1].meta["GDC"])
    return (out, lse) if return_lse else out


_SPLIT = FastLauncher(_decode_split_kernel)


def _stages(config: DecodeConfig, blocks_per_split: int, deep_layout: bool) -> int:
    """Pipeline stages of the split kernel: ``num_stages``, one more where every packed split runs
    at least ``deep_pipeline_blocks`` blocks of a layout that takes it (``deep_layout``: <= 4 bits,
    one key group folded per block, one value accumulator per plane, no TaDA means): see DecodeConfig."""
    deep = config.deep_pipeline_blocks
    return config.num_stages + (deep is not None and deep_layout and blocks_per_split >= deep)


def _check_q(q) -> torch.Tensor:
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.dtype not in (torch.float16, torch.bfloat16,
                                                                          torch.float32):
        raise ValueError(f"q must be (B, Hq, D) float16/bfloat16/float32, got "
                         f"{tuple(getattr(q, 'shape', ()))} {getattr(q, 'dtype', type(q))}")
    return q if q.stride(2) == 1 else q.contiguous()


def _check_out_dtype(dtype) -> torch.dtype:
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"out_dtype must be torch.float32, float16 or bfloat16, got {dtype!r}")
    return dtype


def _launch(q, *args, return_lse: bool = False, out_dtype=torch.float32, **kwargs):
    """One call: :func:`_prepare` then :func:`_run` (split + combine kernels)."""
    q = _check_q(q)
    return _run(q, [_prepare(q, *args, **kwargs)], return_lse, out_dtype)


# ---------------------------------------------------------------- public function


def decode_attention(
    q: torch.Tensor,
    k_codes: torch.Tensor | None,
    k_scale: torch.Tensor | None,
    k_zero: torch.Tensor | None,
    v_codes: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    v_zero: torch.Tensor | None,
    *,
    k_bits: int,
    v_bits: int,
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
    mask_packed: bool = True,
    keep: torch.Tensor | None = None,
    keep_block: int = 0,
    pool: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    k_perm: torch.Tensor | None = None,
    v_perm: torch.Tensor | None = None,
    k_mean: torch.Tensor | tuple | None = None,
    v_mean: torch.Tensor | tuple | None = None,
    config: DecodeConfig | None = None,
    return_lse: bool = False,
    out_dtype: torch.dtype = torch.float32,
):
    """Attention of one query token per sequence over a packed + full-precision KV cache.

    Same arguments and result as :func:`kvcalib_kernels.reference.decode_attention_reference`
    (float32 ``(B, Hq, D)``), plus ``config`` (:class:`DecodeConfig`, tuning only) and
    ``out_dtype`` (float16 / bfloat16: the float32 result rounded once by the combine kernel's
    store, so a caller needs no cast kernel of its own). Runs on CUDA
    tensors, or on CPU tensors under ``TRITON_INTERPRET=1``. Raises ValueError on shapes, dtypes
    or layouts it does not handle (:func:`supports` says which, without raising).
    """
    return _launch(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_bits=k_bits, v_bits=v_bits,
                   k_group=k_group, v_group=v_group, k_axis=k_axis, scaling=scaling, softcap=softcap,
                   packed_start=packed_start, packed_end=packed_end, packed_position=packed_position,
                   fp_segments=fp_segments, fp_positions=fp_positions, mask=mask, mask_packed=mask_packed,
                   keep=keep, keep_block=keep_block, pool=pool, return_lse=return_lse, out_dtype=out_dtype,
                   config=config or DEFAULT_CONFIG, k_perm=k_perm, v_perm=v_perm, k_mean=k_mean, v_mean=v_mean)


def decode_attention_parts(
    q: torch.Tensor,
    parts: Sequence[Mapping[str, Any]],
    *,
    config: DecodeConfig | None = None,
    return_lse: bool = False,
    out_dtype: torch.dtype = torch.float32,
):
    """Attention over a cache stored as disjoint parts, e.g. PATS tier stores (each its own bits):
    one split launch per part, all writing one partial buffer, and one combine over all partials
    (no per-part combine, no separate merge).

    ``parts``: one mapping per part with :func:`decode_attention`'s arguments after ``q`` by
    name (``k_codes`` ... ``v_zero`` may be None or absent for a part with no packed tokens).
    Same result as :func:`kvcalib_kernels.reference.decode_attention_parts_reference`
    (``out_dtype`` as in :func:`decode_attention`).
    """
    q = _check_q(q)
    cfg = config or DEFAULT_CONFIG
    calls = []
    for i, part in enumerate(parts):
        unknown = part.keys() - _PART_DEFAULTS.keys() - _PART_REQUIRED
        if unknown:
            raise ValueError(f"part {i}: unknown arguments {sorted(unknown)}")
        missing = _PART_REQUIRED - part.keys()
        if missing:
            raise ValueError(f"part {i}: missing {', '.join(sorted(missing))}")
        calls.append(_prepare(q, **{**_PART_DEFAULTS, **part}, config=cfg))
    return _run(q, calls, return_lse, out_dtype)


_PACKED_NAMES = ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero")
# what a part may name: decode_attention's arguments after q, less the per-call ones; those with
# a default (the packed tensors: None, a part without packed tokens) and those it must give
_PART_PARAMS = {name: param for name, param in inspect.signature(decode_attention).parameters.items()
                if name not in ("q", "config", "return_lse", "out_dtype")}
_PART_DEFAULTS = {name: None if param.default is param.empty else param.default
                  for name, param in _PART_PARAMS.items() if param.default is not param.empty or name in _PACKED_NAMES}
_PART_REQUIRED = frozenset(_PART_PARAMS) - _PART_DEFAULTS.keys()
