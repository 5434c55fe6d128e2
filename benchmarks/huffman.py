"""Benchmark: Triton Huffman decoder and Huffman-fused decode attention vs fixed-width and bf16.

Shape (shared/DESIGN.md protocol): Mistral-7B (32 query heads, 8 kv heads, head_dim 128), one
attention layer, ``--context`` tokens (default 32k) of which the last 128 are the bf16 window and
the rest packed, ``--batch`` 8, 2-bit and 4-bit codes: keys per channel over groups of 128 tokens
(KIVI), values per token over 128 channels.

Data: the codes are real quantizer output, not random bytes: K and V are drawn (keys: Laplace
with per-channel location and spread, some outlier channels; values: Gaussian), quantized by
:mod:`kvcalib.quant.uniform` (the specification), unpacked, and coded one stream per token
(block format v1) with codebooks fitted on a *separate* calibration draw. Each row records the
order-0 entropy of the symbols and the coded bits per symbol (payload only, and with the int64
offsets and flags of format v1).

Per bit width:

- ``decode`` rows (one per side K / V): standalone :func:`~kvcalib_kernels.huffman_decode.huffman_decode`
  (``validate=False``), ``decode_gbps`` = decoded bytes written (``N * D`` uint8) / time; best
  of a small launch-config sweep (kept in ``huffman_meta.json``). The decoded codes are checked
  bit-exact against the symbols first (``validate=True``).
- ``fused`` row: :func:`~kvcalib_kernels.decode_attention_huffman.decode_attention_huffman`
  (``validate=False``, best of a small config sweep) ``fused_ms``; the fixed-width kernel
  :func:`~kvcalib_kernels.decode_attention.decode_attention` on the same quantized values
  ``fixed_ms``; the fastest bf16 SDPA form over the same context ``bf16_ms``; and the largest
  difference between the fused and the fixed-width outputs (same quantized values: float
  rounding only).

Timing: median of ``triton.testing.do_bench`` (L2 flushed before each call). Writes
``huffman.json`` (rows), ``huffman_meta.json`` (device, sweeps, encoder check) and ``huffman.md``
under ``--out``. ``--smoke`` runs tiny shapes on CPU under ``TRITON_INTERPRET=1`` (checks the
path and the files; timings are left null).

GPU run (from the repository root; kvcalib_kernels is kernels/ under its install name)::

    KK=/tmp/kk && mkdir -p $KK && ln -sfn $PWD/kernels $KK/kvcalib_kernels && \\
    python -m benchmarks.huffman --out "$OUT"      (repository root; scripts/gpu_bench.sh huffman)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

HQ, H, D = 32, 8, 128  # Mistral-7B
MODEL = "mistral-7b"
WINDOW = 128
GROUP = 128


def log(*a) -> None:
    print(*a, flush=True)


def _write_json(path: Path, obj) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    tmp.replace(path)


FIRST_CALL_S: list[float] = []  # wall time of each benchmarked function's first call (compiles included)


def _bench(fn, smoke: bool) -> float | None:
    t0 = time.time()
    fn()
    if not smoke:
        torch.cuda.synchronize()
    FIRST_CALL_S.append(round(time.time() - t0, 2))
    if smoke:
        return None
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))


# ---------------------------------------------------------------- data


def draw_kv(b, h, t, d, dev, seed):
    """(K, V) float32 (B, H, T, D): keys Laplace with per-channel location/spread (a few outlier
    channels, as real keys have), values Gaussian."""
    g = torch.Generator(device=dev).manual_seed(seed)
    loc = torch.randn(1, h, 1, d, device=dev, generator=g) * 2
    spread = torch.exp(torch.randn(1, h, 1, d, device=dev, generator=g) * 0.5)
    spread[..., :: d // 4] *= 4  # outlier channels
    u = torch.rand(b, h, t, d, device=dev, generator=g) - 0.5
    k = loc - spread * u.sign() * torch.log1p(-2 * u.abs().clamp(max=0.4999999))
    v = torch.randn(b, h, t, d, device=dev, generator=g)
    return k, v


def quantize(k, v, bits):
    from kvcalib.quant.uniform import quantize_keys, quantize_values

    return quantize_keys(k, bits, GROUP), quantize_values(v, bits, min(GROUP, k.shape[-1]))


def entropy_bits(hist: torch.Tensor) -> float:
    p = hist.double() / hist.sum()
    p = p[p > 0]
    return float(-(p * p.log2()).sum())


def encode_torch(symbols: torch.Tensor, codebook, rows_per_chunk: int = 1 << 17):
    """Block format v1 (kvcalib.quant.huffman.encode_blocks) computed with torch ops on the
    symbols' device: the reference encoder is NumPy on the CPU and takes minutes for the 2**28
    symbols of a 32k x batch-8 layer. Checked equal to encode_blocks on a slice (meta).

    symbols: uint8 (N, L). Returns EncodedBlocks on symbols.device.
    """
    from kvcalib.quant.huffman import EncodedBlocks

    dev = symbols.device
    n, L = symbols.shape
    b = codebook.bits
    lengths = codebook.lengths.to(dev, torch.int64)
    codes = codebook.codes.to(dev, torch.int64)
    row_bits = torch.zeros(n, dtype=torch.int64, device=dev)
    for r0 in range(0, n, rows_per_chunk):
        row_bits[r0:r0 + rows_per_chunk] = lengths[symbols[r0:r0 + rows_per_chunk].long()].sum(1)
    raw = row_bits >= L * b  # the escape: raw is never longer than coded
    row_bits = torch.where(raw, L * b, row_bits)
    off = torch.zeros(n + 1, dtype=torch.int64, device=dev)
    torch.cumsum(row_bits, 0, out=off[1:])
    total = int(off[-1])
    n_words = (total + 31) // 32 + 1
    words = torch.zeros(n_words + 1, dtype=torch.int64, device=dev)  # one spare: lo of the last word
    for r0 in range(0, n, rows_per_chunk):
        x = symbols[r0:r0 + rows_per_chunk].long()  # (n_c, L)
        rw = raw[r0:r0 + rows_per_chunk, None]
        ln = torch.where(rw, b, lengths[x])
        val = torch.where(rw, x, codes[x])
        pos = off[r0:r0 + x.shape[0], None] + torch.cumsum(ln, 1) - ln  # start bit of each code word
        w, s = pos >> 5, pos & 31
        e = s + ln  # end of the word within the 64-bit window (MSB-first), <= 47
        hi = torch.where(e <= 32, val << (32 - e).clamp(min=0), val >> (e - 32).clamp(min=0))
        t = 64 - e  # val's low bit lands at bit t of the 64-bit window (LSB numbering)
        lo = torch.where(t < 32, (val & ((1 << (32 - t).clamp(min=0)) - 1)) << t.clamp(max=31), 0)
        words.index_add_(0, w.reshape(-1), hi.reshape(-1))  # code words never overlap: sum == OR
        words.index_add_(0, (w + 1).reshape(-1), lo.reshape(-1))
    words = words[:n_words]
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return EncodedBlocks(payload=words.view(torch.uint32), bit_offsets=off, raw_fallback=raw, n_symbols=L, bits=b)


def check_encoder(symbols, codebook) -> bool:
    from kvcalib.quant.huffman import encode_blocks

    part = symbols[:4099].contiguous()
    ref = encode_blocks(part.cpu(), codebook)
    got = encode_torch(part, codebook)
    return (torch.equal(got.payload.view(torch.int32).cpu(), ref.payload.view(torch.int32))
            and torch.equal(got.bit_offsets.cpu(), ref.bit_offsets)
            and torch.equal(got.raw_fallback.cpu(), ref.raw_fallback))


# ---------------------------------------------------------------- bf16 baseline


def bf16_ms(b, hq, h, t, dev, smoke):
    import torch.nn.functional as F

    if smoke:
        return None, None
    k = torch.randn(b, h, t, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(b, h, t, D, device=dev, dtype=torch.bfloat16)
    q4 = torch.randn(b, hq, 1, D, device=dev, dtype=torch.bfloat16)
    qg = q4.reshape(b, h, hq // h, D)  # the GQA group as query rows: K/V read once
    forms = {"sdpa_enable_gqa": lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=True),
             "sdpa_grouped_rows": lambda: F.scaled_dot_product_attention(qg, k, v)}
    best = (None, None)
    for name, fn in forms.items():
        try:
            ms = _bench(fn, smoke)
        except Exception as err:  # noqa: BLE001 - a form this torch refuses is skipped
            log(f"  bf16 {name}: skipped ({type(err).__name__}: {str(err)[:80]})")
            continue
        if best[0] is None or ms < best[0]:
            best = (ms, name)
    del k, v
    return best


# ---------------------------------------------------------------- main


def run(args) -> None:
    smoke = args.smoke
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if smoke and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    from kvcalib.quant.huffman import build_codebook, encoded_bits_per_symbol, symbol_histogram
    from kvcalib.quant.packing import unpack_codes
    from kvcalib_kernels.decode_attention import DecodeConfig, decode_attention
    from kvcalib_kernels.decode_attention_huffman import HuffmanAttentionConfig, decode_attention_huffman
    from kvcalib_kernels.huffman_decode import (choose_step, decode_streams, decode_table, funnel_shift_available,
                                                huffman_decode)

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu" and not smoke:
        raise SystemExit("no CUDA device: run with --smoke (CPU interpreter, tiny shapes, no timings)")
    import triton

    hq, h = (4, 1) if smoke else (HQ, H)  # smoke: one GQA group of the Mistral shape
    b = 1 if smoke else args.batch
    ctx = (GROUP + 16) if smoke else args.context
    window = 16 if smoke else WINDOW
    n = ctx - window
    if n % GROUP:
        raise SystemExit(f"context - window = {n} must be a multiple of the key group {GROUP}")
    gpu = torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu (interpreter smoke run)"
    meta = {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__, "smoke": smoke,
            "command": " ".join(["python -m benchmarks.huffman", *sys.argv[1:]]), "model": MODEL,
            "shape": {"q_heads": hq, "kv_heads": h, "head_dim": D, "batch": b, "context": ctx, "window": window,
                      "k_group": GROUP, "v_group": GROUP},
            "data": "keys Laplace (per-channel location/spread, outlier channels), values Gaussian; "
                    "kvcalib.quant.uniform; codebooks from a separate calibration draw",
            "decode_sweep": [], "fused_sweep": [], "encoder_equals_reference": {}}
    rows = []
    t_start = time.time()
    meta["funnel_shift_asm"] = funnel_shift_available(0) if dev.type == "cuda" else False
    scale = D ** -0.5
    ms16, bf16_name = bf16_ms(b, hq, h, ctx, dev, smoke)
    meta["bf16_baseline"] = bf16_name
    log(f"device {gpu}; bf16 SDPA {ms16} ms ({bf16_name})")

    g = torch.Generator(device=dev).manual_seed(1)
    q = torch.randn(b, hq, D, device=dev, generator=g).to(torch.bfloat16)
    win = (torch.randn(b, h, window, D, device=dev, generator=g).to(torch.bfloat16),
           torch.randn(b, h, window, D, device=dev, generator=g).to(torch.bfloat16))
    if smoke:
        dec_cfgs = [dict(block_s=32, chunk=32, num_warps=1)]
        fused_cfgs = [HuffmanAttentionConfig(block_n=32, fp_block=16)]
    else:
        dec_cfgs = [dict(block_s=bs, chunk=c, num_warps=w) for bs, c, w in
                    ((128, 64, 4), (128, 32, 4), (256, 64, 8), (64, 64, 2))]
        fused_cfgs = [HuffmanAttentionConfig(block_n=bn, num_warps=w, programs_per_sm=p) for bn, w, p in
                      ((64, 2, 16.0), (64, 2, 32.0), (64, 1, 16.0), (32, 1, 16.0), (128, 4, 16.0))]
        if args.quick:
            dec_cfgs, fused_cfgs = dec_cfgs[:2], fused_cfgs[:2]

    for bits in args.bits:
        t0 = time.time()
        k, v = draw_kv(b, h, n, D, dev, seed=bits)
        qk, qv = quantize(k, v, bits)
        del k, v
        kc, vc = draw_kv(1, h, 4 * GROUP, D, dev, seed=100 + bits)  # calibration draw
        ck, cv = quantize(kc, vc, bits)
        del kc, vc
        side_rows = {}
        blocks, books = {}, {}
        for side, qt, cal in (("k", qk, ck), ("v", qv, cv)):
            sym = unpack_codes(qt.codes, bits).reshape(-1, D)  # (B*H*N, D): one stream per token
            cb = build_codebook(symbol_histogram(unpack_codes(cal.codes, bits).cpu(), bits))
            meta["encoder_equals_reference"][f"{bits}b_{side}"] = ok_enc = check_encoder(sym, cb)
            if not ok_enc:
                raise SystemExit(f"torch encoder differs from encode_blocks ({bits}-bit {side})")
            enc = encode_torch(sym, cb)
            hist = symbol_histogram(sym, bits).cpu()
            # correctness first: the kernel decodes every stream bit-exactly (with its checks on)
            dec = huffman_decode(enc, cb, validate=True)
            if not torch.equal(dec, sym):
                raise SystemExit(f"huffman_decode is not bit-exact on the {bits}-bit {side} streams")
            del dec
            table = decode_table(cb, dev, step=choose_step(cb, D))
            best = None
            for c in dec_cfgs:
                fn = lambda c=c: decode_streams(enc.payload, enc.bit_offsets, enc.raw_fallback, table,  # noqa: E731
                                                n_symbols=D, validate=False, **c)
                try:
                    ms = _bench(fn, smoke)
                except Exception as err:  # noqa: BLE001 - record and go on
                    log(f"  decode {c} failed: {type(err).__name__}: {str(err)[:200]}")
                    ms = None
                meta["decode_sweep"].append({"bits": bits, "side": side, **c, "ms": ms,
                                             "first_call_s": FIRST_CALL_S[-1]})
                if ms is not None and (best is None or ms < best[0]):
                    best = (ms, c)
            out_bytes = sym.numel()
            row = {"kind": "decode", "model": MODEL, "batch": b, "context": ctx, "bits": bits, "side": side,
                   "decode_gbps": round(out_bytes / (best[0] * 1e-3) / 1e9, 1) if best else None,
                   "decode_ms": round(best[0], 5) if best else None, "decode_config": best[1] if best else dec_cfgs[0],
                   "payload_gbps": round(enc.payload.numel() * 4 / (best[0] * 1e-3) / 1e9, 1) if best else None,
                   "fused_ms": None, "fixed_ms": None, "bf16_ms": None,
                   "bits_per_symbol": round(encoded_bits_per_symbol(enc), 4),
                   "bits_per_symbol_with_offsets": round(encoded_bits_per_symbol(enc, include_overhead=True), 4),
                   "entropy_bits": round(entropy_bits(hist), 4),
                   "raw_stream_fraction": round(float(enc.raw_fallback.float().mean()), 5),
                   "table_bits": table.table_bits, "symbols_per_lookup": table.step, "gpu": gpu}
            rows.append(row)
            side_rows[side] = row
            blocks[side], books[side] = enc, cb
            log(f"  {bits}b {side}: H={row['entropy_bits']:.3f} coded {row['bits_per_symbol']:.3f} bits/symbol "
                f"(+offsets {row['bits_per_symbol_with_offsets']:.3f}), raw {row['raw_stream_fraction']:.4f}, "
                f"decode {row['decode_ms']} ms = {row['decode_gbps']} GB/s out")
            del sym
        # ---- fused vs fixed-width vs bf16 on the same quantized values
        common = dict(k_group=GROUP, v_group=GROUP, scaling=scale, fp_segments=[win], fp_positions=[n])
        fixed_fn = lambda: decode_attention(q, qk.codes, qk.scale, qk.zero, qv.codes, qv.scale, qv.zero,  # noqa: E731
                                            k_bits=bits, v_bits=bits, **common,
                                            config=DecodeConfig(block_n=16, fp_block=16) if smoke else None)
        fixed_out = fixed_fn()
        fixed = _bench(fixed_fn, smoke)
        best = None
        max_diff = 0.0
        for c in fused_cfgs:
            fn = lambda c=c: decode_attention_huffman(  # noqa: E731
                q, blocks["k"], qk.scale, qk.zero, blocks["v"], qv.scale, qv.zero, k_codebook=books["k"],
                v_codebook=books["v"], **common, config=c, validate=False)
            try:
                t_first = time.time()
                o = fn()
                max_diff = max(max_diff, float((o - fixed_out).abs().max()))
                ms = _bench(fn, smoke)
                FIRST_CALL_S[-1] = round(time.time() - t_first, 2)
            except Exception as err:  # noqa: BLE001 - record and go on
                log(f"  fused {c} failed: {type(err).__name__}: {str(err)[:300]}")
                ms = None
            cd = {f: getattr(c, f) for f in ("block_n", "num_warps", "num_stages", "programs_per_sm")}
            meta["fused_sweep"].append({"bits": bits, **cd, "ms": ms, "first_call_s": FIRST_CALL_S[-1]})
            log(f"  fused {cd}: {ms} ms (first call {FIRST_CALL_S[-1]} s)")
            if ms is not None and (best is None or ms < best[0]):
                best = (ms, cd)
        fused = best[0] if best else None
        bps = (side_rows["k"]["bits_per_symbol"] + side_rows["v"]["bits_per_symbol"]) / 2
        row = {"kind": "fused", "model": MODEL, "batch": b, "context": ctx, "bits": bits, "decode_gbps": None,
               "fused_ms": round(fused, 5) if fused else None, "fixed_ms": round(fixed, 5) if fixed else None,
               "bf16_ms": round(ms16, 5) if ms16 else None, "bits_per_symbol": round(bps, 4),
               "entropy_bits": round((side_rows["k"]["entropy_bits"] + side_rows["v"]["entropy_bits"]) / 2, 4),
               "fused_config": best[1] if best else None, "max_abs_diff_vs_fixed": max_diff,
               "fused_over_fixed": round(fused / fixed, 3) if fused and fixed else None,
               "fused_over_bf16": round(fused / ms16, 3) if fused and ms16 else None, "gpu": gpu}
        rows.append(row)
        log(f"  {bits}b fused {row['fused_ms']} ms, fixed {row['fixed_ms']} ms, bf16 {row['bf16_ms']} ms, "
            f"|fused - fixed| <= {max_diff:.3g} ({time.time() - t0:.0f} s)")
        _write_json(out / "huffman.json", rows)
        _write_json(out / "huffman_meta.json", meta)
        del qk, qv, ck, cv, blocks, books, fixed_out
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    meta["seconds"] = round(time.time() - t_start, 1)
    _write_json(out / "huffman.json", rows)
    _write_json(out / "huffman_meta.json", meta)
    write_markdown(out, rows, meta)
    log(f"done in {meta['seconds']} s -> {out}")


def _f(x, nd=3):
    return "-" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def write_markdown(out: Path, rows, meta) -> None:
    s = meta["shape"]
    lines = [
        "# Huffman-coded KV cache: Triton decoder and fused decode attention",
        "",
        f"GPU: **{meta['gpu']}**, torch {meta['torch']}, triton {meta['triton']}."
        + (" **Smoke run on the CPU interpreter: no timings.**" if meta["smoke"] else ""),
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Shape: {meta['model']} ({s['q_heads']} q heads / {s['kv_heads']} kv heads / head_dim {s['head_dim']}), "
        f"batch {s['batch']}, context {s['context']} (last {s['window']} tokens bf16 window), keys per channel "
        f"over {s['k_group']} tokens, values per token over {s['v_group']} channels. Data: {meta['data']}. "
        "One Huffman stream per token and side (block format v1). Times: median of `triton.testing.do_bench` "
        "(L2 flushed before each call).",
        "",
        "## Standalone decoder",
        "",
        "`decode GB/s` = decoded uint8 codes written / time; `payload GB/s` = coded bytes read / time. "
        "`bits/sym` = coded payload bits per symbol; `+offsets` adds format v1's int64 offset and flag per "
        "stream; `H` = order-0 entropy of the symbols.",
        "",
        "| bits | side | H | bits/sym | +offsets | raw streams | table bits | codes/lookup | ms | decode GB/s "
        "| payload GB/s |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r["kind"] == "decode":
            lines.append(f"| {r['bits']} | {r['side']} | {_f(r['entropy_bits'])} | {_f(r['bits_per_symbol'])} | "
                         f"{_f(r['bits_per_symbol_with_offsets'])} | {_f(r['raw_stream_fraction'], 4)} | "
                         f"{r['table_bits']} | {r['symbols_per_lookup']} | {_f(r['decode_ms'], 4)} | "
                         f"{_f(r['decode_gbps'], 1)} | "
                         f"{_f(r['payload_gbps'], 1)} |")
    lines += [
        "",
        "## Fused decode attention",
        "",
        "`fused`: Huffman decode inside the attention loop (`decode_attention_huffman`); `fixed`: the "
        "fixed-width packed kernel (`decode_attention`) on the same quantized values; `bf16`: fastest SDPA "
        f"form over the bf16 cache ({meta.get('bf16_baseline')}). `max diff` = max |fused - fixed| "
        "(same values: float rounding only). `unfused` = standalone decode of K and V + fixed-width kernel "
        "(sum of the measured times; it also needs the decoded codes repacked, not counted).",
        "",
        "| bits | bits/sym (K,V mean) | fused ms | unfused ms | fixed ms | bf16 ms | fused / fixed | fused / bf16 "
        "| max diff | config |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if r["kind"] == "fused":
            dec = [x["decode_ms"] for x in rows if x["kind"] == "decode" and x["bits"] == r["bits"]]
            unfused = sum(dec) + r["fixed_ms"] if r["fixed_ms"] and len(dec) == 2 and all(dec) else None
            lines.append(f"| {r['bits']} | {_f(r['bits_per_symbol'])} | {_f(r['fused_ms'], 4)} | {_f(unfused, 4)} | "
                         f"{_f(r['fixed_ms'], 4)} | "
                         f"{_f(r['bf16_ms'], 4)} | {_f(r['fused_over_fixed'], 2)} | {_f(r['fused_over_bf16'], 2)} | "
                         f"{r['max_abs_diff_vs_fixed']:.2g} | {r['fused_config']} |")
    (out / "huffman.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder for huffman.json / huffman_meta.json / huffman.md")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter, no timings")
    ap.add_argument("--quick", action="store_true", help="smaller config sweeps")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--bits", type=int, nargs="+", default=[2, 4], choices=[2, 4, 8])
    args = ap.parse_args(argv)
    if not args.smoke and args.context <= WINDOW:
        raise SystemExit(f"--context must exceed the {WINDOW}-token window")
    run(args)


if __name__ == "__main__":
    main()
