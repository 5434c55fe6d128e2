"""Huffman coding as a storage tier (issue 7): bytes and time of a coded cache snapshot, on CPU.

For each model: one forward over a held-out text (evaluation split of the embedded data) of
``--tokens`` tokens records every layer's K/V (bf16, as a deployment holds them;
:func:`benchmarks.huffman_bits.capture_kv`). For each recipe they are prefilled into a
CompressedCache exactly as a prefill step fills it (``update`` then ``flush`` per layer: the
prompt's own attention is full precision, so the cache content does not depend on it, and the
reference kvcalib attention over 2k prompt tokens would take most of the time budget on this
CPU). Then the cache is snapshotted with
:func:`kvcalib.runtime.coded_tier.encode_cache` in each stream layout, decode it back
(:func:`~kvcalib.runtime.coded_tier.decode_cache`, checked bit-exact: every packed part equal,
and the next token's logits through the model's kvcalib attention ``torch.equal`` on the original
and the restored cache), and save it once (:func:`~kvcalib.runtime.coded_tier.save_coded`) for
the file size. Encode and decode are timed on one thread (best of ``--repeats``): the codec is
single-threaded NumPy, and other jobs share this machine.

Codebooks: the recipes are the baseline exports of ``scripts/huffman_bits.sh`` (group 32, window
128, no sinks) with ``add_codebooks`` fitted on the reservoir of an existing collected run
(``--run MODEL=DIR``, default the newest ``artifacts/runs/*-MODEL-*`` holding ``stats.safetensors``;
a new collection when there is none), with the same stream layout as the snapshot, so a side gets
a codebook only when its calibration estimate says coding pays in that layout.

Transfer: coded wins over moving the packed bytes when ``encode + decode < saved bytes / link``;
``breakeven_gbps`` is the link speed below which it does (saved bytes / (encode + decode time)).

    python scripts/huffman_tier.py            # both embedded models, K2V2 and K4V2, ~2-3 minutes

Writes ``artifacts/bench/huffman_tier.json`` (one object per row) and ``huffman_tier.md``.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # benchmarks (and kvcalib) importable from a checkout

from kvcalib.methods.huffman import StreamLayout, add_codebooks  # noqa: E402
from kvcalib.errors import KvcalibError
from kvcalib.export import ExportConfig
from kvcalib.progress import ProgressBar, console, status
from kvcalib.recipe import Recipe
from kvcalib.runtime.cache import CompressedCache
from kvcalib.runtime.coded_tier import decode_cache, encode_cache, save_coded

MACHINE = "2-core CPU, no GPU"
LAYOUT_NAMES = {1: "1 token/stream (GPU decoder layout)"}


def find_stats(model: str, given: dict[str, str]) -> Path | None:
    """The collected run for ``model``: ``--run MODEL=DIR`` or the newest one in artifacts/runs."""
    if model in given:
        return Path(given[model])
    runs = sorted(Path("artifacts/runs").glob(f"*-{model}-*/stats.safetensors"), key=lambda p: p.parent.name[-15:])
    return runs[-1].parent if runs else None


def stats_for(model: str, given: dict[str, str], loaded):
    from kvcalib.stats import CollectedStats

    run = find_stats(model, given)
    if run is None:
        from kvcalib.api import collect

        run = Path(f"artifacts/runs/huffman-tier-{model}-{time.strftime('%Y%m%d-%H%M%S')}")
        with status(f"collecting statistics of {model} into {run}"):
            collect(out=run, loaded=loaded, samples=16, seq_len=512)
    return run, CollectedStats.load(run)


def prefill(model, recipe: Recipe, ks: list[torch.Tensor], vs: list[torch.Tensor]) -> CompressedCache:
    """A CompressedCache for ``recipe`` holding the prompt K/V ``ks``/``vs`` (per layer (B, H, T, D)),
    filled as a prefill fills it: ``update`` then, after the (full-precision) prompt attention,
    ``flush``. Also switches ``model`` to kvcalib attention (for the logits check)."""
    dtype = next(model.parameters()).dtype
    cache = CompressedCache.from_recipe(model, recipe)
    for i, layer in enumerate(cache.layers):
        layer.update(ks[i].to(dtype), vs[i].to(dtype))
        layer.flush()
    return cache


def same_parts(a: CompressedCache, b: CompressedCache) -> bool:
    """Every packed part, full-precision tensor and counter of two caches equal (bit for bit)."""
    for la, lb in zip(a.layers, b.layers):
        if (la.n_seen, la.pend_start, la.sinks_dropped) != (lb.n_seen, lb.pend_start, lb.sinks_dropped):
            return False
        for name in ("sink_k", "sink_v", "pend_k", "pend_v"):
            if not torch.equal(getattr(la, name), getattr(lb, name)):
                return False
        for sa, sb in zip(la.packed.stores, lb.packed.stores):
            if (sa.start, sa.n) != (sb.start, sb.n):
                return False
            for name, buf in sa.parts.items():
                x, y = buf.view(), sb.parts[name].view()
                if (x is None) != (y is None) or (x is not None and not torch.equal(x, y)):
                    return False
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-0.5b"])
    ap.add_argument("--bits", nargs="+", default=["k2v2", "k4v2"])
    ap.add_argument("--tokens", type=int, default=2048, help="held-out tokens prefilled")
    ap.add_argument("--tokens-per-stream", type=int, nargs="+", default=[1, 32],
                    help="stream layouts to snapshot with (1: the GPU decoder's; 32: one stream per chunk)")
    ap.add_argument("--link-gbps", type=float, default=50.0,
                    help="assumed host link, GB/s (PCIe 5.0 x16: ~63 GB/s raw, ~50 GB/s achieved)")
    ap.add_argument("--run", action="append", default=[], metavar="MODEL=DIR", help="collected run per model")
    ap.add_argument("--out", default="artifacts/bench/huffman_tier")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="encode/decode timings: best of this many")
    args = ap.parse_args(argv)
    given = dict(s.split("=", 1) for s in args.run)
    torch.manual_seed(args.seed)

    from kvcalib import __version__
    from kvcalib.data import pack_samples
    from benchmarks.huffman_bits import capture_kv
    from kvcalib.eval.harness import eval_texts
    from kvcalib.io import atomic_path, write_json_atomic
    from kvcalib.models import load_model

    command = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    t_start = time.perf_counter()
    rows = []
    n_steps = len(args.models) * len(args.bits) * len(args.tokens_per_stream)
    with ProgressBar(n_steps, "huffman tier", "snapshots") as bar:
        for model_name in args.models:
            bar.update(info=f"loading {model_name}")
            loaded = load_model(model_name, dtype="bf16", device="cpu")
            info = loaded.info
            run, stats = stats_for(model_name, given, loaded)
            ids = pack_samples(eval_texts("embedded"), loaded.tokenizer, args.tokens, 1, args.seed)  # (1, T)
            bar.update(info=f"{model_name}: K/V of {ids.shape[1]} held-out tokens")
            ks, vs = capture_kv(loaded.model, ids)  # per layer (1, H, T, D) float32 (exact bf16 values)
            for bits in args.bits:
                base_cfg = ExportConfig(bits=bits, group=32, window=128).layer
                recipe = Recipe(name=f"{bits}_baseline", layers=[base_cfg] * info.num_layers, model=info)
                bar.update(info=f"{model_name} {bits}: prefill {ids.shape[1]} tokens")
                cache = prefill(loaded.model, recipe, ks, vs)
                restored = None
                for tps in args.tokens_per_stream:
                    layout = StreamLayout(tps, max(32, tps))
                    bar.update(info=f"{model_name} {bits}: codebooks, {tps} token(s)/stream")
                    coded_recipe = add_codebooks(recipe, stats, layout=layout)
                    enc_s = dec_s = float("inf")
                    threads = torch.get_num_threads()
                    torch.set_num_threads(1)  # the codec is single-threaded; one thread avoids OMP waits
                    try:
                        for _ in range(args.repeats):  # best of: other jobs share this CPU
                            t0 = time.perf_counter()
                            coded = encode_cache(cache, coded_recipe, layout=layout)
                            t1 = time.perf_counter()
                            restored = decode_cache(coded, coded_recipe)
                            t2 = time.perf_counter()
                            enc_s, dec_s = min(enc_s, t1 - t0), min(dec_s, t2 - t1)
                    finally:
                        torch.set_num_threads(threads)
                    if not same_parts(cache, restored):
                        raise RuntimeError("kvcalib bug: the coded snapshot did not round-trip bit for bit")
                    with tempfile.TemporaryDirectory() as tmp:
                        file_bytes = save_coded(Path(tmp) / "snap.safetensors", coded).stat().st_size
                    s = coded.summary()
                    saved = s["bytes_packed"] - s["bytes_coded"]
                    link = args.link_gbps * 1e9  # bytes/s
                    rows.append({
                        "model": model_name, "recipe": recipe.name, "tokens": int(ids.shape[1]),
                        "layout": LAYOUT_NAMES.get(tps, f"{tps} tokens/stream"), "tokens_per_stream": tps,
                        "bytes_packed": s["bytes_packed"], "bytes_coded": s["bytes_coded"], "saved_pct": s["saved_pct"],
                        "code_bytes_packed": s["code_bytes_packed"], "code_bytes_coded": s["code_bytes_coded"],
                        "code_saved_pct": s["code_saved_pct"], "bits_per_symbol": s["bits_per_symbol"],
                        "raw_stream_fraction": s["raw_stream_fraction"], "coded_sides": s["coded_sides"],
                        "sides": 2 * info.num_layers, "effective_bits_packed": s["effective_bits_packed"],
                        "effective_bits_coded": s["effective_bits_coded"], "file_bytes": file_bytes,
                        "encode_ms": round(1e3 * enc_s, 1), "decode_ms": round(1e3 * dec_s, 1),
                        "encode_mb_s": round(s["bytes_packed"] / 1e6 / enc_s, 1),
                        "decode_mb_s": round(s["bytes_packed"] / 1e6 / dec_s, 1),
                        "link_gbps": args.link_gbps,
                        "transfer_ms_packed": round(1e3 * s["bytes_packed"] / link, 4),
                        "transfer_ms_coded": round(1e3 * s["bytes_coded"] / link, 4),
                        "breakeven_gbps": round(max(saved, 0) / (enc_s + dec_s) / 1e9, 6),
                        "coded_wins": bool(saved > 0 and enc_s + dec_s < saved / link),
                        "machine": MACHINE, "codec_threads": 1, "repeats": args.repeats,
                        "load_average": round(os.getloadavg()[0], 2), "statistics": str(run),
                        "kvcalib_version": __version__, "torch": torch.__version__, "python": platform.python_version(),
                        "command": command,
                    })
                    bar.advance(info=f"{model_name} {bits} tps={tps}: saved {s['saved_pct']:.2f}%")
                # attention over the restored cache gives the same next-token logits, bit for bit
                nxt = ids[:, -1:]
                with torch.no_grad():
                    a = loaded.model(input_ids=nxt, past_key_values=cache).logits
                    b = loaded.model(input_ids=nxt, past_key_values=restored).logits
                if not torch.equal(a, b):
                    raise RuntimeError("kvcalib bug: logits over the restored cache differ")
                for r in rows[-len(args.tokens_per_stream):]:
                    r["next_logits_equal"] = True
            del loaded
    wall = time.perf_counter() - t_start
    out = Path(args.out)
    write_json_atomic(out.with_suffix(".json"), rows)
    with atomic_path(out.with_suffix(".md")) as tmp:
        tmp.write_text(markdown(rows, command, wall, args.link_gbps))
    console().print(markdown(rows, command, wall, args.link_gbps))
    return 0


def rate(bytes_per_s: float) -> str:
    """``1.2 MB/s``-style rate."""
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bytes_per_s >= scale:
            return f"{bytes_per_s / scale:.3g} {unit}"
    return f"{bytes_per_s:.3g} B/s"


def markdown(rows: list[dict], command: str, wall: float, link_gbps: float) -> str:
    r0 = rows[0] if rows else {}
    loads = [r["load_average"] for r in rows] or [float("nan")]
    lines = [
        "# Huffman coding as a storage tier: coded cache snapshots (offload / transfer)",
        "",
        f"Machine: {MACHINE} (codec timed on {r0.get('codec_threads')} thread, load average "
        f"{min(loads)}-{max(loads)} "
        "from other jobs), "
        f"torch {r0.get('torch')}, kvcalib "
        f"{r0.get('kvcalib_version')}. Command: `{command}` ({wall:.0f} s in all).",
        "",
        f"Each model prefills {r0.get('tokens')} held-out tokens (evaluation split of the embedded data) into a "
        "bf16 CompressedCache (group 32, 128-token bf16 window, no sinks; the K/V of one forward, appended and "
        "flushed as a prefill does). `kvcalib.runtime.coded_tier.encode_cache` "
        "snapshots it: every code plane with a codebook is Huffman-coded in the cache stream layout, everything else "
        "(scales, zeros, the bf16 window, sides without a codebook) is carried as is. Bytes count every tensor of "
        "the snapshot (payload with word padding and guard words, chunk words, stream lengths, codebook lengths, "
        "scales, window) against the packed cache's own `nbytes()`; `file` adds the safetensors header. Codebooks: "
        "`add_codebooks` on the reservoir of the collected run, for the same stream layout (a side gets one only "
        "where the calibration estimate says coding pays). Encode/decode: wall time, best of `--repeats`, on this CPU "
        "(reference NumPy codec); decode includes rebuilding the cache. Every snapshot decoded bit-exact "
        "(all packed parts equal, next-token logits `torch.equal`).",
        "",
        f"Transfer at an assumed {link_gbps:g} GB/s host link (PCIe 5.0 x16, ~63 GB/s raw): coding pays when "
        "encode + decode < saved bytes / link. `break-even` is the link speed below which it pays.",
        "",
        "| model | recipe | layout | coded sides | bits/sym | packed MB | coded MB | saved | codes saved | file MB "
        "| encode ms | decode ms | link ms packed -> coded | break-even | coded wins? |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for r in rows:
        be_s = rate(r["breakeven_gbps"] * 1e9)
        lines.append(
            f"| {r['model']} | {r['recipe']} | {r['layout']} | {r['coded_sides']}/{r['sides']} | "
            f"{r['bits_per_symbol'] if r['bits_per_symbol'] is not None else '-'} | {r['bytes_packed'] / 1e6:.3f} | "
            f"{r['bytes_coded'] / 1e6:.3f} | {r['saved_pct']:.2f}% | {r['code_saved_pct']:.2f}% | "
            f"{r['file_bytes'] / 1e6:.3f} | {r['encode_ms']:.0f} | {r['decode_ms']:.0f} | "
            f"{r['transfer_ms_packed']:.3f} -> {r['transfer_ms_coded']:.3f} | {be_s} | "
            f"{'yes' if r['coded_wins'] else 'no'} |")
    lines += [
        "",
        "`codes saved`: the coded sides' code bytes alone (payload + index + codebooks against their packed codes). "
        "`bits/sym`: stream bits per symbol of the coded sides (no index, no padding).",
    ]
    if rows:
        saved = [r["saved_pct"] for r in rows]
        speed = [r["bytes_packed"] / (r["encode_ms"] + r["decode_ms"]) / 1e3 for r in rows]  # MB/s round trip
        be = [r["breakeven_gbps"] * 1e9 for r in rows]
        lines += [
            "",
            "## Where each mode wins",
            "",
            f"- Storage tier (this table): the snapshot is {min(saved):.1f}-{max(saved):.1f}% smaller than the packed "
            f"cache, everything counted. The reference codec round-trips {min(speed):.0f}-{max(speed):.0f} MB/s here, "
            f"so coding pays only on links slower than {rate(min(be))}-{rate(max(be))}; on the assumed "
            f"{link_gbps:g} GB/s link the packed cache moves in {min(r['transfer_ms_packed'] for r in rows):.2f}-"
            f"{max(r['transfer_ms_packed'] for r in rows):.2f} ms and coding never pays; with this codec it loses "
            "even on a 1 Gb/s network (125 MB/s). In general a codec of round-trip throughput C pays only below a "
            "link of C x saved fraction: at a ~4% saving it must run 25x faster than the link, so a native ~1 GB/s "
            "Huffman coder would break even near 40 MB/s (slow disks, WAN, object storage, where the bytes saved "
            "are what is billed or waited for) and never on PCIe.",
            "- Attention (artifacts/bench/huffman.md, H200, Mistral-7B shape, 32k): decode fused into attention is "
            "3.8x (2-bit) / 6.1x (4-bit) slower than the fixed-width kernel and 3.0x / 4.8x slower than bf16 SDPA, "
            "so attention reads the fixed-width packed codes; Huffman codes are a storage/transfer format only.",
            "- Stream layout: one token per stream is what the GPU decoder reads; one stream per 32-token chunk "
            "drops most of the per-stream length fields and saves more, at the price of serial decoding per chunk "
            "(the slower decode above).",
        ]
    lines.append("")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        sys.exit(main())
    except KvcalibError as err:
        console().print(f"[red]error:[/red] {err}")
        sys.exit(2)
