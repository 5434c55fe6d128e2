"""The per-call products of a rotated cache side (kernel -> launcher): the query rotated like
the stored keys before the split kernel, and the packed splits' value accumulators rotated back
to the input basis before the combine.

A rotation is :mod:`kvcalib.quant.rotation`'s ``R_h = diag(signs_h) @ M_h`` per kv head:
forward ``y = (x * signs_h) @ M_h``, inverse ``y = (x @ M_h^T) * signs_h``. The PyTorch functions
there (``rotate`` / ``unrotate``) are the specification; these kernels compute the same products
in float32: three TF32 tensor-core products per dot ("tf32x3", float32 accuracy; the "ieee"
FMA products took ~470 us per call on an H200, spilling registers) on a GPU, IEEE under Triton's
interpreter. Done as PyTorch operations around the split kernel the two
products were about ten small PyTorch launches, 25-33 us per attention call on an H200 whatever the
shape; as the two launches below, 13-15 us (``benchmarks/fitted.py``, docs/results.md).

Where each product runs (``KVCALIB_ROTATION_FUSION``, read by :mod:`.plan`):

- ``none``: :func:`rotate_query` and :func:`rotate_back_partials`, one launch each;
- ``combine``: the query by :func:`rotate_query`; the accumulators inside the merge
  (:func:`.combine._combine_rotated_kernel`);
- ``full`` (default): as ``combine``, and a query rotated by the random-sign Walsh-Hadamard
  inside the split kernel at load (:func:`_hadamard_query_t`); other matrices (fitted per head)
  still by :func:`rotate_query`.

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


@triton.jit
def _bf16_pieces(x):
    """float32 ``x`` as three bfloat16 pieces ``hi + mid + lo == x`` (8 + 8 + 8 significant bits
    cover float32's 24; bfloat16 has float32's exponent range)."""
    hi = x.to(tl.bfloat16)
    rest = x - hi.to(tl.float32)  # exact: the bits hi did not take
    mid = rest.to(tl.bfloat16)
    lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
    return hi, mid, lo


@triton.jit
def _hadamard_query_t(q_rows, r_ok, offs_c, signs_row, scale, D: tl.constexpr, F32_DOTS: tl.constexpr):
    """Channels ``offs_c`` (P,) of the query rows rotated by the random-sign Walsh-Hadamard,
    transposed and times ``scale``: ``((q * signs) @ H)[:, offs_c]^T * scale`` float32 (P, R_PAD),
    where ``H[i, j] = (-1)^popcount(i & j)`` is Sylvester's +-1 matrix (``scale`` brings the
    ``1 / sqrt(D)`` of :func:`kvcalib.quant.rotation.hadamard`).

    q_rows (R_PAD,) pointers to the query rows (any float dtype), masked by r_ok; signs_row: the
    kv head's (D,) float32 signs. The +-1 columns are made in registers (nothing to read), and
    are exact in 16-bit floats: a bfloat16/float16 query is one tensor-core product in its own
    dtype, a float32 query three, of its bfloat16 pieces (:func:`_bf16_pieces`), all products
    exact and summed in float32: float32 accuracy with no float32 operand. F32_DOTS: float32
    IEEE products of the same pieces (Triton's interpreter has no bfloat16 tl.dot).
    """
    offs_i = tl.arange(0, D)
    q = tl.load(q_rows[None, :] + offs_i[:, None], mask=r_ok[None, :], other=0.0)  # (D, R_PAD) query dtype
    x = q.to(tl.float32) * tl.load(signs_row + offs_i)[:, None]  # (D, R_PAD) exact: sign flips
    # parity of i & c by folding its bits (indices < 512: 9 bits)
    bits = offs_c[:, None] & offs_i[None, :]  # (P, D)
    if D > 256:
        bits = bits ^ (bits >> 8)
    if D > 16:
        bits = bits ^ (bits >> 4)
    bits = bits ^ (bits >> 2)
    bits = bits ^ (bits >> 1)
    sylvester = 1.0 - 2.0 * (bits & 1).to(tl.float32)  # (P, D) +-1
    if q.dtype == tl.float32:
        hi, mid, lo = _bf16_pieces(x)  # (D, R_PAD) bfloat16 each
        if F32_DOTS:
            y = tl.dot(sylvester, hi.to(tl.float32), input_precision="ieee")
            y = tl.dot(sylvester, mid.to(tl.float32), y, input_precision="ieee")
            y = tl.dot(sylvester, lo.to(tl.float32), y, input_precision="ieee")
        else:
            h16 = sylvester.to(tl.bfloat16)
            y = tl.dot(h16, hi)
            y = tl.dot(h16, mid, y)
            y = tl.dot(h16, lo, y)
    elif F32_DOTS:
        y = tl.dot(sylvester, x, input_precision="ieee")
    else:
        y = tl.dot(sylvester.to(q.dtype), x.to(q.dtype))  # exact operands: q's own values, +-1
    return y * scale  # (P, R_PAD)


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
