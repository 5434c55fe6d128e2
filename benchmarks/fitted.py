"""Benchmark: what SKVQ permutations, TaDA means (8/16-bit), OTT pools, PATS tier stores and K/V
rotations cost the fused kernel: CUDA-graph time on the Mistral shape (batch 1 and 8, 4k and 32k,
2 and 4 bits, group 128, default config) against the plain kernel and bf16 SDPA. Writes
``decode_fitted.json`` and prints a table of every variant's time per shape last.

    python -m benchmarks.fitted --out artifacts/bench     (CUDA, repository root)
    python -m benchmarks.fitted --variants plain,rotate-2launch,rotate-combine   (the rotations only;
        rotate-qlaunch-*: the same with the query rotated by a launch before the split kernel)
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks.common import (MODELS, WINDOW, _input_sets, _write_json, bf16_bytes, bf16_sdpa_graph_ms, cfg_dict,
                               graph_ms_per_call, log, packed_bytes, packed_inputs)


FITTED_VARIANTS = {  # name: (K and V permuted, mean bits of K and V: 0 off, 8 or 16, OTT pool slots)
    "plain": (False, 0, 0),
    "perm": (True, 0, 0),
    "mean8": (False, 8, 0),
    "mean16": (False, 16, 0),
    "perm+mean8": (True, 8, 0),
    "ott": (False, 0, 3 + 32),  # OTT's pool of 3 + extra pool of 32 slots per kv head, quant masks
    "pats": (False, 0, 0),  # PATS middle-heavy tiers (below): one split launch per tier store, one combine
    # rotated K and V (kvcalib.methods.rotate: random-sign Walsh-Hadamard): the query rotated once per
    # call, the packed value accumulators rotated back once per call (issue 34: within 10% of plain),
    # where ROTATION_RULES says
    "rotate-2launch": (False, 0, 0),
    "rotate-combine": (False, 0, 0),
    "rotate-qlaunch-2launch": (False, 0, 0),
    "rotate-qlaunch-combine": (False, 0, 0),
}
# the rotated variants' kvcalib_kernels.decode.plan settings, whatever the shape:
# COMBINE_ROTATION_MIN_ROWS: the accumulators rotated back by their own launch (never in the
# combine) or inside the combine (always); the qlaunch variants pass a copy of the Walsh-Hadamard
# matrix, so the query is rotated by a launch before the split kernel instead of by the split kernel
ROTATION_RULES = {"rotate-2launch": 1 << 62, "rotate-combine": 0,
                  "rotate-qlaunch-2launch": 1 << 62, "rotate-qlaunch-combine": 0}
# PATS as kvcalib exports it (--schedule middle-heavy, ages 1024 and 4096 after a 128-token window):
# (first age, bits) per stored tier; the "pats" rows run at the last tier's bits (2) only
PATS_TIERS = ((WINDOW, 8), (1024, 4), (4096, 2))


def pats_parts(ctx: int) -> list[tuple[int, int]]:
    """(tokens, bits) of each non-empty PATS tier store at ``ctx`` tokens, youngest first."""
    parts = []
    for i, (age, bits) in enumerate(PATS_TIERS):
        end = PATS_TIERS[i + 1][0] if i + 1 < len(PATS_TIERS) else ctx
        tokens = min(end, ctx) - age
        if tokens > 0:
            parts.append((tokens, bits))
    return parts


def pats_call(q, b, h, d, ctx, win, scale, cfg, dev, seed):
    """One decode step over a PATS layer as the runtime runs it: one split launch per tier store
    (the first with the window) into one partial buffer, one combine
    (:func:`kvcalib_kernels.decode_attention.decode_attention_parts`)."""
    from kvcalib_kernels.decode_attention import decode_attention_parts

    names = ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero")
    parts = []
    for i, (tokens, bits) in enumerate(pats_parts(ctx)):
        part = dict(zip(names, packed_inputs(b, h, tokens, d, bits, 128, 128, dev, seed=seed)),
                    k_bits=bits, v_bits=bits, k_group=128, v_group=128, scaling=scale)
        if i == 0:
            part.update(fp_segments=[win], fp_positions=[ctx - WINDOW])
        parts.append(part)
    return lambda: decode_attention_parts(q, parts, config=cfg)


def fitted_inputs(b, h, n, d, variant, dev, seed=0) -> dict:
    """Random SKVQ permutations (H, D) of K and V, TaDA means (B, 1, N, D) and OTT parts (quant
    masks over blocks of 128 tokens with one pool entrant per block, a pool of full-precision
    K/V at positions inside the packed range) and the rotations (Walsh-Hadamard, random signs) of
    ``variant``."""
    perm, mean_bits, pool = FITTED_VARIANTS[variant]
    g = torch.Generator(device=dev).manual_seed(seed + 1000)
    kw = {}
    if pool:
        keep = torch.full((b, h, n // 8), 255, dtype=torch.uint8, device=dev)  # (B, H, N / 8)
        keep[:, :, ::16] = 254  # token 0 of every 128-token block went to the pool
        kw.update(keep=keep, keep_block=128, pool=(
            torch.randn(b, h, pool, d, device=dev, generator=g).bfloat16(),
            torch.randn(b, h, pool, d, device=dev, generator=g).bfloat16(),
            torch.randint(0, n, (b, h, pool), device=dev, generator=g).int()))
    if perm:
        for side in ("k_perm", "v_perm"):
            kw[side] = torch.stack([torch.randperm(d, device=dev, generator=g) for _ in range(h)]).int()
    if variant in ROTATION_RULES:
        from kvcalib.quant.rotation import hadamard, random_signs

        for i, side in enumerate(("k_rot", "v_rot")):
            matrix = hadamard(d, dev)
            # the qlaunch variants: a copy of the shared Walsh-Hadamard tensor, which the launcher
            # treats as a fitted matrix (query rotated by a launch before the split kernel)
            kw[side] = (matrix.clone() if "qlaunch" in variant else matrix, random_signs(h, d, seed + i).to(dev))
    for side in ("k_mean", "v_mean"):
        if mean_bits == 16:
            kw[side] = torch.randn(b, 1, n, d, device=dev, generator=g).half()
        elif mean_bits == 8:
            kw[side] = (torch.randint(0, 256, (b, 1, n, d), dtype=torch.uint8, device=dev, generator=g),
                        (torch.rand(b, 1, n, 1, device=dev, generator=g) * 0.02).half(),
                        torch.randn(b, 1, n, 1, device=dev, generator=g).half())
    return kw


def fitted_bytes(b, h, n, d, variant) -> int:
    """Bytes the TaDA means add (shared by the kv heads: one (N, D) mean per sequence and side)
    and the OTT parts (quant mask bits per kv head, the pools' bf16 K/V and int32 positions)."""
    _, mean_bits, pool = FITTED_VARIANTS[variant]
    if variant == "pats":  # the 8- and 4-bit tiers' bytes beyond the same tokens at 2 bits
        hq = MODELS["mistral-7b"][0]
        return sum(packed_bytes(b, h, hq, tokens, 0, d, bits, 128, 128)["total"]
                   - packed_bytes(b, h, hq, tokens, 0, d, 2, 128, 128)["total"]
                   for tokens, bits in pats_parts(n + WINDOW) if bits != 2)
    ott = b * h * (n // 8 + pool * (2 * d * 2 + 4)) if pool else 0
    if mean_bits == 16:
        return ott + 2 * b * n * d * 2
    if mean_bits == 8:
        return ott + 2 * b * n * (d + 4)
    return ott


def _timed_with_rotation_rule(variant, fns) -> float:
    """:func:`graph_ms_per_call` of ``fns`` with the variant's launcher settings
    (:data:`ROTATION_RULES`) set while they are warmed up and captured (the launcher reads them at
    every call; the graph keeps the launches chosen then), the launcher's rules restored after."""
    from kvcalib_kernels.decode import plan

    rule = ROTATION_RULES.get(variant)
    if rule is None:
        return graph_ms_per_call(fns, rep=30)
    before = plan.COMBINE_ROTATION_MIN_ROWS
    plan.COMBINE_ROTATION_MIN_ROWS = rule
    try:
        return graph_ms_per_call(fns, rep=30)
    finally:
        plan.COMBINE_ROTATION_MIN_ROWS = before


def _table(rows: list[dict]) -> str:
    """One line per (batch, context, bits): each variant's time and its cost over plain."""
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    lines = ["batch context bits | " + " | ".join(f"{v:>22s}" for v in variants)]
    for key in dict.fromkeys((r["batch"], r["context"], r["bits"]) for r in rows):
        at = {r["variant"]: r["ms_graph"] for r in rows if (r["batch"], r["context"], r["bits"]) == key}
        plain = at.get("plain")
        cells = []
        for v in variants:
            if v not in at:
                cells.append(f"{'-':>22s}")
            elif plain and v != "plain":
                cells.append(f"{1e3 * at[v]:9.1f} us ({100 * (at[v] / plain - 1):+5.1f}%)".rjust(22))
            else:
                cells.append(f"{1e3 * at[v]:9.1f} us".rjust(22))
        lines.append(f"{key[0]:5d} {key[1]:7d} {key[2]:4d} | " + " | ".join(cells))
    return "\n".join(lines)


def main_fitted(args) -> None:
    """What SKVQ permutations and TaDA means cost the fused kernel: CUDA-graph time of each
    :data:`FITTED_VARIANTS` (or those of ``args.variants``) on the Mistral shape (batch 1 and 8,
    4k and 32k, 2 and 4 bits, group 128, default config) against the plain kernel and bf16 SDPA.
    Writes ``decode_fitted.json``; prints :func:`_table` last."""
    from kvcalib_kernels.decode_attention import DecodeConfig, decode_attention

    dev = torch.device("cuda")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    hq, h, d = MODELS["mistral-7b"]
    scale = d ** -0.5
    cfg = DecodeConfig()
    variants = list(FITTED_VARIANTS) if not args.variants else args.variants.split(",")
    unknown = [v for v in variants if v not in FITTED_VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}: choose from {', '.join(FITTED_VARIANTS)}")
    rows = []
    for b, ctx in ((1, 4096), (1, 32768), (8, 32768)):
        n = ctx - WINDOW
        bb = bf16_bytes(b, h, hq, ctx, d)
        bf16_ms = bf16_sdpa_graph_ms(b, h, hq, ctx, d, dev)
        for bits in (2, 4):
            for variant in variants:
                if variant == "pats" and bits != PATS_TIERS[-1][1]:
                    continue
                nb = packed_bytes(b, h, hq, n, WINDOW, d, bits, 128, 128)["total"] + fitted_bytes(b, h, n, d, variant)
                sets = _input_sets(nb)
                fns = []
                for i in range(sets):
                    q = torch.randn(b, hq, d, device=dev, dtype=torch.bfloat16)
                    win = (torch.randn(b, h, WINDOW, d, device=dev, dtype=torch.bfloat16),
                           torch.randn(b, h, WINDOW, d, device=dev, dtype=torch.bfloat16))
                    if variant == "pats":
                        fns.append(pats_call(q, b, h, d, ctx, win, scale, cfg, dev, seed=i))
                        continue
                    packed = packed_inputs(b, h, n, d, bits, 128, 128, dev, seed=i)
                    extra = fitted_inputs(b, h, n, d, variant, dev, seed=i)
                    fns.append(lambda q=q, packed=packed, win=win, extra=extra: decode_attention(
                        q, *packed, k_bits=bits, v_bits=bits, k_group=128, v_group=128, scaling=scale,
                        fp_segments=[win], fp_positions=[n], config=cfg, **extra))
                ms = _timed_with_rotation_rule(variant, fns)
                rows.append({"model": "mistral-7b", "batch": b, "context": ctx, "bits": bits, "variant": variant,
                             "ms_graph": ms, "bf16_ms_graph": bf16_ms, "speedup": bf16_ms / ms, "bytes": nb,
                             "bf16_bytes": bb, "gpu": torch.cuda.get_device_name(0)})
                log(f"  b={b} ctx={ctx:6d} bits={bits} {variant:14s}: {1e3 * ms:7.1f} us (bf16 {1e3 * bf16_ms:.1f} us, "
                    f"{bf16_ms / ms:.2f}x)")
                del fns
                torch.cuda.empty_cache()
        command = "python -m benchmarks.fitted" + (f" --variants {args.variants}" if args.variants else "")
        _write_json(out / "decode_fitted.json", {"rows": rows, "config": cfg_dict(cfg), "command": command})
    log(_table(rows))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="artifacts/bench")
    ap.add_argument("--variants", default="", help=f"comma-separated, of {', '.join(FITTED_VARIANTS)} (default: all)")
    main_fitted(ap.parse_args(argv))


if __name__ == "__main__":
    main()
