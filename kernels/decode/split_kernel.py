"""The split kernel of :func:`kvcalib_kernels.decode_attention.decode_attention`: one program per
(batch x kv head, split) writes a partial ``(m, l, acc)`` (log2 domain) for the ``R = Hq / H``
query heads of its kv head (rows of one ``(R_PAD, .)`` tile, so each K/V byte is read once per
GQA group); :mod:`.combine` merges the partials. Its launcher and the rules that pick its
compile-time paths are in :mod:`.plan`; the measurements behind each rule are in
``artifacts/bench/HISTORY.md``.

Grid ``(B * H, S_packed + S_fp)``. ``s < S_packed``: a contiguous split of the packed tokens,
walked in blocks of ``BLOCK_N`` tokens with an online softmax; ``s >= S_packed``: one
``FP_BLOCK``-token chunk of a full-precision segment (sinks, window, OTT pool) in the same
launch, in parallel with the packed splits.

Arithmetic (what keeps the per-code work small):

- codes become float16 without int->float conversions (:mod:`.unpack`); with the lane unpack
  the 1024 offset and the ``2**shift`` plane scale are folded into the key bias / query planes
  and into the value accumulators here.
- per-channel key scales are folded into the query once per key group (blocks never straddle
  a group): ``q . (c * s + z) = (q * s) . c + q . z``, so K needs no per-element
  dequantization; the products run on the tensor cores (float16 operands, float32 accumulation).
  Key groups of half a block run in the block's halves (``K_HALVES``: each half's codes times its
  own folded planes) or, at head_dim 64 with few query rows, as two sets of virtual query rows
  (``K_SUB = 2``: each set sees its own key group, merged by log-sum-exp at the end).
- both products run transposed: the key product's M rows are the block's tokens, the value
  product's (``V_T``) the channels (value codes read as int16 units, ``V_UNITS``, loaded as a
  (units, tokens) tile); the GQA group's query rows are the small N of both.
- per-token value scales are folded into the probabilities when a plane of channels lies in one
  value group (``v_group >= D * v_bits / 8``): ``sum_n p_n (c_n s_n + z_n) = (p * s) @ c + p @ z``;
  ``p * s`` is built once per value group, the zero term of all groups is one small extra
  product; with the lane unpack, ``sum_n p_n s_n`` per value group takes the 1024 back out.
  Value groups narrower than a plane (at most 4 per head; e.g. 4-bit, head_dim 128, group 32)
  fold per (plane, chunk of ``v_group`` byte columns), one accumulator per value group
  (``V_NCH`` chunks). Smaller value groups (and per-token keys) dequantize per element instead.
- the online softmax rescales lazily (only when a row's running max grows by more than 2^8).
- float32 queries run the products in IEEE float32 (no tf32), float16/bfloat16 queries in
  float16 with float32 accumulation.
- one warp per program and 4-row query tiles, parallelism from many split programs; where every
  packed block of a call is whole and visible (``WHOLE``) the loop runs without bounds masks.
- with a packed range on the device (``HAS_RANGE``) the splits share each row's live blocks
  evenly (:func:`.common._split_range`), whatever count the launcher planned for.

Rotated packed sides (:mod:`.rotation`): keys stored rotated score with ``QP``, the query
rotated like them -- a random-sign Walsh-Hadamard rotation by each packed split itself at its
start (``ROT_Q``: a fast transform in registers, written to ``QP``), a fitted matrix by
:func:`.rotation.rotate_query`'s launch before this one (the full-precision chunks keep ``Q``); values stored rotated leave their splits' accumulators in the
rotated basis, rotated back after this kernel by :func:`.rotation.rotate_back_partials` or
inside the merge (:func:`.combine._combine_rotated_kernel`), as :mod:`.plan`'s
``COMBINE_ROTATION_MIN_ROWS`` picks. (An earlier in-kernel rotation, a +-1 matrix built in
registers and multiplied into the query planes at load, measured slower than the separate launch
at batch 8 and at batch 1 / 32k on an H100 and was removed: ``artifacts/bench/HISTORY.md``.)
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvcalib_kernels.decode.common import _column, _dot, _fp_chunk, _softcap, _split_range
from kvcalib_kernels.decode.unpack import (_code_planes, _code_tile, _codes, _key_tiles, _perm4, _unit_planes,
                                           _unit_tiles)

@triton.jit
def _walsh_hadamard_rows(x, ROWS: tl.constexpr, D: tl.constexpr):
    """``x @ H_D`` for a (ROWS, D) float32 tile (Sylvester's ``H_D``, not normalised; D a power of
    two): log2(D) identical stages ``[x_even + x_odd | x_even - x_odd]`` (Pease's constant-geometry
    transform), D log2 D additions and no matrix in registers or memory."""
    for _ in tl.static_range(D.bit_length() - 1):
        x_even, x_odd = tl.split(tl.reshape(x, (ROWS, D // 2, 2)))  # (ROWS, D / 2) each
        x = tl.reshape(tl.permute(tl.join(x_even + x_odd, x_even - x_odd), (0, 2, 1)), (ROWS, D))
    return x


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
    P parameters, or with SUB > 1 key groups (virtual rows: the launcher's key-group pairs)
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
def _k_fold_planes(q0, q1, q2, q3, q4, q5, q6, q7, ks_ptr, kz_ptr, offs_p, PK: tl.constexpr, BITS: tl.constexpr,
                   DOT_T: tl.constexpr, LANES: tl.constexpr, col_ok=None, SUB: tl.constexpr = 1,
                   HSPLIT: tl.constexpr = False):
    """Every key plane of one key group folded (:func:`_k_group_fold`): ((q * s) per plane as DOT_T
    (PK, R_PAD) x 4 (planes past 8 // BITS repeat plane 0), then 4 more, the bias (R_PAD,) of all
    planes in one reduction). q0..q3 (PK, R_PAD) float32 query slices; ks_ptr/kz_ptr: the group's
    parameter row (SUB > 1: one per key group, see :func:`_k_group_fold`). HSPLIT (3-bit keys read
    in halves, :func:`.unpack._key_tiles`): q0..q3 the planes' first halves (channels offs_p of
    each plane, (PK / 2, R_PAD)), q4..q7 their second halves (offs_p + PK / 2), each folded at its
    own channels into the 8 returned planes; otherwise q4..q7 are unused and the last 4 planes
    repeat the first 4."""
    qp0, qp1, qp2, qp3, bt = _k_fold_terms(q0, q1, q2, q3, ks_ptr, kz_ptr, offs_p, PK, BITS, DOT_T, LANES, col_ok,
                                           SUB)
    qp4, qp5, qp6, qp7 = qp0, qp1, qp2, qp3
    if HSPLIT:
        qp4, qp5, qp6, qp7, bt_b = _k_fold_terms(q4, q5, q6, q7, ks_ptr, kz_ptr, offs_p + PK // 2, PK, BITS, DOT_T,
                                                 LANES, col_ok, SUB)
        bt += bt_b
    return qp0, qp1, qp2, qp3, qp4, qp5, qp6, qp7, tl.sum(bt, axis=0)


@triton.jit
def _k_fold_terms(q0, q1, q2, q3, ks_ptr, kz_ptr, offs_p, PK: tl.constexpr, BITS: tl.constexpr, DOT_T: tl.constexpr,
                  LANES: tl.constexpr, col_ok=None, SUB: tl.constexpr = 1):
    """:func:`_k_fold_planes` of 4 query slices at channels offs_p of each plane: (4 folded planes,
    the bias terms (P, R_PAD) of all of them, not yet reduced)."""
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
    return qp0, qp1, qp2, qp3, bt


@triton.jit
def _k_fold_scores(scores_t, kb, kb2, kh, qp0, qp1, qp2, qp3, qp4, qp5, qp6, qp7, kbias, BITS: tl.constexpr,
                   DOT_T: tl.constexpr, UNPACK: tl.constexpr, IEEE: tl.constexpr, HI: tl.constexpr,
                   HSPLIT: tl.constexpr = False):
    """Transposed scores (rows, R_PAD) + the folded key planes' products: the codes of byte tile
    kb (rows, PK) @ each (q * s) plane, plus the bias; HI (3-bit codes): kh the aligned high tile.
    HSPLIT (:func:`.unpack._key_tiles`' halves): kb, kb2 the (rows, PK / 2) halves of the low
    bytes and kh their common high tile (bit 2s for kb's planes, 2s + 1 for kb2's), kb's planes @
    qp0..qp3 and kb2's @ qp4..qp7 (8 products of K = PK / 2; :func:`_k_fold_planes` with HSPLIT)."""
    PER: tl.constexpr = 8 // BITS
    c0, c1, c2, c3 = _code_planes(kb, BITS, DOT_T, UNPACK, kh, HI)  # (rows, PK) each
    scores_t = _dot(c0, qp0, scores_t, IEEE)
    if PER > 1:
        scores_t = _dot(c1, qp1, scores_t, IEEE)
    if PER > 2:
        scores_t = _dot(c2, qp2, scores_t, IEEE)
        scores_t = _dot(c3, qp3, scores_t, IEEE)
    if HSPLIT:  # (3-bit: BITS 2, four planes)
        d0, d1, d2, d3 = _code_planes(kb2, BITS, DOT_T, UNPACK, kh, HI, True)  # (rows, PK / 2) each
        scores_t = _dot(d0, qp4, scores_t, IEEE)
        scores_t = _dot(d1, qp5, scores_t, IEEE)
        scores_t = _dot(d2, qp6, scores_t, IEEE)
        scores_t = _dot(d3, qp7, scores_t, IEEE)
    return scores_t + kbias[None, :]


@triton.jit
def _k_deq_plane(scores_t, q_t, kb, kh, ks_rows, kz_rows, col0, offs_p, row_ok, GROUP: tl.constexpr,
                 SHIFT: tl.constexpr, BITS: tl.constexpr, DOT_T: tl.constexpr,
                 UNPACK: tl.constexpr, IEEE: tl.constexpr, HI: tl.constexpr):
    """Transposed scores (BLOCK_N, R_PAD) of one key plane with per-token parameters over groups
    of GROUP channels: dequantize ``c * s + z`` per element, then the product.

    q_t (P, R_PAD) float32; ks_rows/kz_rows (BLOCK_N,) pointers to each token's parameter row;
    col0 = first channel; HI (3-bit codes): kh the aligned high tile.
    """
    g = (col0 + offs_p) // GROUP  # (P,) parameter column of each channel
    sc = tl.load(ks_rows[:, None] + g[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    ze = tl.load(kz_rows[:, None] + g[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    c = _codes(kb, SHIFT, BITS, DOT_T, UNPACK, kh, HI).to(tl.float32)  # (BLOCK_N, P)
    k = (c * sc + ze).to(DOT_T)
    return _dot(k, q_t.to(DOT_T), scores_t, IEEE)



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
    by a product with a constant tile. T (transposed value products, the launcher's rule):
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
def _v_deq_plane(acc, p_dot, vb, vh, vs_rows, vz_rows, col0, offs_p, row_ok, GROUP: tl.constexpr,
                 SHIFT: tl.constexpr, BITS: tl.constexpr, DOT_T: tl.constexpr,
                 UNPACK: tl.constexpr, IEEE: tl.constexpr, HI: tl.constexpr):
    """``acc + p @ (c * s + z)`` for one value plane spanning several value groups (HI: 3-bit
    codes, vh the aligned high tile)."""
    g = (col0 + offs_p) // GROUP  # (P,)
    sc = tl.load(vs_rows[:, None] + g[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    ze = tl.load(vz_rows[:, None] + g[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    c = _codes(vb, SHIFT, BITS, DOT_T, UNPACK, vh, HI).to(tl.float32)  # (BLOCK_N, P)
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
    """``offs < end``; WHOLE (every packed block of the call whole and visible, the launcher's
    whole-blocks rule): an all-true constant, which the compiler drops from the loads'
    predicates and the score mask."""
    if WHOLE:
        return tl.full(offs.shape, 1, tl.int1)
    else:
        return offs < end



# ---------------------------------------------------------------- the packed split's steps
# (each a @triton.jit helper the kernel calls, inlined by Triton: the kernel reads as its steps, a
# new width or layout is a branch of one of these, not of the kernel)


@triton.jit
def _rotate_query(q_rows, r_ok, qp_rows, signs_row, R_PAD: tl.constexpr, D: tl.constexpr, SCALE: tl.constexpr):
    """ROT_Q: keys stored rotated by a random-sign Walsh-Hadamard rotation: this program rotates the
    query itself, (q * signs) @ H_D / sqrt(D) (SCALE = 1 / sqrt(D)), and writes it to qp_rows
    (R_PAD,) pointers, which the packed loads read. Every packed split of (b, h) writes the same
    values to the same rows (a benign race: no program reads a row another could leave different),
    and the barrier makes this program's writes visible to all its threads. This replaces a launch
    per call before this kernel (kernels/decode/rotation.py's rotate_query, still used for fitted
    matrices): docs/results.md has the measurements. signs_row: the kv head's signs (D,) float32."""
    offs_qd = tl.arange(0, D)
    q_in = tl.load(q_rows[:, None] + offs_qd[None, :], mask=r_ok[:, None], other=0.0).to(tl.float32)
    q_in = q_in * tl.load(signs_row + offs_qd)[None, :]  # (R_PAD, D)
    q_rot = _walsh_hadamard_rows(q_in, R_PAD, D) * SCALE  # (R_PAD, D) float32
    tl.store(qp_rows[:, None] + offs_qd[None, :], q_rot, mask=r_ok[:, None])
    tl.debug_barrier()


@triton.jit
def _query_planes(q_rows_v, v_ok, offs_pk, perm_row, qk_scale, PK: tl.constexpr, PER_K: tl.constexpr,
                  K_PERM: tl.constexpr):
    """The query, one transposed slice (PK, VR) per key plane, pre-scaled, float32: the key products
    run transposed, scores^T = codes (BLOCK_N, PK) @ q^T, so the block's tokens fill the MMA rows
    (the R query rows are only its small N; as M they were padded to 16 rows and the kernel spent
    more on moving fragments than on unpacking: 1.4x slower at batch 8 / 32k:
    artifacts/bench/HISTORY.md, step 6). Per-token keys use the slices as is; per-channel keys fold
    the scales in once per key group. Column j of plane s reads query channel ``s * PK + j``, or
    with an SKVQ permutation (K_PERM) ``perm_row[s * PK + j]`` (stored channel j holds input
    channel perm[h, j])."""
    qc0, qc1, qc2, qc3 = _plane_channels(offs_pk, PK, PER_K, perm_row, K_PERM)
    q0 = _q_plane_t(q_rows_v, v_ok, qc0, qk_scale)
    q1 = q0
    q2 = q0
    q3 = q0
    if PER_K > 1:
        q1 = _q_plane_t(q_rows_v, v_ok, qc1, qk_scale)
    if PER_K > 2:
        q2 = _q_plane_t(q_rows_v, v_ok, qc2, qk_scale)
        q3 = _q_plane_t(q_rows_v, v_ok, qc3, qk_scale)
    return q0, q1, q2, q3


@triton.jit
def _value_channels(offs_pv, perm_row, PV: tl.constexpr, PER_V: tl.constexpr, V_PERM: tl.constexpr,
                    V_NCH: tl.constexpr, V_UNITS: tl.constexpr, AW: tl.constexpr):
    """Output channel of each column of value accumulators 0..3 (vc*) and, V_UNITS, 4..7 (vh*),
    scattered back when V is permuted, and offs_av (AW,): the byte column of each accumulator
    column within its chunk. Returns (offs_av, vc0, vc1, vc2, vc3, vh0, vh1, vh2, vh3)."""
    offs_av = offs_pv
    if V_NCH > 1:
        offs_av = tl.arange(0, AW)
    if V_UNITS:  # column u of acc g: the low byte of unit u of its chunk (byte column 2u); of acc 4 + g: 2u + 1
        offs_av = 2 * tl.arange(0, AW)
    vc0, vc1, vc2, vc3 = _plane_channels(offs_av, PV, PER_V, perm_row, V_PERM, V_NCH)
    vh0 = vc0
    vh1 = vc1
    vh2 = vc2
    vh3 = vc3
    if V_UNITS:
        vh0, vh1, vh2, vh3 = _plane_channels(offs_av + 1, PV, PER_V, perm_row, V_PERM, V_NCH)
    return offs_av, vc0, vc1, vc2, vc3, vh0, vh1, vh2, vh3


@triton.jit
def _valid_tokens(offs_n, row_ok, lo, mask_row, keep_base, WHOLE: tl.constexpr, MASKED: tl.constexpr,
                  HAS_KEEP: tl.constexpr, KEEP_BLOCK: tl.constexpr):
    """(BLOCK_N,) the block's tokens that count: inside the split and the row's packed range (from
    lo), visible (MASKED: mask_row + token, the visibility of packed token 0) and not an OTT pool
    entrant (HAS_KEEP: this kv head's quant-mask bits at keep_base, blocks of KEEP_BLOCK tokens)."""
    if WHOLE:  # (no range: lo = 0)
        valid = row_ok
    else:
        valid = row_ok & (offs_n >= lo)
    if MASKED:
        vis = tl.load(mask_row + offs_n, mask=row_ok, other=0)
        valid = valid & (vis != 0)
    if HAS_KEEP:  # OTT: this kv head's slots of pool entrants are masked out
        KEEP_BYTES: tl.constexpr = (KEEP_BLOCK + 7) // 8
        in_blk = offs_n % KEEP_BLOCK
        kbyte = tl.load(keep_base + (offs_n // KEEP_BLOCK) * KEEP_BYTES + in_blk // 8, mask=row_ok, other=0)
        valid = valid & (((kbyte.to(tl.int32) >> (in_blk % 8)) & 1) != 0)
    return valid


@triton.jit
def _key_scores(kc_base, ks_base, kz_base, stride_kcn, stride_ksn, n0, start, end, offs_n, row_ok, valid, offs_pk,
                offs_v, q0, q1, q2, q3, q4, q5, q6, q7, qp0, qp1, qp2, qp3, qp4, qp5, qp6, qp7, kbias,
                BLOCK_N: tl.constexpr, R_PAD: tl.constexpr,
                K_BITS: tl.constexpr, PK: tl.constexpr, K_GROUP: tl.constexpr, K_FOLD: tl.constexpr,
                K_SUB: tl.constexpr, K_HALVES: tl.constexpr, K_HI: tl.constexpr, K_UNPACK: tl.constexpr,
                DOT_T: tl.constexpr, IEEE: tl.constexpr, WHOLE: tl.constexpr, K_HSPLIT: tl.constexpr):
    """The block's transposed scores (BLOCK_N, VR) from all key planes, by the key layout: per-channel
    keys folded into the query once per key group (K_FOLD: one group per block; K_SUB groups as
    virtual row sets; K_HALVES one group per half block), per-token keys dequantized per element.
    q0..q3 (PK, VR) the query slices; qp0..qp3, kbias: the folded planes of the current key group
    (one group per block: refreshed at each group, carried across blocks). K_HSPLIT (3-bit folded
    keys, PK / 2 >= 16: each key row read in two halves of PK / 2 columns, :func:`.unpack._key_tiles`):
    q0..q3 / qp0..qp3 are the planes' first halves (channels offs_pk), q4..q7 / qp4..qp7 their
    second halves (PK / 2 + offs_pk); otherwise q4..q7 are unused and qp4..qp7 returned as they
    came (so the loop carries no copies). Returns (scores, valid2 (BLOCK_N, 1 | VR): the tokens each
    virtual row sees, qp0, ..., qp7, kbias)."""
    PER_K: tl.constexpr = 8 // K_BITS
    VR: tl.constexpr = R_PAD * K_SUB
    K_LANES: tl.constexpr = (K_UNPACK == 5) | (K_UNPACK == 6)  # codes as 1024 + c * 2**shift
    tl.static_assert(K_FOLD or not K_HSPLIT, "key rows in halves: folded keys only")
    # ---- all key planes from one (BLOCK_N, PK) byte tile (K_HSPLIT: two (BLOCK_N, PK / 2) halves)
    if not K_HALVES:  # (halves load their own (BLOCK_N / 2, PK) tiles below)
        kb, kb2, kh = _key_tiles(kc_base + offs_n * stride_kcn, row_ok, PK, K_HI, K_HSPLIT)
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
        qa0, qa1, qa2, qa3, qa4, qa5, qa6, qa7, kbias_a = _k_fold_planes(
            q0, q1, q2, q3, q4, q5, q6, q7, ks_base + krow, kz_base + krow, offs_pk, PK, K_BITS, DOT_T, K_LANES,
            HSPLIT=K_HSPLIT)
        qb0, qb1, qb2, qb3, qb4, qb5, qb6, qb7, kbias_b = _k_fold_planes(
            q0, q1, q2, q3, q4, q5, q6, q7, ks_base + krow_b, kz_base + krow_b, offs_pk, PK, K_BITS, DOT_T, K_LANES,
            HSPLIT=K_HSPLIT)
        ka, ka2, kha = _key_tiles(kc_base + offs_h * stride_kcn, _before(offs_h, end, WHOLE), PK, K_HI, K_HSPLIT)
        kbb, kbb2, khb = _key_tiles(kc_base + (offs_h + HB) * stride_kcn, _before(offs_h + HB, end, WHOLE), PK,
                                    K_HI, K_HSPLIT)  # (HB, PK) (K_HSPLIT: (HB, PK / 2))
        sa = _k_fold_scores(tl.zeros([HB, VR], tl.float32), ka, ka2, kha, qa0, qa1, qa2, qa3, qa4, qa5, qa6, qa7,
                            kbias_a, K_BITS, DOT_T, K_UNPACK, IEEE, K_HI, K_HSPLIT)
        sb = _k_fold_scores(tl.zeros([HB, VR], tl.float32), kbb, kbb2, khb, qb0, qb1, qb2, qb3, qb4, qb5, qb6, qb7,
                            kbias_b, K_BITS, DOT_T, K_UNPACK, IEEE, K_HI, K_HSPLIT)
        scores = tl.reshape(tl.permute(tl.join(sa, sb), (2, 0, 1)), (BLOCK_N, VR))
    elif K_FOLD & (K_SUB == 1):
        if ((n0 % K_GROUP) == 0) | (n0 == start):  # a new key group (blocks never straddle one)
            krow = (n0 // K_GROUP) * stride_ksn
            qn0, qn1, qn2, qn3, qn4, qn5, qn6, qn7, kbias = _k_fold_planes(
                q0, q1, q2, q3, q4, q5, q6, q7, ks_base + krow, kz_base + krow, offs_pk, PK, K_BITS, DOT_T, K_LANES,
                HSPLIT=K_HSPLIT)
            qp0, qp1, qp2, qp3 = qn0, qn1, qn2, qn3
            if K_HSPLIT:  # (otherwise qp4..qp7 stay as they came: no loop-carried copies)
                qp4, qp5, qp6, qp7 = qn4, qn5, qn6, qn7
        scores = _k_fold_scores(scores, kb, kb2, kh, qp0, qp1, qp2, qp3, qp4, qp5, qp6, qp7, kbias, K_BITS, DOT_T,
                                K_UNPACK, IEEE, K_HI, K_HSPLIT)
    elif K_FOLD:
        # K_SUB key groups per block: virtual row v takes the scales of group g = v // R_PAD
        offs_g = tl.arange(0, K_SUB)
        krow = ((n0 // K_GROUP) + offs_g) * stride_ksn  # (K_SUB,) parameter row of each group
        k_ok = _before(n0 + offs_g * K_GROUP, end, WHOLE)  # (K_SUB,) groups that hold tokens here
        qn0, qn1, qn2, qn3, qn4, qn5, qn6, qn7, kbias = _k_fold_planes(
            q0, q1, q2, q3, q4, q5, q6, q7, ks_base + krow, kz_base + krow, offs_pk, PK, K_BITS, DOT_T, K_LANES,
            k_ok, K_SUB, K_HSPLIT)
        qp0, qp1, qp2, qp3 = qn0, qn1, qn2, qn3
        if K_HSPLIT:
            qp4, qp5, qp6, qp7 = qn4, qn5, qn6, qn7
        scores = _k_fold_scores(scores, kb, kb2, kh, qp0, qp1, qp2, qp3, qp4, qp5, qp6, qp7, kbias, K_BITS, DOT_T,
                                K_UNPACK, IEEE, K_HI, K_HSPLIT)
        # a token counts only in the virtual rows of its key group
        valid2 = valid2 & ((tl.arange(0, BLOCK_N) // K_GROUP)[:, None] == (offs_v // R_PAD)[None, :])
    else:
        ks_rows = ks_base + offs_n * stride_ksn
        kz_rows = kz_base + offs_n * stride_ksn
        scores = _k_deq_plane(scores, q0, kb, kh, ks_rows, kz_rows, 0, offs_pk, row_ok, K_GROUP,
                              0, K_BITS, DOT_T, K_UNPACK, IEEE, K_HI)
        if PER_K > 1:
            scores = _k_deq_plane(scores, q1, kb, kh, ks_rows, kz_rows, PK, offs_pk, row_ok, K_GROUP,
                                  K_BITS, K_BITS, DOT_T, K_UNPACK, IEEE, K_HI)
        if PER_K > 2:
            scores = _k_deq_plane(scores, q2, kb, kh, ks_rows, kz_rows, 2 * PK, offs_pk, row_ok, K_GROUP,
                                  2 * K_BITS, K_BITS, DOT_T, K_UNPACK, IEEE, K_HI)
            scores = _k_deq_plane(scores, q3, kb, kh, ks_rows, kz_rows, 3 * PK, offs_pk, row_ok, K_GROUP,
                                  3 * K_BITS, K_BITS, DOT_T, K_UNPACK, IEEE, K_HI)
    return scores, valid2, qp0, qp1, qp2, qp3, qp4, qp5, qp6, qp7, kbias


@triton.jit
def _key_mean_scores(scores, km_rows, kms_base, kmz_base, stride_kmsn, offs_n, offs_d, row_ok, qm, qm_sum,
                     K_MEAN: tl.constexpr, DOT_T: tl.constexpr, IEEE: tl.constexpr):
    """TaDA key means: scores (BLOCK_N, VR) + q . mean_n, the mean rows (BLOCK_N, 1) pointers
    km_rows (input channel order); qm (D, VR) the query as DOT_T, qm_sum (VR,) its column sums.
    MEAN 16: float16 means; 8: codes with per-token scale/zero, ``q . (c * s + z) = s * (q . c) + z * sum(q)``."""
    if K_MEAN == 16:
        km = tl.load(km_rows + offs_d[None, :], mask=row_ok[:, None], other=0.0).to(DOT_T)  # (BLOCK_N, D)
        scores = _dot(km, qm, scores, IEEE)
    elif K_MEAN == 8:
        km = _codes(tl.load(km_rows + offs_d[None, :], mask=row_ok[:, None], other=0), 0, 8, DOT_T,
                    1)  # (BLOCK_N, D) codes, exact in float16
        kms = tl.load(kms_base + offs_n * stride_kmsn, mask=row_ok, other=0.0).to(tl.float32)
        kmz = tl.load(kmz_base + offs_n * stride_kmsn, mask=row_ok, other=0.0).to(tl.float32)
        sm = _dot(km, qm, tl.zeros(scores.shape, tl.float32), IEEE)
        scores = scores + sm * kms[:, None] + qm_sum[None, :] * kmz[:, None]
    return scores


@triton.jit
def _rescaled(alpha, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, zacc, zsum0, zsum1, zsum2, zsum3, asum0, asum1,
              asum2, asum3, mzacc, macc, NACC: tl.constexpr, V_UNITS: tl.constexpr, V_ZACC: tl.constexpr,
              V_FOLD: tl.constexpr, V_LANES: tl.constexpr, V_MEAN: tl.constexpr, VM_APART: tl.constexpr,
              V_T: tl.constexpr):
    """The online softmax's running sums times alpha (VR,) per (virtual) query row: the value
    accumulators in use and their per-group and per-plane sums. Returns them in the same order."""
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
    return acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, zacc, zsum0, zsum1, zsum2, zsum3, asum0, asum1, asum2, asum3, \
        mzacc, macc


@triton.jit
def _values_chunks(acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, zacc, pt, zt, vsc0, vsc1, vsc2, vsc3, vc_base,
                   stride_vcn, offs_n, offs_nv, row_ok, end, offs_av, offs_z, AW: tl.constexpr, V_BITS: tl.constexpr,
                   V_NCH: tl.constexpr, V_UNPACK: tl.constexpr, V_UNITS: tl.constexpr, V_T: tl.constexpr,
                   V_LANES: tl.constexpr, DOT_T: tl.constexpr, IEEE: tl.constexpr, WHOLE: tl.constexpr):
    """The block's values where value groups are narrower than a plane (V_NCH > 1): chunk c of the
    byte columns holds, in plane s, channels of group s * V_NCH + c only, so each (plane, chunk)
    tile folds its group's (p * scale) like a whole plane does (4-bit: groups 0, 1 from the low
    nibbles, 2, 3 from the high ones; 8-bit: one group per chunk); V_UNITS: a chunk is AW int16
    units, its low and high bytes' tiles share the group's (p * scale). pt (BLOCK_N, VR) the
    probabilities; zt every group's zero (:func:`_value_scales`); vsc g group g's scales.
    Returns (acc0, .., acc7, zacc)."""
    PER_V: tl.constexpr = 8 // V_BITS
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
    return acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, zacc


@triton.jit
def _fold_by_products(acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, zacc, zsum0, zsum1, zsum2, zsum3, pt,
                      vcode0, vcode1, vcode2, vcode3, vhi0, vhi1, vhi2, vhi3, vsc0, vsc1, vsc2, vsc3, vze0, vze1,
                      vze2, vze3, offs_z, PV: tl.constexpr, V_GROUP: tl.constexpr, V_BITS: tl.constexpr,
                      G1: tl.constexpr, G2: tl.constexpr, G3: tl.constexpr, V_UNITS: tl.constexpr,
                      V_T: tl.constexpr, V_LANES: tl.constexpr, DOT_T: tl.constexpr, IEEE: tl.constexpr):
    """Folded value planes, V_SUM_DOTS: plane s lies in value group Gs = (s * PV) // V_GROUP: the
    probabilities change layout once and (p * scale) is built once per group, in the products'
    operand; V_LANES: column 4 + s of zacc gets plane s's 1024 term from one product per group with
    a constant tile (_lane_terms), not from a reduction of p * scale. Each group's sum_n p * zero
    stays a reduction of p (one per group): as a product with a (BLOCK_N, 16) zero-point tile it
    took as many instructions (Mistral shape, groups 128: 2-bit 1,231 vs 1,227, 4-bit 1,352 vs
    1,339 per 64 tokens). V_T: transposed, acc s (AW, VR) += codes^T @ (p * scale) (BLOCK_N, VR),
    p not transposed. Returns (acc0, .., acc7, zacc, zsum0, .., zsum3)."""
    PER_V: tl.constexpr = 8 // V_BITS
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
    return acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, zacc, zsum0, zsum1, zsum2, zsum3


@triton.jit
def _fold_by_reductions(acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, zsum0, zsum1, zsum2, zsum3, asum0, asum1,
                        asum2, asum3, pt, vcode0, vcode1, vcode2, vcode3, vhi0, vhi1, vhi2, vhi3, vsc0, vsc1, vsc2,
                        vsc3, vze0, vze1, vze2, vze3, V_BITS: tl.constexpr, G1: tl.constexpr, G2: tl.constexpr,
                        G3: tl.constexpr, V_UNITS: tl.constexpr, V_T: tl.constexpr, V_LANES: tl.constexpr,
                        DOT_T: tl.constexpr, IEEE: tl.constexpr):
    """Folded value planes: plane s lies in value group (s * PV) // V_GROUP: (p * scale) is built
    once per group, and so is sum_n p * zero (added to every channel of the plane at the end);
    V_LANES: the plane's codes are 1024 + c * 2**shift, sum(p * scale) takes the 1024 out.
    Returns (acc0, .., acc7, zsum0, .., zsum3, asum0, .., asum3)."""
    PER_V: tl.constexpr = 8 // V_BITS
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
    return acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, zsum0, zsum1, zsum2, zsum3, asum0, asum1, asum2, asum3


@triton.jit
def _values_deq(acc0, acc1, acc2, acc3, pt, vb, vbh, vs_rows, vz_rows, offs_pv, row_ok, PV: tl.constexpr,
                V_GROUP: tl.constexpr, V_BITS: tl.constexpr, V_UNPACK: tl.constexpr, V_HI: tl.constexpr,
                DOT_T: tl.constexpr, IEEE: tl.constexpr):
    """Value planes spanning several value groups: each plane's codes (vb (BLOCK_N, PV), HI: vbh the
    high tile) dequantized per element (per-token scale/zero rows vs_rows/vz_rows), then
    ``acc s + p @ v``. Returns (acc0, acc1, acc2, acc3)."""
    PER_V: tl.constexpr = 8 // V_BITS
    p_dot = tl.trans(pt.to(DOT_T))  # (VR, BLOCK_N)
    acc0 = _v_deq_plane(acc0, p_dot, vb, vbh, vs_rows, vz_rows, 0, offs_pv, row_ok, V_GROUP,
                        0, V_BITS, DOT_T, V_UNPACK, IEEE, V_HI)
    if PER_V > 1:
        acc1 = _v_deq_plane(acc1, p_dot, vb, vbh, vs_rows, vz_rows, PV, offs_pv, row_ok, V_GROUP,
                            V_BITS, V_BITS, DOT_T, V_UNPACK, IEEE, V_HI)
    if PER_V > 2:
        acc2 = _v_deq_plane(acc2, p_dot, vb, vbh, vs_rows, vz_rows, 2 * PV, offs_pv, row_ok, V_GROUP,
                            2 * V_BITS, V_BITS, DOT_T, V_UNPACK, IEEE, V_HI)
        acc3 = _v_deq_plane(acc3, p_dot, vb, vbh, vs_rows, vz_rows, 3 * PV, offs_pv, row_ok, V_GROUP,
                            3 * V_BITS, V_BITS, DOT_T, V_UNPACK, IEEE, V_HI)
    return acc0, acc1, acc2, acc3


@triton.jit
def _value_mean(acc0, acc1, acc2, acc3, macc, mzacc, pt, vm_rows, vms_base, vmz_base, stride_vmsn, offs_n, offs_d,
                row_ok, vc0, vc1, vc2, vc3, V_MEAN: tl.constexpr, VM_APART: tl.constexpr, V_LANES: tl.constexpr,
                V_BITS: tl.constexpr, DOT_T: tl.constexpr, IEEE: tl.constexpr):
    """TaDA value means: sum_n p_n mean_n, into macc (VM_APART: input channel order, added to the
    stored output at the end) or into each value plane's accumulator, read at the plane's output
    channels vc s; vm_rows (BLOCK_N, 1) pointers to the mean rows. MEAN 8 (codes with per-token
    scale/zero): ``sum_n p_n (c_n * s_n + z_n) = (p * s) @ c + sum_n p_n z_n``, the zero sums into
    mzacc. Returns (acc0, acc1, acc2, acc3, macc, mzacc)."""
    PER_V: tl.constexpr = 8 // V_BITS
    pm = pt  # (BLOCK_N, VR)
    if V_MEAN == 8:  # sum_n p_n (c_n * s_n + z_n) = (p * s) @ c + sum_n p_n z_n
        vms = tl.load(vms_base + offs_n * stride_vmsn, mask=row_ok, other=0.0).to(tl.float32)
        vmz = tl.load(vmz_base + offs_n * stride_vmsn, mask=row_ok, other=0.0).to(tl.float32)
        pm = pt * vms[:, None]
        mzacc += tl.sum(pt * vmz[:, None], axis=0)
    # plane s: p @ mean[:, vc_s]; a lane-folded plane is scaled by 2**-(s * V_BITS) at the
    # end, so its mean term goes in times 2**(s * V_BITS) (exact)
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
    return acc0, acc1, acc2, acc3, macc, mzacc


@triton.jit
def _value_sums_in(acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, zacc, zsum0, zsum1, zsum2, zsum3, asum0, asum1,
                   asum2, asum3, mzacc, macc, offs_z, V_BITS: tl.constexpr, V_NCH: tl.constexpr,
                   V_UNITS: tl.constexpr, V_T: tl.constexpr, V_LANES: tl.constexpr, V_MEAN: tl.constexpr,
                   VM_APART: tl.constexpr, V_FOLD: tl.constexpr, V_PLANE_LANES: tl.constexpr, G1: tl.constexpr,
                   G2: tl.constexpr, G3: tl.constexpr):
    """After the packed loop: the value accumulators (VR, AW) with every term the loop kept apart
    added in -- transposed back (V_T), the lane codes' 1024 and plane scale taken out, the 8-bit
    means' zero points and the value groups' zero sums added. Returns (acc0, .., acc7, macc)."""
    PER_V: tl.constexpr = 8 // V_BITS
    NACC: tl.constexpr = PER_V * V_NCH
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
    return acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, macc


@triton.jit
def _store_split(m_i, l_i, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, macc, M_part, L_part, O_part, part_row,
                 r_ok, offs_d, vc0, vc1, vc2, vc3, vh0, vh1, vh2, vh3, R_PAD: tl.constexpr, D: tl.constexpr,
                 K_SUB: tl.constexpr, AW: tl.constexpr, NACC: tl.constexpr, V_UNITS: tl.constexpr,
                 VM_APART: tl.constexpr):
    """The split's partial (m, l, acc) stored at part_row (R_PAD,): with K_SUB virtual row sets, each
    query row's K_SUB rows merged by log-sum-exp first (as splits are); accumulator s at its output
    channels vc s (V_UNITS: 4 + s at vh s); VM_APART: the value mean (input channel order) added
    onto the planes just stored."""
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


@triton.jit(do_not_specialize=["S_TOT", "S_OFF", "N", "packed_pos", "F1_LEN", "f1_pos", "F2_LEN", "f2_pos", "F3_LEN",
                               "num_splits", "split_size", "n_f1_chunks", "n_f2_chunks"])
def _decode_split_kernel(
    # query (B, Hq, D), last dim contiguous; QP: the query the packed keys are scored with (Q
    # itself, or Q rotated like the stored keys: one rotation per step, never one per token)
    Q, stride_qb, stride_qh, QP, stride_qpb, stride_qph,
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
    # ROT_Q: the keys' random signs (H, D) float32; QP is then written here (below) before it is read
    QSIGNS,
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
    # packed layout: bits per code plane (a 3-bit side: its 2-bit part, the high part by KEYS/VALUES'
    # HI), tokens per key group / channels per value group, unpack modes (:mod:`.unpack`)
    K_BITS: tl.constexpr, V_BITS: tl.constexpr, K_GROUP: tl.constexpr, V_GROUP: tl.constexpr,
    K_UNPACK: tl.constexpr, V_UNPACK: tl.constexpr,
    # products and blocks
    DOT_T: tl.constexpr, IEEE: tl.constexpr, FP_T: tl.constexpr, FP_IEEE: tl.constexpr,
    BLOCK_N: tl.constexpr, FP_BLOCK: tl.constexpr,
    # the code paths, grouped (decoded below; plan.py's _split_codes writes them, split_fields
    # reads them back): KEYS the key path, VALUES the value path, CALL this call's inputs
    KEYS: tl.constexpr, VALUES: tl.constexpr, CALL: tl.constexpr, ROT_Q_SCALE: tl.constexpr = 1.0,
):
    # ---- the grouped code paths (one int each: a constexpr parameter per flag made the kernel's
    # signature 41 constexprs wide; the values, and so the compiled code, are the same)
    K_FOLD: tl.constexpr = KEYS % 2 != 0  # per-channel keys folded into the query per key group
    K_HALVES: tl.constexpr = (KEYS // 2) % 2 != 0  # one key group per half block
    K_HI: tl.constexpr = (KEYS // 4) % 2 != 0  # 3-bit keys: a high tile besides the 2-bit planes
    K_PERM: tl.constexpr = (KEYS // 8) % 2 != 0  # SKVQ channel permutation
    K_SUB: tl.constexpr = (KEYS // 16) % 128  # key groups per block as virtual row sets
    K_HSPLIT: tl.constexpr = (KEYS // 2048) % 2 != 0  # 3-bit folded keys: rows read in halves of PK / 2
    K_MEAN: tl.constexpr = KEYS // 4096  # TaDA key means: 0, 8 (codes) or 16 (float16)
    V_FOLD: tl.constexpr = VALUES % 2 != 0  # each value plane in one value group: scales folded into p
    V_UNITS: tl.constexpr = (VALUES // 2) % 2 != 0  # value codes read as int16 units
    V_SUM_DOTS: tl.constexpr = (VALUES // 4) % 2 != 0  # folded planes' sums by products
    V_EARLY: tl.constexpr = (VALUES // 8) % 2 != 0  # value scales loaded before the key work
    V_T: tl.constexpr = (VALUES // 16) % 2 != 0  # transposed value products
    V_HI: tl.constexpr = (VALUES // 32) % 2 != 0  # 3-bit values: a high tile
    V_PERM: tl.constexpr = (VALUES // 64) % 2 != 0  # SKVQ channel permutation
    V_ROW8: tl.constexpr = (VALUES // 128) % 2 != 0  # value code rows every 8k units (stride_vcn % 8 == 0)
    V_NCH: tl.constexpr = (VALUES // 256) % 128  # value-group chunks per plane
    V_HPAIR: tl.constexpr = (VALUES // 32768) % 2 != 0  # 3-bit value units: the high tile in two masked loads
    V_MEAN: tl.constexpr = VALUES // 65536  # TaDA value means: 0, 8 or 16
    HAS_RANGE: tl.constexpr = CALL % 2 != 0  # a packed range per batch row on the device
    HAS_MASK: tl.constexpr = (CALL // 2) % 2 != 0  # a visibility mask
    HAS_SOFTCAP: tl.constexpr = (CALL // 4) % 2 != 0
    MASK_PACKED: tl.constexpr = (CALL // 8) % 2 != 0  # the mask covers the packed tokens too
    HAS_KEEP: tl.constexpr = (CALL // 16) % 2 != 0  # OTT quant masks
    WHOLE: tl.constexpr = (CALL // 32) % 2 != 0  # every packed block whole and visible: no bounds masks
    ROT_Q: tl.constexpr = (CALL // 64) % 2 != 0  # the query rotated by each packed split (Walsh-Hadamard)
    KEEP_BLOCK: tl.constexpr = CALL // 256  # tokens per OTT quant-mask block
    PK: tl.constexpr = D * K_BITS // 8  # bytes of a token's key / value code planes
    PV: tl.constexpr = D * V_BITS // 8
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
    tl.static_assert(not (V_HI and (V_NCH > 1)), "3-bit values: their 2-bit planes lie in one value group")
    tl.static_assert((not V_UNITS) or (AW >= 16), "value units: >= 16 units per accumulator (tl.dot's N)")
    # virtual rows of the packed loop: with K_SUB key groups per block (per-channel keys of groups
    # shorter than a block), row v = g * R_PAD + r is query row r over the tokens of the block's key
    # group g only -- its own online softmax and accumulators, merged into row r at the end like a
    # split -- so one key product (its N = the virtual rows) covers the block's K_SUB groups
    VR: tl.constexpr = R_PAD * K_SUB
    offs_v = tl.arange(0, VR)
    v_ok = (offs_v % R_PAD) < R
    q_rows_v = QP + b.to(tl.int64) * stride_qpb + (h * R + offs_v % R_PAD) * stride_qph  # (VR,) pointers

    if pid_s < num_splits:
        # ------------------------------------------------ packed split
        if ROT_Q:  # the query rotated like the stored keys, into QP (read below)
            _rotate_query(q_rows, r_ok, QP + b.to(tl.int64) * stride_qpb + (h * R + offs_r) * stride_qph, QSIGNS + h * D,
                          R_PAD, D, ROT_Q_SCALE)
        V_LANES: tl.constexpr = (V_UNPACK == 5) | (V_UNPACK == 6)  # codes as 1024 + c * 2**shift
        PKQ: tl.constexpr = PK // 2 if K_HSPLIT else PK  # columns of a key plane's tile (K_HSPLIT: a half's)
        offs_vcol = tl.arange(0, PV)
        offs_pk = tl.arange(0, PKQ)  # stored channel (within a plane) of each column of an unpacked key plane
        offs_pv = offs_vcol
        offs_bn = tl.arange(0, BLOCK_N)  # row of each loaded value token in the block
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
        lo, hi, start, end = _split_range(P_LO, P_HI, b, N, pid_s, num_splits, split_size, BLOCK_N, HAS_RANGE,
                                          HAS_RANGE)
        q0, q1, q2, q3 = _query_planes(q_rows_v, v_ok, offs_pk, KP + h * D, qk_scale, PK, PER_K, K_PERM)
        q4, q5, q6, q7 = q0, q1, q2, q3  # K_HSPLIT: the planes' second halves (channels PKQ + offs_pk)
        if K_HSPLIT:
            q4, q5, q6, q7 = _query_planes(q_rows_v, v_ok, offs_pk + PKQ, KP + h * D, qk_scale, PK, PER_K, K_PERM)
        offs_av, vc0, vc1, vc2, vc3, vh0, vh1, vh2, vh3 = _value_channels(offs_pv, VP + h * D, PV, PER_V, V_PERM, V_NCH,
                                                                          V_UNITS, AW)
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
        # V_T (transposed value products): the accumulators are
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
        qp0 = tl.zeros([PKQ, VR], DOT_T)
        qp1 = qp0
        qp2 = qp0
        qp3 = qp0
        qp4, qp5, qp6, qp7 = qp0, qp0, qp0, qp0  # K_HSPLIT: the second halves
        kbias = tl.zeros([VR], tl.float32)
        V_SCALED: tl.constexpr = (V_NCH > 1) | V_FOLD  # paths that take the scales from _value_scales
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            row_ok = _before(offs_n, end, WHOLE)  # (BLOCK_N,)
            valid = _valid_tokens(offs_n, row_ok, lo, MASK + b * stride_mb + packed_pos, keep_base, WHOLE,
                                  HAS_MASK & MASK_PACKED, HAS_KEEP, KEEP_BLOCK)
            vrows = offs_n * stride_vsn  # (BLOCK_N,) each token's row of value scales / zeros
            if V_SCALED & V_EARLY:  # issued before the key work, whose time hides their latency
                vsc0, vze0, vsc1, vze1, vsc2, vze2, vsc3, vze3, zt = _value_scales(vs_base, vz_base, vrows, row_ok,
                                                                                    offs_z, G1, G2, G3, NACC, V_NCH, V_T)
            # ---- scores (BLOCK_N, VR), transposed: all key planes from one (BLOCK_N, PK) byte tile
            scores, valid2, qp0, qp1, qp2, qp3, qp4, qp5, qp6, qp7, kbias = _key_scores(
                kc_base, ks_base, kz_base, stride_kcn, stride_ksn, n0, start, end, offs_n, row_ok, valid, offs_pk,
                offs_v, q0, q1, q2, q3, q4, q5, q6, q7, qp0, qp1, qp2, qp3, qp4, qp5, qp6, qp7, kbias, BLOCK_N, R_PAD,
                K_BITS, PK, K_GROUP, K_FOLD, K_SUB, K_HALVES, K_HI, K_UNPACK, DOT_T, IEEE, WHOLE, K_HSPLIT)
            if K_MEAN != 0:
                scores = _key_mean_scores(scores, km_base + offs_n[:, None] * stride_kmn, kms_base, kmz_base,
                                          stride_kmsn, offs_n, offs_d, row_ok, qm, qm_sum, K_MEAN, DOT_T, IEEE)
            if HAS_SOFTCAP:
                scores = _softcap(scores, softcap) * 1.4426950408889634
            scores = tl.where(valid2, scores, float("-inf"))  # (BLOCK_N, VR)
            # ---- online softmax (log2 domain), lazily rescaled: the running max only moves (and
            # the accumulators are only rescaled) when a row's max grew by more than 2^8;
            # until then p <= 2^8, harmless in float32 sums and float16 products.
            m_new = tl.maximum(m_i, tl.max(scores, axis=0))
            if tl.max(m_new - m_i, axis=0) > 8.0:
                alpha = tl.exp2(m_i - m_new)
                l_i = l_i * alpha
                (acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, zacc, zsum0, zsum1, zsum2, zsum3, asum0, asum1, asum2,
                 asum3, mzacc, macc) = _rescaled(alpha, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, zacc, zsum0,
                                                 zsum1, zsum2, zsum3, asum0, asum1, asum2, asum3, mzacc, macc, NACC,
                                                 V_UNITS, V_ZACC, V_FOLD, V_LANES, V_MEAN, VM_APART, V_T)
                m_i = m_new
            pt = tl.exp2(scores - m_i[None, :])  # (BLOCK_N, VR), transposed; masked -> 0
            l_i = l_i + tl.sum(pt, axis=0)
            # ---- values: all planes from one (BLOCK_N, PV) byte tile; the products take the
            # transposed probabilities back as their (VR, BLOCK_N) M operand, or with V_T (units)
            # the (PV / 2, BLOCK_N) unit tile's planes are the M operand and pt (BLOCK_N, VR) the N
            offs_nv = n0 + offs_bn  # (BLOCK_N,) token of each loaded value row (see offs_bn)
            if V_SCALED & (not V_EARLY):
                vsc0, vze0, vsc1, vze1, vsc2, vze2, vsc3, vze3, zt = _value_scales(vs_base, vz_base, vrows, row_ok,
                                                                                    offs_z, G1, G2, G3, NACC, V_NCH, V_T)
            if V_NCH > 1:
                acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, zacc = _values_chunks(
                    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, zacc, pt, zt, vsc0, vsc1, vsc2, vsc3, vc_base,
                    stride_vcn, offs_n, offs_nv, row_ok, end, offs_av, offs_z, AW, V_BITS, V_NCH, V_UNPACK, V_UNITS,
                    V_T, V_LANES, DOT_T, IEEE, WHOLE)
            elif V_FOLD:
                if V_UNITS:  # (BLOCK_N, PV / 2) int16 units (the launcher passes an int16 view), tokens in order
                    # (V_T: loaded transposed, (PV / 2, BLOCK_N): the planes are the products' M operand as is)
                    vrow = offs_n * stride_vcn
                    if V_ROW8:  # (triton only sees strides divisible by 16: else one 16-bit load a unit)
                        vrow = tl.multiple_of(vrow, 8)
                    vu, vuh, vuh2 = _unit_tiles(vc_base + vrow, row_ok, PV // 2, V_HI, V_T, V_HPAIR)
                    vcode0, vhi0, vcode1, vhi1, vcode2, vhi2, vcode3, vhi3 = _unit_planes(vu, V_BITS, V_UNPACK, vuh,
                                                                                          V_HI, vuh2, V_HPAIR)
                else:
                    vb, vbh = _code_tile(vc_base + offs_nv * stride_vcn, _before(offs_nv, end, WHOLE), PV, V_HI)
                    vcode0, vcode1, vcode2, vcode3 = _code_planes(vb, V_BITS, DOT_T, V_UNPACK, vbh, V_HI)  # (BLOCK_N, PV)
                    vhi0 = vcode0  # (high-byte tiles: value units only)
                    vhi1 = vcode1
                    vhi2 = vcode2
                    vhi3 = vcode3
                if V_SUM_DOTS:
                    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, zacc, zsum0, zsum1, zsum2, zsum3 = _fold_by_products(
                        acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, zacc, zsum0, zsum1, zsum2, zsum3, pt, vcode0,
                        vcode1, vcode2, vcode3, vhi0, vhi1, vhi2, vhi3, vsc0, vsc1, vsc2, vsc3, vze0, vze1, vze2, vze3,
                        offs_z, PV, V_GROUP, V_BITS, G1, G2, G3, V_UNITS, V_T, V_LANES, DOT_T, IEEE)
                else:
                    (acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, zsum0, zsum1, zsum2, zsum3, asum0, asum1, asum2,
                     asum3) = _fold_by_reductions(
                        acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, zsum0, zsum1, zsum2, zsum3, asum0, asum1, asum2,
                        asum3, pt, vcode0, vcode1, vcode2, vcode3, vhi0, vhi1, vhi2, vhi3, vsc0, vsc1, vsc2, vsc3, vze0,
                        vze1, vze2, vze3, V_BITS, G1, G2, G3, V_UNITS, V_T, V_LANES, DOT_T, IEEE)
            else:
                vb, vbh = _code_tile(vc_base + offs_nv * stride_vcn, _before(offs_nv, end, WHOLE), PV, V_HI)
                acc0, acc1, acc2, acc3 = _values_deq(acc0, acc1, acc2, acc3, pt, vb, vbh, vs_base + vrows,
                                                     vz_base + vrows, offs_pv, row_ok, PV, V_GROUP, V_BITS, V_UNPACK,
                                                     V_HI, DOT_T, IEEE)
            if V_MEAN != 0:
                acc0, acc1, acc2, acc3, macc, mzacc = _value_mean(
                    acc0, acc1, acc2, acc3, macc, mzacc, pt, vm_base + offs_n[:, None] * stride_vmn, vms_base,
                    vmz_base, stride_vmsn, offs_n, offs_d, row_ok, vc0, vc1, vc2, vc3, V_MEAN, VM_APART, V_LANES,
                    V_BITS, DOT_T, IEEE)
        acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, macc = _value_sums_in(
            acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, zacc, zsum0, zsum1, zsum2, zsum3, asum0, asum1, asum2,
            asum3, mzacc, macc, offs_z, V_BITS, V_NCH, V_UNITS, V_T, V_LANES, V_MEAN, VM_APART, V_FOLD, V_PLANE_LANES,
            G1, G2, G3)
        _store_split(m_i, l_i, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, macc, M_part, L_part, O_part, part_row,
                     r_ok, offs_d, vc0, vc1, vc2, vc3, vh0, vh1, vh2, vh3, R_PAD, D, K_SUB, AW, NACC, V_UNITS, VM_APART)
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

