"""Helpers shared by the decode kernels (fixed-width :mod:`kvcalib_kernels.decode_attention` and
Huffman :mod:`kvcalib_kernels.decode_attention_huffman`): the float products, the soft cap, the
full-precision chunk (sinks, window, OTT pool) and the host-side checks and dummies.

Every program of both split kernels writes a partial ``(m, l, acc)`` in the log2 domain (scores
times ``log2(e)``, ``exp2`` instead of ``exp``); :mod:`.combine` merges them.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # exp(x) = exp2(x * log2(e)): the kernels use exp2


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # plain Python: triton.cdiv is a (slow) constexpr-function wrapper


def _pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two <= cap dividing n."""
    b = 1
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b



@functools.lru_cache(maxsize=None)
def _dummy(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A 1-element tensor standing in for an absent input (cached: no allocation per call)."""
    return torch.zeros(1, dtype=dtype, device=device)


def _tl_dtype(dt: torch.dtype):
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[dt]


def _packed_range(packed_start, packed_end, bsz: int, n: int, dev):
    """The kernels' valid packed range per batch row: (has_range, lo, hi), lo/hi int32 (B,) on
    ``dev`` (dummies without a range: the kernel does not read them)."""
    if packed_start is None and packed_end is None:
        dummy = _dummy(dev, torch.int32)
        return False, dummy, dummy
    lo = (torch.zeros(bsz, dtype=torch.int32, device=dev) if packed_start is None
          else packed_start.to(device=dev, dtype=torch.int32).contiguous())
    # (the kernels clamp hi to the packed tokens themselves: a clamp here would be one more
    # launch per eager call, and a stable launch's device range already stays within them)
    hi = (torch.full((bsz,), n, dtype=torch.int32, device=dev) if packed_end is None
          else packed_end.to(device=dev, dtype=torch.int32).contiguous())
    return True, lo, hi


@triton.jit
def _split_range(P_LO, P_HI, b, N, pid_s, num_splits, split_size, BLOCK_N: tl.constexpr,
                 HAS_RANGE: tl.constexpr, BALANCED: tl.constexpr):
    """Packed split ``pid_s`` of batch row ``b``: (lo, hi, start, end), the row's valid range
    [lo, hi) (hi clamped to the N packed tokens) and the split's token range [start, end).

    Static splits (BALANCED False) are the launcher's ``split_size`` tokens from 0: a split before
    lo or past hi runs no block. BALANCED (a range on the device): the row's blocks from lo's
    block to hi are spread evenly over the ``num_splits`` splits, so a stable launch over a
    store's whole allocation, whose plan counted the allocation, runs each split no longer than
    the plan of exactly its live tokens would (the work past the live count was the critical
    path's: batch 8 / 32k 2-bit +15%), and a left-padded row's splits share its tokens."""
    lo = 0
    hi = N
    if HAS_RANGE:
        lo = tl.load(P_LO + b)
        hi = tl.minimum(tl.load(P_HI + b), N)
    first = (lo // BLOCK_N) * BLOCK_N  # skip whole blocks of left padding
    if BALANCED:
        per = tl.cdiv(tl.cdiv(tl.maximum(hi - first, 0), BLOCK_N), num_splits) * BLOCK_N
        start = first + pid_s * per
        end = tl.minimum(start + per, hi)
    else:
        s0 = pid_s * split_size
        start = tl.maximum(s0, first)
        end = tl.minimum(s0 + split_size, hi)
    return lo, hi, start, end


def _visibility(mask, bsz: int, dev):
    """The kernels' visibility mask over absolute positions: (has_mask, uint8 (B|1, L) with a
    contiguous last dim, batch stride: 0 when one row is shared)."""
    if mask is None:
        return False, _dummy(dev, torch.uint8), 0
    if mask.dim() != 2 or mask.shape[0] not in (1, bsz):
        raise ValueError(f"mask must be (B|1, L) bool, got {tuple(mask.shape)}")
    mk = mask if mask.stride(1) == 1 else mask.contiguous()
    mk = mk.view(torch.uint8) if mk.dtype == torch.bool else mk.to(torch.uint8)
    return True, mk, 0 if mk.shape[0] == 1 else mk.stride(0)


def _fp_segment_args(fp, fp_pos, f_lens, fp_dtype, dev) -> list[tuple]:
    """The kernels' arguments of full-precision segments 1 and 2 (sinks, window): per segment
    (k, v, k strides (B, H, F), v strides, tokens, absolute position of its first token), dummies
    where a segment is absent."""
    args = []
    for i in range(2):
        if i < len(fp):
            fk, fv = fp[i]
            args.append((fk, fv, *fk.stride()[:3], *fv.stride()[:3], f_lens[i], int(fp_pos[i])))
        else:
            z = _dummy(dev, fp_dtype)
            args.append((z, z, 0, 0, 0, 0, 0, 0, 0, 0))
    return args


def _check_fp(pair, b: int, h: int, d: int, i: int):
    k, v = pair
    if k.dim() != 4 or v.shape != k.shape or k.shape[0] != b or k.shape[1] != h or k.shape[3] != d:
        raise ValueError(f"fp segment {i}: k/v must both be (B={b}, H={h}, F, D={d}), got "
                         f"{tuple(k.shape)} / {tuple(v.shape)}")
    if k.dtype not in (torch.float16, torch.bfloat16, torch.float32) or v.dtype != k.dtype:
        raise ValueError(f"fp segment {i}: k/v must share a float16/bfloat16/float32 dtype, got {k.dtype}/{v.dtype}")
    if k.stride(3) != 1 or v.stride(3) != 1:
        raise ValueError(f"fp segment {i}: the last dim of k and v must be contiguous")


# ---------------------------------------------------------------- device helpers


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """``acc + a @ b``; IEEE float32 products for float32 operands (tf32 would lose ~1e-3)."""
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)



@triton.jit
def _softcap(s, softcap):
    """``softcap * tanh(s / softcap)`` with tanh from exp2 (portable to the interpreter)."""
    e = tl.exp2(s * (2.0 * 1.4426950408889634 / softcap))  # exp(2 s / softcap)
    return softcap * (1.0 - 2.0 / (e + 1.0))



@triton.jit
def _column(x, offs_z, G: tl.constexpr):
    """Column G of x (rows, ZW) as (rows,)."""
    return tl.sum(tl.where(offs_z[None, :] == G, x, 0.0), axis=1)



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
