"""The per-call products of a rotated cache side (kernel -> launcher): the query rotated like
the stored keys before the split kernel, and the packed splits' value accumulators rotated back
to the input basis before the combine (or, on calls with rows enough, inside it: :mod:`.combine`).

A rotation is :mod:`kvcalib.quant.rotation`'s ``R_h = diag(signs_h) @ M_h`` per kv head:
forward ``y = (x * signs_h) @ M_h``, inverse ``y = (x @ M_h^T) * signs_h``. The PyTorch functions
there (``rotate`` / ``unrotate``) are the specification; these kernels compute the same products
in float32: three TF32 tensor-core products per dot ("tf32x3", float32 accuracy; the "ieee"
FMA products took ~470 us per call on an H200, spilling registers) on a GPU, IEEE under Triton's
interpreter. Done as PyTorch operations around the split kernel the two
products were about ten small PyTorch launches, 25-33 us per attention call on an H200 whatever the
shape; as the two launches below, 13-15 us (``benchmarks/fitted.py``, docs/results.md).

Where each product runs (:mod:`.plan`): the query of a fitted matrix by :func:`rotate_query`,
one launch before the split kernel (a random-sign Walsh-Hadamard query is rotated by the split
kernel itself, ``ROT_Q``: a fast transform, no matrix); the accumulators by :func:`rotate_back_partials`, one launch after it,
on calls with fewer than ``plan.COMBINE_ROTATION_MIN_ROWS`` (batch x kv heads) rows, else inside
the merge (:func:`.combine._combine_rotated_kernel`), which saves that launch where it has
programs enough (the numbers are at ``COMBINE_ROTATION_MIN_ROWS``).

:func:`_rotate_rows_kernel`: one program takes ``BLOCK_T`` rows of one (batch, kv head): the query
heads of that kv head (the query), or its query heads x packed splits (the accumulators,
rewritten in place: a program reads all ``D`` channels of its rows before it writes them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcalib_kernels.decode.common import _interpreting
from kvcalib_kernels.launch import FastLauncher


@triton.jit
def _rotate_rows_kernel(
    X, stride_xb, stride_xh, stride_xr, stride_xs,  # rows of (b, kv head h, query head r, split s) x D
    Y, stride_yb, stride_yh, stride_yr, stride_ys,  # the same rows of the output (may be X)
    M, stride_mh,  # rotation matrix (D, D) float32 row-major; stride_mh 0: one shared by the heads
    SIGNS,  # (H, D) float32 +-1, read when HAS_SIGNS
    H, R, S,  # kv heads, query heads per kv head, splits (1 for the query)
    D: tl.constexpr, DJ: tl.constexpr, BLOCK_T: tl.constexpr, INVERSE: tl.constexpr,
    HAS_SIGNS: tl.constexpr, PRECISION: tl.constexpr,
):
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)  # (BLOCK_T,) row index r * S + s
    ok = t < R * S
    r = t // S
    s = t % S
    offs_d = tl.arange(0, D)
    x_rows = X + b.to(tl.int64) * stride_xb + h * stride_xh + r * stride_xr + s * stride_xs  # (BLOCK_T,)
    x = tl.load(x_rows[:, None] + offs_d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)  # (BLOCK_T, D)
    if HAS_SIGNS and not INVERSE:
        x = x * tl.load(SIGNS + h * D + offs_d)[None, :]  # (BLOCK_T, D)
    i = tl.arange(0, D)[:, None]  # (D, 1) input channel
    y_rows = Y + b.to(tl.int64) * stride_yb + h * stride_yh + r * stride_yr + s * stride_ys  # (BLOCK_T,)
    # DJ output channels at a time: a (D, DJ) piece of the matrix in shared memory, not all of it
    # (head_dim 256 would need 256 KB); every piece reads the rows loaded above, so writing the
    # output in place (Y = X) is safe
    for j0 in tl.static_range(0, D, DJ):
        j = j0 + tl.arange(0, DJ)  # (DJ,) output channels
        if INVERSE:  # y = (x @ M^T) * signs: M^T[i, j] = M[j, i]
            m = tl.load(M + h * stride_mh + j[None, :] * D + i)  # (D, DJ)
        else:  # y = (x * signs) @ M
            m = tl.load(M + h * stride_mh + i * D + j[None, :])  # (D, DJ)
        y = tl.dot(x, m, input_precision=PRECISION)  # (BLOCK_T, DJ) float32
        if HAS_SIGNS and INVERSE:
            y = y * tl.load(SIGNS + h * D + j)[None, :]
        tl.store(y_rows[:, None] + j[None, :], y, mask=ok[:, None])


_ROTATE = FastLauncher(_rotate_rows_kernel)


def _precision() -> str:
    return "ieee" if _interpreting() else "tf32x3"


def _block_t(rows: int) -> int:
    # tl.dot takes >= 16 rows; up to 64 rows a program keeps the (D, D) matrix's reads per row low
    return min(64, max(16, triton.next_power_of_2(rows)))


def _matrix_args(rot) -> tuple[torch.Tensor, int, torch.Tensor, bool]:
    matrix, signs = rot  # (D, D) | (H, D, D) float32, (H, D) float32 | None (checked by the caller)
    m = matrix.contiguous()
    return m, (m.stride(0) if m.dim() == 3 else 0), (m if signs is None else signs.contiguous()), signs is not None


def rotate_query(q: torch.Tensor, h: int, rot) -> torch.Tensor:
    """``q (B, Hq, D)`` (last dim contiguous, any float dtype) rotated by kv head ``i // (Hq / h)``'s
    rotation: float32 ``(B, Hq, D)``, what ``rotate(q.view(B, h, rep, D), *rot)`` gives."""
    bsz, hq, d = q.shape
    rep = hq // h
    out = torch.empty((bsz, hq, d), dtype=torch.float32, device=q.device)  # (B, Hq, D)
    m, stride_mh, signs, has_signs = _matrix_args(rot)
    block = _block_t(rep)
    _ROTATE((bsz * h, triton.cdiv(rep, block)),
            (q, q.stride(0), rep * q.stride(1), q.stride(1), 0,
             out, out.stride(0), rep * out.stride(1), out.stride(1), 0,
             m, stride_mh, signs, h, rep, 1),
            {"D": d, "DJ": min(d, 64), "BLOCK_T": block, "INVERSE": False, "HAS_SIGNS": has_signs,
             "PRECISION": _precision(), "num_warps": 4})
    return out


def rotate_back_partials(o_part: torch.Tensor, bsz: int, h: int, s_off: int, splits: int, rot) -> None:
    """Rotate the packed splits' value accumulators of one call back to the input basis, in place:
    ``o_part`` (B*Hq, S, D) float32 contiguous, columns ``[s_off, s_off + splits)`` of every row,
    ``acc -> acc R^T`` per kv head (linear, so the combine's weights may come after)."""
    rows, s_all, d = o_part.shape
    rep = rows // (bsz * h)
    base = o_part[:, s_off:]  # column s_off onwards: the kernel's row (r, s) is column s_off + s
    sb, sr, ss = h * rep * s_all * d, s_all * d, d  # batch, query head, split strides of o_part
    m, stride_mh, signs, has_signs = _matrix_args(rot)
    block = _block_t(rep * splits)
    _ROTATE((bsz * h, triton.cdiv(rep * splits, block)),
            (base, sb, rep * sr, sr, ss, base, sb, rep * sr, sr, ss,
             m, stride_mh, signs, h, rep, splits),
            {"D": d, "DJ": min(d, 64), "BLOCK_T": block, "INVERSE": True, "HAS_SIGNS": has_signs,
             "PRECISION": _precision(), "num_warps": 4})
