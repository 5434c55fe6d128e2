"""Probe: the split kernel with tokens as the MMA's M dimension ("swap AB"), plain packed K/V.

The production split kernel (:mod:`kvcalib_kernels.decode_attention`) once multiplied the R query
rows of a GQA group (4 for Mistral-7B, padded into 16-row MMA tiles) by the unpacked codes. This
probe computes the transposed products instead: scores^T (BLOCK_N, RN) = codes (BLOCK_N, PK) @
(q * s)^T (PK, RN) -- the codes fill the MMA rows, the R query rows become its small N -- and the
value product either as acc^T (PV, RN) = codes^T @ (p * s) (``v_swap``) or as before. Plain layout
only (per-channel keys, per-token values with a group >= one plane, no window / mask / perm /
means): enough to time against the production kernel at the same shape and check the outputs.

Two further options, for the second sweep (``--sweep vlayout``):

- ``k_unp`` / ``v_unp`` 7: every plane of a byte tile from one PTX block
  (:func:`decode_attention._code_planes`, the exponent byte set once per 4 bytes) instead of one
  block per plane (5);
- ``v_tok``: value codes stored (B, H, N / 4, PV, 4) -- 4 consecutive tokens of a byte column per
  32-bit word (:func:`to_tok`), so the value MMA's token-pair operand registers come from one word
  instead of byte gathers from shared memory.

``python kernels/bench/probe_swap.py [--sweep swap|vlayout] [--out DIR]`` (CUDA): median CUDA-graph
time per variant at Mistral-7B shape, 32k, batch 8/1, 2/4 bits, with the max difference from the
production kernel's output (``probe_swap.json`` / ``probe_vlayout.json``).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import triton
import triton.language as tl

from kvcalib_kernels.decode_attention import _code_planes, _combine, _partials, _perm4


@triton.jit
def _swap_split_kernel(
    Q, stride_qb, stride_qh,  # (B, Hq, D)
    M_part, L_part, O_part, S_TOT,  # (B*Hq, S), (B*Hq, S), (B*Hq, S, D) float32
    KC, stride_kcb, stride_kch, stride_kcn,  # (B, H, N, PK) uint8
    KS, KZ, stride_ksb, stride_ksh, stride_ksn,  # (B, H, N / K_GROUP, D) float16
    VC, stride_vcb, stride_vch, stride_vcn,  # (B, H, N, PV) uint8
    VS, VZ, stride_vsb, stride_vsh, stride_vsn,  # (B, H, N, D / V_GROUP) float16
    N, split_size, qk_scale, H,
    R: tl.constexpr, RN: tl.constexpr, D: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
    PK: tl.constexpr, PV: tl.constexpr, K_GROUP: tl.constexpr, V_GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr, V_SWAP: tl.constexpr, K_UNP: tl.constexpr, V_UNP: tl.constexpr,
    V_TOK: tl.constexpr = False, K_ALL: tl.constexpr = False, V_ALL: tl.constexpr = False,
):
    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    PER_K: tl.constexpr = 8 // K_BITS
    PER_V: tl.constexpr = 8 // V_BITS
    offs_r = tl.arange(0, RN)
    r_ok = offs_r < R
    q_cols = Q + b.to(tl.int64) * stride_qb + (h * R + offs_r) * stride_qh  # (RN,) pointers
    offs_pk = tl.arange(0, PK)
    offs_pv = tl.arange(0, PV)
    offs_bn = tl.arange(0, BLOCK_N)
    offs_qk = offs_pk
    if K_UNP == 5:
        offs_qk = _perm4(offs_pk)
    if V_UNP == 5:
        offs_bn = _perm4(offs_bn)
    start = pid_s * split_size
    end = tl.minimum(start + split_size, N)
    kc_base = KC + b.to(tl.int64) * stride_kcb + h.to(tl.int64) * stride_kch
    ks_base = KS + b.to(tl.int64) * stride_ksb + h.to(tl.int64) * stride_ksh
    kz_base = KZ + b.to(tl.int64) * stride_ksb + h.to(tl.int64) * stride_ksh
    vc_base = VC + b.to(tl.int64) * stride_vcb + h.to(tl.int64) * stride_vch
    vs_base = VS + b.to(tl.int64) * stride_vsb + h.to(tl.int64) * stride_vsh
    vz_base = VZ + b.to(tl.int64) * stride_vsb + h.to(tl.int64) * stride_vsh
    # q^T planes (PK, RN) float32, pre-scaled
    qt0 = tl.load(q_cols[None, :] + offs_qk[:, None], mask=r_ok[None, :], other=0.0).to(tl.float32) * qk_scale
    qt1 = qt0
    qt2 = qt0
    qt3 = qt0
    if PER_K > 1:
        qt1 = tl.load(q_cols[None, :] + PK + offs_qk[:, None], mask=r_ok[None, :], other=0.0).to(tl.float32) * qk_scale
    if PER_K > 2:
        qt2 = tl.load(q_cols[None, :] + 2 * PK + offs_qk[:, None], mask=r_ok[None, :], other=0.0).to(tl.float32) * qk_scale
        qt3 = tl.load(q_cols[None, :] + 3 * PK + offs_qk[:, None], mask=r_ok[None, :], other=0.0).to(tl.float32) * qk_scale
    qp0 = tl.zeros([PK, RN], tl.float16)
    qp1 = qp0
    qp2 = qp0
    qp3 = qp0
    kbias = tl.zeros([RN], tl.float32)
    m_i = tl.full([RN], -1.0e30, tl.float32)
    l_i = tl.zeros([RN], tl.float32)
    if V_SWAP:
        acc0 = tl.zeros([PV, RN], tl.float32)
    else:
        acc0 = tl.zeros([RN, PV], tl.float32)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    asum0 = tl.zeros([RN], tl.float32)
    asum1 = asum0
    asum2 = asum0
    asum3 = asum0
    zsum0 = asum0  # sum_n p * zero of the value group of plane s
    zsum1 = asum0
    zsum2 = asum0
    zsum3 = asum0
    G1: tl.constexpr = PV // V_GROUP
    G2: tl.constexpr = (2 * PV) // V_GROUP
    G3: tl.constexpr = (3 * PV) // V_GROUP
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        row_ok = offs_n < end
        kb = tl.load(kc_base + offs_n[:, None] * stride_kcn + offs_pk[None, :], mask=row_ok[:, None], other=0)
        if ((n0 % K_GROUP) == 0) | (n0 == start):
            krow = (n0 // K_GROUP) * stride_ksn
            ks = tl.load(ks_base + krow + offs_qk).to(tl.float32)
            kz = tl.load(kz_base + krow + offs_qk).to(tl.float32)
            qp0 = (qt0 * ks[:, None]).to(tl.float16)
            kbias = tl.sum(qt0 * kz[:, None], axis=0) - 1024.0 * tl.sum(qp0.to(tl.float32), axis=0)
            if PER_K > 1:
                ks = tl.load(ks_base + krow + PK + offs_qk).to(tl.float32)
                kz = tl.load(kz_base + krow + PK + offs_qk).to(tl.float32)
                qp1 = (qt1 * ks[:, None] * (1.0 / (1 << K_BITS))).to(tl.float16)
                kbias += tl.sum(qt1 * kz[:, None], axis=0) - 1024.0 * tl.sum(qp1.to(tl.float32), axis=0)
            if PER_K > 2:
                ks = tl.load(ks_base + krow + 2 * PK + offs_qk).to(tl.float32)
                kz = tl.load(kz_base + krow + 2 * PK + offs_qk).to(tl.float32)
                qp2 = (qt2 * ks[:, None] * (1.0 / (1 << (2 * K_BITS)))).to(tl.float16)
                kbias += tl.sum(qt2 * kz[:, None], axis=0) - 1024.0 * tl.sum(qp2.to(tl.float32), axis=0)
                ks = tl.load(ks_base + krow + 3 * PK + offs_qk).to(tl.float32)
                kz = tl.load(kz_base + krow + 3 * PK + offs_qk).to(tl.float32)
                qp3 = (qt3 * ks[:, None] * (1.0 / (1 << (3 * K_BITS)))).to(tl.float16)
                kbias += tl.sum(qt3 * kz[:, None], axis=0) - 1024.0 * tl.sum(qp3.to(tl.float32), axis=0)
        st = tl.zeros([BLOCK_N, RN], tl.float32)
        kc0, kc1, kc2, kc3 = _code_planes(kb, K_BITS, tl.float16, K_UNP, K_ALL)  # (BLOCK_N, PK) each
        st = tl.dot(kc0, qp0, st)
        if PER_K > 1:
            st = tl.dot(kc1, qp1, st)
        if PER_K > 2:
            st = tl.dot(kc2, qp2, st)
            st = tl.dot(kc3, qp3, st)
        st = tl.where(row_ok[:, None], st + kbias[None, :], float("-inf"))  # (BLOCK_N, RN)
        m_new = tl.maximum(m_i, tl.max(st, axis=0))
        if tl.max(m_new - m_i, axis=0) > 8.0:
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha
            if V_SWAP:
                acc0 = acc0 * alpha[None, :]
                acc1 = acc1 * alpha[None, :]
                acc2 = acc2 * alpha[None, :]
                acc3 = acc3 * alpha[None, :]
            else:
                acc0 = acc0 * alpha[:, None]
                acc1 = acc1 * alpha[:, None]
                acc2 = acc2 * alpha[:, None]
                acc3 = acc3 * alpha[:, None]
            asum0 = asum0 * alpha
            asum1 = asum1 * alpha
            asum2 = asum2 * alpha
            asum3 = asum3 * alpha
            zsum0 = zsum0 * alpha
            zsum1 = zsum1 * alpha
            zsum2 = zsum2 * alpha
            zsum3 = zsum3 * alpha
            m_i = m_new
        p = tl.exp2(st - m_i[None, :])  # (BLOCK_N, RN)
        l_i += tl.sum(p, axis=0)
        if V_TOK:  # (N/4, PV, 4): 4 tokens of a byte column per 32-bit word (stored in lane order)
            offs_k = tl.arange(0, BLOCK_N)
            vbt = tl.load(vc_base + (n0 // 4 + offs_k[None, :] // 4) * stride_vcn + offs_pv[:, None] * 4
                          + offs_k[None, :] % 4, mask=((n0 + offs_k) < end)[None, :], other=0)  # (PV, BLOCK_N)
            vb = tl.trans(vbt)
        else:
            offs_nv = n0 + offs_bn
            vb = tl.load(vc_base + offs_nv[:, None] * stride_vcn + offs_pv[None, :], mask=(offs_nv < end)[:, None],
                         other=0)
        vrow = vs_base + offs_n * stride_vsn
        zrow = vz_base + offs_n * stride_vsn
        vs = tl.load(vrow, mask=row_ok, other=0.0).to(tl.float32)
        a0 = (p * vs[:, None]).to(tl.float16)  # (BLOCK_N, RN)
        asum0 += tl.sum(a0.to(tl.float32), axis=0)
        zsum0 += tl.sum(p * tl.load(zrow, mask=row_ok, other=0.0).to(tl.float32)[:, None], axis=0)
        c0, c1, c2, c3 = _code_planes(vb, V_BITS, tl.float16, V_UNP, V_ALL)  # (BLOCK_N, PV) each
        if V_SWAP:
            acc0 = tl.dot(tl.trans(c0), a0, acc0)
        else:
            acc0 = tl.dot(tl.trans(a0), c0, acc0)
        if PER_V > 1:
            a1 = a0
            if G1 != 0:
                vs = tl.load(vrow + G1, mask=row_ok, other=0.0).to(tl.float32)
                a1 = (p * vs[:, None]).to(tl.float16)
                zsum1 += tl.sum(p * tl.load(zrow + G1, mask=row_ok, other=0.0).to(tl.float32)[:, None], axis=0)
            asum1 += tl.sum(a1.to(tl.float32), axis=0)
            if V_SWAP:
                acc1 = tl.dot(tl.trans(c1), a1, acc1)
            else:
                acc1 = tl.dot(tl.trans(a1), c1, acc1)
        if PER_V > 2:
            a2 = a1
            if G2 != G1:
                vs = tl.load(vrow + G2, mask=row_ok, other=0.0).to(tl.float32)
                a2 = (p * vs[:, None]).to(tl.float16)
                zsum2 += tl.sum(p * tl.load(zrow + G2, mask=row_ok, other=0.0).to(tl.float32)[:, None], axis=0)
            asum2 += tl.sum(a2.to(tl.float32), axis=0)
            a3 = a2
            if G3 != G2:
                vs = tl.load(vrow + G3, mask=row_ok, other=0.0).to(tl.float32)
                a3 = (p * vs[:, None]).to(tl.float16)
                zsum3 += tl.sum(p * tl.load(zrow + G3, mask=row_ok, other=0.0).to(tl.float32)[:, None], axis=0)
            asum3 += tl.sum(a3.to(tl.float32), axis=0)
            if V_SWAP:
                acc2 = tl.dot(tl.trans(c2), a2, acc2)
                acc3 = tl.dot(tl.trans(c3), a3, acc3)
            else:
                acc2 = tl.dot(tl.trans(a2), c2, acc2)
                acc3 = tl.dot(tl.trans(a3), c3, acc3)
    # zero sums: planes sharing a value group share the sum
    if G1 == 0:
        zsum1 = zsum0
    if G2 == G1:
        zsum2 = zsum1
    if G3 == G2:
        zsum3 = zsum2
    part_row = (b * H * R + h * R + offs_r).to(tl.int64) * S_TOT + pid_s  # (RN,)
    tl.store(M_part + part_row, m_i, mask=r_ok)
    tl.store(L_part + part_row, l_i, mask=r_ok)
    o_rows = O_part + part_row * D
    if V_SWAP:
        acc0 = tl.trans(acc0)
        acc1 = tl.trans(acc1)
        acc2 = tl.trans(acc2)
        acc3 = tl.trans(acc3)
    acc0 = acc0 - 1024.0 * asum0[:, None] + zsum0[:, None]
    tl.store(o_rows[:, None] + offs_pv[None, :], acc0, mask=r_ok[:, None])
    if PER_V > 1:
        acc1 = (acc1 - 1024.0 * asum1[:, None]) * (1.0 / (1 << V_BITS)) + zsum1[:, None]
        tl.store(o_rows[:, None] + PV + offs_pv[None, :], acc1, mask=r_ok[:, None])
    if PER_V > 2:
        acc2 = (acc2 - 1024.0 * asum2[:, None]) * (1.0 / (1 << (2 * V_BITS))) + zsum2[:, None]
        acc3 = (acc3 - 1024.0 * asum3[:, None]) * (1.0 / (1 << (3 * V_BITS))) + zsum3[:, None]
        tl.store(o_rows[:, None] + 2 * PV + offs_pv[None, :], acc2, mask=r_ok[:, None])
        tl.store(o_rows[:, None] + 3 * PV + offs_pv[None, :], acc3, mask=r_ok[:, None])


def swap_attention(q, kc, ks, kz, vc, vs, vz, *, bits, k_group, v_group, scaling, block_n=64, num_warps=1,
                   v_swap=True, k_unp=6, v_unp=6, rn=None, splits=None, num_stages=2, v_tok=False):
    """Plain packed decode attention through the probe kernel: (B, Hq, D) float32."""
    b, hq, d = q.shape
    h, n = kc.shape[1], kc.shape[2]
    r = hq // h
    rn = rn or max(r, 4)
    n_blocks = math.ceil(n / block_n)
    if splits is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        splits = max(1, min(n_blocks // 2, math.ceil(16 * sms / (b * h))))
    split_size = math.ceil(n_blocks / splits) * block_n
    splits = math.ceil(n / split_size)
    m_part, l_part, o_part, out = _partials(b, hq, d, splits, q.device)
    _swap_split_kernel[(b * h, splits)](
        q, q.stride(0), q.stride(1), m_part, l_part, o_part, splits,
        kc, kc.stride(0), kc.stride(1), kc.stride(2), ks, kz, ks.stride(0), ks.stride(1), ks.stride(2),
        vc, vc.stride(0), vc.stride(1), vc.stride(2), vs, vz, vs.stride(0), vs.stride(1), vs.stride(2),
        n, split_size, scaling * 1.4426950408889634, h,
        R=r, RN=rn, D=d, K_BITS=bits, V_BITS=bits, PK=d * bits // 8, PV=d * bits // 8, K_GROUP=k_group,
        V_GROUP=v_group, BLOCK_N=block_n, V_SWAP=v_swap, K_UNP=5 if k_unp == 7 else k_unp,
        V_UNP=5 if v_unp == 7 else v_unp, V_TOK=v_tok, K_ALL=k_unp == 7, V_ALL=v_unp == 7,
        num_warps=num_warps, num_stages=num_stages)
    _combine(m_part, l_part, o_part, splits, out)
    return out


def to_tok(vc, lanes):
    """(B, H, N, PV) codes -> (B, H, N / 4, PV, 4): 4 tokens of a byte column per 32-bit word, in the
    lane unpack's order (0, 2, 1, 3) when ``lanes``."""
    b, h, n, p = vc.shape
    t = vc.view(b, h, n // 4, 4, p)
    if lanes:
        t = t[:, :, :, [0, 2, 1, 3], :]
    return t.permute(0, 1, 2, 4, 3).contiguous()


def sweep_variants(sweep: str) -> list[dict]:
    """The probe options of one sweep: ``swap`` (which products to transpose, unpack, tile shape) or
    ``vlayout`` (all-plane unpack and the token-word value layout, each with 2 and 3 stages)."""
    variants = []
    if sweep == "swap":
        for vsw in (True, False):
            for ku, vu in ((6, 6), (5, 6), (5, 5)):
                for bn, nw in ((64, 1), (64, 4), (128, 4)):
                    for rn in (4, 8, 16):
                        variants.append(dict(v_swap=vsw, k_unp=ku, v_unp=vu, block_n=bn, num_warps=nw, rn=rn))
        return variants
    for ku, vu, vt, vsw in ((5, 5, False, False), (7, 7, False, False), (5, 5, True, False), (7, 7, True, False),
                            (5, 5, True, True), (7, 7, True, True)):
        for ns in (2, 3):
            variants.append(dict(k_unp=ku, v_unp=vu, v_tok=vt, v_swap=vsw, num_stages=ns))
    for extra in (dict(num_warps=2), dict(block_n=128), dict(rn=8)):
        variants.append(dict(k_unp=7, v_unp=7, v_tok=True, v_swap=True, num_stages=2, **extra))
    return variants


def _inputs(packed, tok, v):
    """The packed tensors a variant reads: the token-word value codes when ``v_tok``."""
    if not v.get("v_tok"):
        return packed
    return (*packed[:3], tok[v["v_unp"] in (5, 7)], *packed[4:])


def main(argv=None) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_decode import graph_ms_per_call, packed_inputs

    from kvcalib_kernels.decode_attention import decode_attention

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", choices=("swap", "vlayout"), default="swap")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--bits", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 1])
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    h, hq, d, n = 8, 32, 128, 32768
    scale = d ** -0.5
    variants = sweep_variants(args.sweep)
    rows = []
    for bits in args.bits:
        for bsz in args.batches:
            sets = []
            for seed in range(4 if bsz == 8 else 16):
                q = torch.randn(bsz, hq, d, device=dev).half()
                packed = packed_inputs(bsz, h, n, d, bits, 128, 128, dev, seed=seed)
                tok = (to_tok(packed[3], False), to_tok(packed[3], True)) if args.sweep == "vlayout" else None
                sets.append((q, packed, tok))
            q0, p0, t0 = sets[0]
            ref = decode_attention(q0, *p0, k_bits=bits, v_bits=bits, k_group=128, v_group=128, scaling=scale)
            prod_ms = graph_ms_per_call([
                (lambda q=q, p=p: decode_attention(q, *p, k_bits=bits, v_bits=bits, k_group=128, v_group=128,
                                                   scaling=scale)) for q, p, _ in sets], 200)
            rows.append(dict(kernel="production", bits=bits, batch=bsz, ms=prod_ms, err=0.0))
            print(f"bits {bits} batch {bsz}: production {prod_ms * 1e3:.1f} us", flush=True)
            for v in variants:
                try:
                    out = swap_attention(q0, *_inputs(p0, t0, v), bits=bits, k_group=128, v_group=128,
                                         scaling=scale, **v)
                    err = float((out - ref).abs().max())
                    ms = graph_ms_per_call([
                        (lambda q=q, p=_inputs(p, t, v): swap_attention(q, *p, bits=bits, k_group=128, v_group=128,
                                                                         scaling=scale, **v)) for q, p, t in sets],
                        200)
                except Exception as e:  # noqa: BLE001 - a variant Triton refuses is reported
                    rows.append(dict(kernel="swap", bits=bits, batch=bsz, **v, ms=None, err=None,
                                     error=f"{type(e).__name__}: {str(e)[:200]}"))
                    print(f"  {v}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                rows.append(dict(kernel="swap", bits=bits, batch=bsz, **v, ms=ms, err=err))
                print(f"  {v}: {ms * 1e3:.1f} us ({prod_ms / ms:.2f}x production), max |diff| {err:.2e}", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"probe_{args.sweep}.json").write_text(json.dumps(rows, indent=1))
    ok = [r for r in rows if r["kernel"] == "swap" and r["ms"] and r["err"] is not None and r["err"] < 1e-2]
    keys = sorted({k for v in variants for k in v})
    print("\nbest correct probe variant per shape:")
    for bits in args.bits:
        for bsz in args.batches:
            prod = next(r for r in rows if r["kernel"] == "production" and r["bits"] == bits and r["batch"] == bsz)
            cand = [r for r in ok if r["bits"] == bits and r["batch"] == bsz]
            if cand:
                best = min(cand, key=lambda r: r["ms"])
                print(f"bits {bits} b{bsz}: production {prod['ms'] * 1e3:.1f} us, probe {best['ms'] * 1e3:.1f} us "
                      f"({prod['ms'] / best['ms']:.2f}x) {({k: best.get(k) for k in keys})}")


if __name__ == "__main__":
    main()
