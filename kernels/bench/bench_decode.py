"""Benchmark: fused packed-KV decode attention vs bf16 SDPA, quantize-and-pack vs prefill, end to end.

Protocol (shared/DESIGN.md, "GPU benchmark protocol"): shapes of Mistral-7B (32 q / 8 kv heads,
head_dim 128), Qwen2.5-1.5B (12/2/128), SmolLM2-135M (9/3/64); batch 1/8/32; context
4k/16k/32k/128k; median time of ``triton.testing.do_bench`` (which flushes L2 before every call);
bytes actually read / time; that over the measured device-to-device copy bandwidth (bytes read +
written); speedup over the fastest bf16 baseline we could build (several SDPA forms, the
explicit-matmul form, and flash-attn's kvcache kernel if importable), and the byte ratio.

One attention layer per row: the cache holds ``context`` tokens, the last ``WINDOW`` (128) in
bf16 (the pending window, merged by the kernel's full-precision path) and the rest packed,
K per channel over groups of ``group`` tokens, V per token over groups of ``min(group, D)``
channels. Codes and scales are random (speed does not depend on the values; never zeros).

Modes (``--mode``):

- ``micro`` (default): device info, copy bandwidth, a config sweep on the Mistral 32k shapes
  (the best config per bit width is then used for the whole grid), the grid, quantize-and-pack
  vs prefill attention. Writes ``decode_attention.json`` (one object per row) and
  ``decode_bench_meta.json`` (device, sweep, quantize-vs-prefill, bf16 variants).
- ``e2e``: a random-weight Mistral-7B-shaped model (bf16, no download) decoding at 32k context:
  HF ``DynamicCache`` vs ``CompressedCache`` with a 2-bit recipe, tokens/s and peak memory, the
  largest batch estimated from the measured per-sequence bytes. The caches are *filled
  directly* (random bf16 K/V; packed storage quantized by ``kvcalib_kernels.quant_pack``) instead
  of a 32k prefill. Writes ``e2e.json``.
- ``splits`` / ``tune``: CUDA-graph time of config grids on the Mistral shape at batch 1 and 8
  (split-K parallelism; tile shape, unpack and register cap) with bf16 SDPA's graph time.
  Write ``decode_splits.json`` / ``decode_tune.json``.
- ``sweep``: any DecodeConfig grid (``--configs``) on any shapes and layouts (``--shapes``,
  ``--layouts``), CUDA-graph time. Writes ``decode_sweep_<--name>.json``.
- ``fitted``: what SKVQ permutations, TaDA means (8/16-bit) and OTT pools cost the kernel (CUDA-graph time,
  Mistral shape, batch 1/8). Writes ``decode_fitted.json``.
- ``groups``: what key groups / value groups of 32 cost the kernel (value groups narrower than a
  plane: one accumulator per group vs per-element dequantization), CUDA-graph time, Mistral
  shape. Writes ``decode_groups.json``.
- ``combine``: the split merge alone (``_combine``: what the launcher picks, beside 27 choices of
  partials per step, channels per program and warps) at the (rows, partials, head_dim) the grid's
  shapes produce, CUDA-graph time with the partials in L2 (as after the split kernel). Writes
  ``combine_sweep.json``.
- ``report``: from the JSON files, write ``decode_attention.md``, ``e2e.md`` and the plot
  ``decode_attention.png`` (runs anywhere; matplotlib).

Run on the GPU through ``scripts/gpu_bench.sh``; e.g.
``python kernels/bench/bench_decode.py --mode micro --out artifacts/bench``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

MODELS = {  # name: (query heads, kv heads, head_dim)
    "mistral-7b": (32, 8, 128),
    "qwen2.5-1.5b": (12, 2, 128),
    "smollm2-135m": (9, 3, 64),
}
BATCHES = (1, 8, 32)
CONTEXTS = (4096, 16384, 32768, 131072)
SETTINGS = ((2, 128), (4, 128), (4, 32))  # (bits for K and V, group)
WINDOW = 128


def log(*a) -> None:
    print(*a, flush=True)


def _bench(fn, warmup: int = 25, rep: int = 100) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def _replay(fn):
    """``fn`` (one call: the kernel's split + combine launches, or a bf16 SDPA) captured in a
    CUDA graph; returns a callable replaying it. ``do_bench`` of the replay is the call's GPU time
    with L2 flushed before it: an eager call also pays its host time wherever that exceeds the
    flush, which for kvcalib's ~0.1-0.25 ms of Python and launches is most small rows (the
    ``*_eager`` columns keep that number)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph.replay  # (the bound method keeps the graph alive)


def _write_json(path: Path, obj) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    tmp.replace(path)


# ---------------------------------------------------------------- inputs and byte counts


def packed_inputs(b, h, n, d, bits, k_group, v_group, dev, seed=0):
    """Random packed K/V: codes uint8, scales/zeros float16 (shapes of decode_attention)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    p = d * bits // 8
    kc = torch.randint(0, 256, (b, h, n, p), dtype=torch.uint8, device=dev, generator=g)
    vc = torch.randint(0, 256, (b, h, n, p), dtype=torch.uint8, device=dev, generator=g)
    ks = (torch.rand(b, h, n // k_group, d, device=dev, generator=g) * 0.05 + 0.01).half()
    kz = (torch.randn(b, h, n // k_group, d, device=dev, generator=g) * 0.5).half()
    vs = (torch.rand(b, h, n, d // v_group, device=dev, generator=g) * 0.05 + 0.01).half()
    vz = (torch.randn(b, h, n, d // v_group, device=dev, generator=g) * 0.5).half()
    return kc, ks, kz, vc, vs, vz


def packed_bytes(b, h, hq, n, f, d, bits, k_group, v_group) -> dict:
    """Bytes the kernel must read: codes + scales/zeros + the bf16 window + q."""
    out = {
        "codes": 2 * b * h * n * d * bits // 8,
        "scales": b * h * (n // k_group) * d * 2 * 2 + b * h * n * (d // v_group) * 2 * 2,
        "fp_segment": 2 * b * h * f * d * 2,
        "q": b * hq * d * 2,
    }
    out["total"] = sum(out.values())
    return out


def bf16_bytes(b, h, hq, t, d) -> int:
    return 2 * b * h * t * d * 2 + b * hq * d * 2


# ---------------------------------------------------------------- bf16 baselines


def bf16_variants(q4, k, v, scale):
    """name -> callable, every honest bf16 decode-attention form we can build here.

    q4 (B, Hq, 1, D); k, v (B, H, T, D) bf16.
    """
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, hq, _, d = q4.shape
    h = k.shape[1]
    r = hq // h
    qg = q4.reshape(b, h, r, d)  # the R query heads of a kv head as R query rows: K/V read once
    out = {"sdpa_enable_gqa": lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=True, scale=scale)}
    out["sdpa_grouped_rows"] = lambda: F.scaled_dot_product_attention(qg, k, v, scale=scale)
    for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                     ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        def f(be=be):
            with sdpa_kernel([be]):
                return F.scaled_dot_product_attention(qg, k, v, scale=scale)
        out[f"sdpa_grouped_rows_{name}"] = f

    def matmul():
        s = torch.matmul(qg, k.transpose(-1, -2)) * scale  # (B, H, R, T)
        return torch.matmul(torch.softmax(s.float(), dim=-1).to(v.dtype), v)
    out["matmul_grouped_rows"] = matmul
    try:
        from flash_attn import flash_attn_with_kvcache  # noqa: F401
        kt, vt = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()  # (B, T, H, D)
        qt = q4.transpose(1, 2).contiguous()  # (B, 1, Hq, D)
        out["flash_attn_kvcache"] = lambda: flash_attn_with_kvcache(qt, kt, vt, softmax_scale=scale)
    except Exception:  # noqa: BLE001 - flash-attn is optional
        pass
    return out


def time_bf16(q4, k, v, scale, warmup=25, rep=100, replay=False) -> dict:
    """name -> median ``do_bench`` ms of each bf16 variant (``replay``: of its CUDA-graph replay,
    see :func:`_replay`; a variant that cannot be captured is timed eagerly); None = refused."""
    res = {}
    for name, fn in bf16_variants(q4, k, v, scale).items():
        try:
            fn()
            torch.cuda.synchronize()
        except Exception as err:  # noqa: BLE001 - a backend that refuses the shape is skipped
            res[name] = None
            log(f"    bf16 {name}: skipped ({type(err).__name__}: {str(err)[:80]})")
            continue
        if replay:
            try:
                fn = _replay(fn)
            except Exception as err:  # noqa: BLE001 - not capturable: its eager time is what it costs
                torch.cuda.synchronize()
                log(f"    bf16 {name}: not capturable, timed eagerly ({type(err).__name__}: {str(err)[:80]})")
        res[name] = _bench(fn, warmup, rep)
    return res


# ---------------------------------------------------------------- the kernel


def kernel_call(q, packed, window, bits, k_group, v_group, n, scale, config):
    from kvcalib_kernels.decode_attention import decode_attention

    return lambda: decode_attention(q, *packed, k_bits=bits, v_bits=bits, k_group=k_group, v_group=v_group,
                                    scaling=scale, fp_segments=[window], fp_positions=[n], config=config)


def sweep_configs():
    """Warps x block size x pipelining stages x split parallelism with the word unpack (inline
    PTX, falling back to Triton ops where the probe fails), plus the byte unpacks at the default."""
    from kvcalib_kernels.decode_attention import DecodeConfig

    cfgs = [DecodeConfig(block_n=bn, num_warps=1, num_stages=st, unpack=u, programs_per_sm=pps)
            for u in (3, 2) for bn in (32, 64) for st in (1, 2) for pps in (8.0, 16.0, 32.0)]
    cfgs += [DecodeConfig(unpack=1), DecodeConfig(unpack=4), DecodeConfig(num_warps=2),
             DecodeConfig(min_split_blocks=2), DecodeConfig(min_split_blocks=8)]
    return cfgs


def cfg_dict(c) -> dict:
    return {k: getattr(c, k) for k in ("block_n", "num_warps", "num_stages", "unpack", "programs_per_sm", "whole_waves",
                                       "num_splits", "fp_block", "min_split_blocks", "min_splits", "min_rows", "maxnreg",
                                       "value_chunks", "key_group_pairs", "pdl", "value_units", "key_group_halves",
                                       "value_sum_products", "early_value_scales", "early_key_scales", "deep_pipeline_blocks",
                                       "value_products_t", "whole_blocks")
            if hasattr(c, k)}  # (fields of older checkouts' configs only)


def run_sweep(dev, meta, quick=False) -> dict:
    """Time every sweep config on the Mistral 32k shapes (batch 1 and 8); best config per bits."""
    from kvcalib_kernels.decode_attention import DecodeConfig

    hq, h, d = MODELS["mistral-7b"]
    ctx = 32768
    n = ctx - WINDOW
    best = {}
    meta["sweep"] = []
    cfgs = sweep_configs()
    if quick:
        cfgs = cfgs[:4] + cfgs[-1:]
    for bits in (2, 4):
        totals = {}
        for b in (1, 8):
            packed = packed_inputs(b, h, n, d, bits, 128, 128, dev, seed=b)
            window = (torch.randn(b, h, WINDOW, d, device=dev, dtype=torch.bfloat16),
                      torch.randn(b, h, WINDOW, d, device=dev, dtype=torch.bfloat16))
            q = torch.randn(b, hq, d, device=dev, dtype=torch.bfloat16)
            times = {}
            for c in cfgs:
                try:
                    fn = kernel_call(q, packed, window, bits, 128, 128, n, d ** -0.5, c)
                    fn()
                    torch.cuda.synchronize()
                    times[c] = _bench(fn, 10, 50)
                except Exception as err:  # noqa: BLE001 - record and go on
                    times[c] = None
                    log(f"  sweep {cfg_dict(c)} failed: {type(err).__name__}: {str(err)[:200]}")
            ok = [t for t in times.values() if t]
            fastest = min(ok) if ok else float("nan")
            for c, t in times.items():
                meta["sweep"].append({"bits": bits, "batch": b, "context": ctx, **cfg_dict(c), "ms": t})
                if t:
                    totals[c] = totals.get(c, 0.0) + t / fastest
                else:
                    totals[c] = totals.get(c, 0.0) + 1e9
            log(f"  sweep bits={bits} b={b}: fastest {fastest:.4f} ms")
            del packed, window, q
            torch.cuda.empty_cache()
        choice = min(totals, key=totals.get) if totals else DecodeConfig()
        best[bits] = choice
        log(f"  best config for {bits}-bit: {cfg_dict(choice)} (sum of time / fastest = {totals.get(choice, 0):.3f})")
    meta["chosen_config"] = {str(k): cfg_dict(v) for k, v in best.items()}
    return best


def run_grid(dev, meta, best, copy_bw, gpu, out_dir: Path, quick=False):
    rows = []
    meta["bf16_variants"] = []
    models = list(MODELS.items())
    batches, contexts, settings = BATCHES, CONTEXTS, SETTINGS
    if quick:
        models, batches, contexts = models[:1], (1, 8), (4096, 32768)
    for model, (hq, h, d) in models:
        for b in batches:
            for ctx in contexts:
                n = ctx - WINDOW
                scale = d ** -0.5
                try:
                    k = torch.randn(b, h, ctx, d, device=dev, dtype=torch.bfloat16)
                    v = torch.randn(b, h, ctx, d, device=dev, dtype=torch.bfloat16)
                    q4 = torch.randn(b, hq, 1, d, device=dev, dtype=torch.bfloat16)
                except torch.cuda.OutOfMemoryError:
                    log(f"  {model} b={b} ctx={ctx}: bf16 K/V do not fit, skipped")
                    torch.cuda.empty_cache()
                    continue
                # the protocol's median do_bench (L2 flushed before each call) of each side's GPU
                # time (a CUDA-graph replay of one call); the eager calls' do_bench beside it
                variants = time_bf16(q4, k, v, scale, replay=True)
                ok = {kk: vv for kk, vv in variants.items() if vv}
                base_name = min(ok, key=ok.get)
                ms_bf16 = ok[base_name]
                ms_bf16_eager = _bench(bf16_variants(q4, k, v, scale)[base_name])
                meta["bf16_variants"].append({"model": model, "batch": b, "context": ctx, **variants})
                # GPU time of the same call (CUDA-graph replay, no host time): do_bench above is
                # host-bound wherever the kernel takes less than the ~0.1-0.2 ms a call costs the host.
                # Replayed over rotating input sets (>= 256 MB in all, as the latency and sweep tables
                # do): in a decode step the other layers' weights and caches pass through L2 between
                # two calls of a layer, so a small cache is not L2-resident for either side
                bb = bf16_bytes(b, h, hq, ctx, d)
                bf16_sets = [(q4, k, v)] + [
                    (torch.randn_like(q4), torch.randn_like(k), torch.randn_like(v)) for _ in range(_input_sets(bb) - 1)]
                ms_bf16_graph = graph_ms_per_call([bf16_variants(qi, ki, vi, scale)[base_name]
                                                   for qi, ki, vi in bf16_sets], 100)
                window = (k[:, :, n:].contiguous(), v[:, :, n:].contiguous())
                q = q4.reshape(b, hq, d)
                n_bf16_sets = len(bf16_sets)
                del k, v, bf16_sets
                torch.cuda.empty_cache()
                for bits, group in settings:
                    vg = min(group, d)
                    try:
                        packed = packed_inputs(b, h, n, d, bits, group, vg, dev, seed=ctx + b)
                        cfg = best.get(bits)
                        fn = kernel_call(q, packed, window, bits, group, vg, n, scale, cfg)
                        fn()
                        torch.cuda.synchronize()
                        ms_eager = _bench(fn)
                        ms = _bench(_replay(fn))
                        nb = packed_bytes(b, h, hq, n, WINDOW, d, bits, group, vg)
                        fns = [fn] + [kernel_call(torch.randn_like(q), packed_inputs(b, h, n, d, bits, group, vg, dev,
                                                                                     seed=ctx + b + 1000 * i),
                                                  (torch.randn_like(window[0]), torch.randn_like(window[1])),
                                                  bits, group, vg, n, scale, cfg)
                               for i in range(1, _input_sets(nb["total"]))]
                        ms_graph = graph_ms_per_call(fns, 100)
                        n_sets = len(fns)
                        del fns
                    except torch.cuda.OutOfMemoryError:
                        log(f"  {model} b={b} ctx={ctx} {bits}b/g{group}: out of memory, skipped")
                        torch.cuda.empty_cache()
                        continue
                    gbps = nb["total"] / (ms * 1e-3) / 1e9
                    row = {"model": model, "batch": b, "context": ctx, "bits": bits, "group": group,
                           "v_group": vg, "ms": round(ms, 5), "ms_bf16": round(ms_bf16, 5),
                           "speedup": round(ms_bf16 / ms, 3), "gbps": round(gbps, 1),
                           "frac_copy_bw": round(gbps / copy_bw, 3), "byte_ratio": round(bb / nb["total"], 3),
                           "bytes": nb["total"], "bytes_bf16": bb, "bf16_baseline": base_name,
                           "gbps_bf16": round(bb / (ms_bf16 * 1e-3) / 1e9, 1), "gpu": gpu,
                           "ms_eager": round(ms_eager, 5), "ms_bf16_eager": round(ms_bf16_eager, 5),
                           "speedup_eager": round(ms_bf16_eager / ms_eager, 3),
                           "ms_graph": round(ms_graph, 5), "ms_bf16_graph": round(ms_bf16_graph, 5),
                           "speedup_graph": round(ms_bf16_graph / ms_graph, 3),
                           "gbps_graph": round(nb["total"] / (ms_graph * 1e-3) / 1e9, 1),
                           "input_sets_graph": n_sets, "input_sets_bf16_graph": n_bf16_sets,
                           "config": cfg_dict(cfg) if cfg else None}
                    rows.append(row)
                    log(f"  {model:13s} b={b:2d} ctx={ctx:6d} {bits}b g{group:3d}: {ms:.4f} ms vs bf16 {ms_bf16:.4f} ms "
                        f"({base_name}) speedup {row['speedup']:.2f}x bytes {row['byte_ratio']:.2f}x "
                        f"{gbps:.0f} GB/s ({row['frac_copy_bw']:.2f} of copy); graph {ms_graph:.4f} ms vs bf16 "
                        f"{ms_bf16_graph:.4f} ms ({row['speedup_graph']:.2f}x)")
                    del packed
                    torch.cuda.empty_cache()
                _write_json(out_dir / "decode_attention.json", rows)
                del window, q, q4
                torch.cuda.empty_cache()
    return rows


def run_quant_vs_prefill(dev, meta):
    """Quantize-and-pack of a 32k prompt (one Mistral layer) vs that layer's prefill attention."""
    import torch.nn.functional as F

    from kvcalib.quant.uniform import quantize_keys, quantize_values
    from kvcalib_kernels.quant_pack import quantize_pack_keys, quantize_pack_values

    hq, h, d = MODELS["mistral-7b"]
    t = 32768
    k = torch.randn(1, h, t, d, device=dev, dtype=torch.bfloat16) * 2
    v = torch.randn(1, h, t, d, device=dev, dtype=torch.bfloat16)
    q = torch.randn(1, hq, t, d, device=dev, dtype=torch.bfloat16)
    res = {"model": "mistral-7b", "context": t, "batch": 1}
    res["prefill_attention_ms"] = _bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    for bits in (2, 4):
        kern = lambda: (quantize_pack_keys(k, bits, 128, validate=False), quantize_pack_values(v, bits, 128, validate=False))  # noqa: E731
        ref = lambda: (quantize_keys(k, bits, 128), quantize_values(v, bits, 128))  # noqa: E731
        a = kern()
        r = (quantize_keys(k.cpu(), bits, 128), quantize_values(v.cpu(), bits, 128))  # the specification, on CPU
        exact = all(torch.equal(getattr(x, f).cpu(), getattr(y, f)) for x, y in zip(a, r) for f in ("codes", "scale", "zero"))
        rg = ref()
        res[f"quant_pack_{bits}b_torch_cuda_reference_equal_to_cpu"] = all(
            torch.equal(getattr(x, f).cpu(), getattr(y, f)) for x, y in zip(rg, r) for f in ("codes", "scale", "zero"))
        res[f"quant_pack_{bits}b_ms"] = _bench(kern)
        res[f"quant_pack_{bits}b_torch_reference_ms"] = _bench(ref)
        res[f"quant_pack_{bits}b_bit_exact"] = exact
        res[f"quant_pack_{bits}b_frac_of_prefill"] = res[f"quant_pack_{bits}b_ms"] / res["prefill_attention_ms"]
        log(f"  quantize+pack {bits}b 32k: {res[f'quant_pack_{bits}b_ms']:.4f} ms (torch reference "
            f"{res[f'quant_pack_{bits}b_torch_reference_ms']:.3f} ms), prefill attention "
            f"{res['prefill_attention_ms']:.3f} ms -> {100 * res[f'quant_pack_{bits}b_frac_of_prefill']:.2f}%, bit-exact {exact}")
    meta["quant_vs_prefill"] = res


def copy_bandwidth(dev) -> float:
    n = 2 << 30
    x = torch.randint(0, 255, (n,), dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    ms = _bench(lambda: y.copy_(x))
    del x, y
    torch.cuda.empty_cache()
    return 2 * n / (ms * 1e-3) / 1e9


def device_info() -> dict:
    import triton

    p = torch.cuda.get_device_properties(0)
    return {"gpu": p.name, "sms": p.multi_processor_count, "memory_gib": round(p.total_memory / 2 ** 30, 1),
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda}


def main_micro(args) -> None:
    from kvcalib_kernels.decode_attention import DecodeConfig, fast_unpack_available

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    meta = {"device": device_info(), "command": " ".join([os.path.basename(sys.executable), *sys.argv])}
    import kvcalib_kernels.decode_attention as _da
    meta["fast_unpack_available"] = {k: fast_unpack_available(0, k) for k in ("bytes", "words", "lanes")}
    meta["fast_unpack_error"] = dict(_da.FAST_UNPACK_ERROR)
    log("device:", meta["device"], "fast unpack:", meta["fast_unpack_available"], meta["fast_unpack_error"] or "")
    meta["copy_bw_gbps"] = copy_bandwidth(dev)
    log(f"device-to-device copy: {meta['copy_bw_gbps']:.0f} GB/s (read + write)")
    _write_json(out / "decode_bench_meta.json", meta)
    if args.config:
        best = {int(k): DecodeConfig(**v) for k, v in json.loads(args.config).items()}
        meta["chosen_config"] = {str(k): cfg_dict(v) for k, v in best.items()}
    elif args.no_sweep:
        best = {2: DecodeConfig(), 4: DecodeConfig()}
        meta["default_config"] = cfg_dict(DecodeConfig())
    else:
        t0 = time.time()
        best = run_sweep(dev, meta, quick=args.quick)
        log(f"sweep took {time.time() - t0:.0f} s")
    _write_json(out / "decode_bench_meta.json", meta)
    t0 = time.time()
    run_quant_vs_prefill(dev, meta)
    _write_json(out / "decode_bench_meta.json", meta)
    rows = run_grid(dev, meta, best, meta["copy_bw_gbps"], meta["device"]["gpu"], out, quick=args.quick)
    log(f"grid took {time.time() - t0:.0f} s")
    meta["lanes_refused"] = {str(k[:7]): why for k, why in _da.LANES_REFUSED.items()}  # layouts run without unpack 5
    _write_json(out / "decode_bench_meta.json", meta)
    log("\nmodel          batch context bits grp      ms  ms_bf16 speedup bytes_x  GB/s frac")
    for r in rows:
        if r["model"] == "mistral-7b" or r["context"] == 32768:
            log(f"{r['model']:14s} {r['batch']:5d} {r['context']:7d} {r['bits']:4d} {r['group']:3d} {r['ms']:7.4f} "
                f"{r['ms_bf16']:8.4f} {r['speedup']:7.2f} {r['byte_ratio']:7.2f} {r['gbps']:5.0f} {r['frac_copy_bw']:.2f}")


# ---------------------------------------------------------------- latency: GPU time vs host time


def host_us(fn, calls: int = 200) -> float:
    """Host microseconds per call of ``fn``, calls issued back to back (no sync inside: the
    GPU may lag behind; the rate an eager caller can issue them)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return 1e6 * (t1 - t0) / calls


def main_latency(args) -> None:
    """Small shapes are launch-bound: separate the GPU time (CUDA-graph replay over rotating input
    sets, so neither the host nor L2 residency flatters it) from the host time per call."""
    from kvcalib_kernels.decode_attention import DecodeConfig

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    cfg = DecodeConfig(**json.loads(args.config)["2"]) if args.config else DecodeConfig()
    rows = []

    def graph_ms(fns):
        return graph_ms_per_call(fns, rep=50)

    for model, (hq, h, d) in MODELS.items():
        for b in (1, 8):
            for ctx in (4096, 16384, 32768):
                n = ctx - WINDOW
                scale = d ** -0.5
                vg = min(128, d)
                nb = packed_bytes(b, h, hq, n, WINDOW, d, 2, 128, vg)["total"]
                bb = bf16_bytes(b, h, hq, ctx, d)
                sets = _input_sets(nb)
                ours = []
                for i in range(sets):
                    packed = packed_inputs(b, h, n, d, 2, 128, vg, dev, seed=i)
                    window = (torch.randn(b, h, WINDOW, d, device=dev, dtype=torch.bfloat16),
                              torch.randn(b, h, WINDOW, d, device=dev, dtype=torch.bfloat16))
                    q = torch.randn(b, hq, d, device=dev, dtype=torch.bfloat16)
                    ours.append(kernel_call(q, packed, window, 2, 128, vg, n, scale, cfg))
                r = {"model": model, "batch": b, "context": ctx, "bits": 2, "group": 128,
                     "ms_do_bench": _bench(ours[0]), "ms_graph": graph_ms(ours), "host_us": host_us(ours[0]),
                     "input_sets": sets}
                del ours
                torch.cuda.empty_cache()
                bsets = _input_sets(bb)
                kvs = [(torch.randn(b, hq, 1, d, device=dev, dtype=torch.bfloat16),
                        torch.randn(b, h, ctx, d, device=dev, dtype=torch.bfloat16),
                        torch.randn(b, h, ctx, d, device=dev, dtype=torch.bfloat16)) for _ in range(bsets)]
                for name in ("sdpa_enable_gqa", "sdpa_grouped_rows_flash"):
                    fns = [bf16_variants(q4, k, v, scale)[name] for q4, k, v in kvs]
                    try:
                        r[f"bf16_{name}_ms_do_bench"] = _bench(fns[0])
                        r[f"bf16_{name}_ms_graph"] = graph_ms(fns)
                        r[f"bf16_{name}_host_us"] = host_us(fns[0])
                    except Exception as err:  # noqa: BLE001
                        log(f"  {name}: {type(err).__name__}: {str(err)[:120]}")
                del kvs
                torch.cuda.empty_cache()
                g = [r.get(f"bf16_{nm}_ms_graph") for nm in ("sdpa_enable_gqa", "sdpa_grouped_rows_flash")]
                g = [x for x in g if x]
                r["bf16_best_ms_graph"] = min(g) if g else None
                r["speedup_graph"] = r["bf16_best_ms_graph"] / r["ms_graph"] if g else None
                rows.append(r)
                _write_json(out / "decode_latency.json", {"config": cfg_dict(cfg), "rows": rows})
                log(f"  {model:13s} b={b} ctx={ctx:6d}: ours do_bench {r['ms_do_bench']:.4f} ms, graph {r['ms_graph']:.4f} ms, "
                    f"host {r['host_us']:.0f} us | bf16 graph {r['bf16_best_ms_graph'] or float('nan'):.4f} ms "
                    f"-> speedup (graph) {r['speedup_graph'] or float('nan'):.2f}")


def _input_sets(set_bytes: int) -> int:
    """How many input sets of ``set_bytes`` a CUDA-graph timing rotates over: enough for >= 256 MB
    in all (more than any L2), at most 32."""
    return max(1, min(32, math.ceil(256e6 / set_bytes)))


def graph_ms_per_call(fns, rep: int) -> float:
    """Median CUDA-graph replay time of calling every function of ``fns`` once (rotating input
    sets, so L2 cannot hold them), divided by their number: GPU time of one call, no host time."""
    import triton.testing

    def all_sets():
        for f in fns:
            f()
    all_sets()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench_cudagraph(all_sets, rep=rep, return_mode="median")) / len(fns)


def graph_sweep(out_file: Path, shapes, configs_for_bits, default_for_bits, model: str = "mistral-7b",
                layouts=((2, 128, 128), (4, 128, 128))) -> list[dict]:
    """CUDA-graph time of the kernel for each config of ``configs_for_bits(bits)`` at each
    (bits, key group, value group) of ``layouts`` on ``model``'s shape at each (batch, context) of
    ``shapes``, with the bf16 SDPA graph time of the same shape; rows written to ``out_file`` as
    they come."""
    dev = torch.device("cuda")
    hq, h, d = MODELS[model]
    scale = d ** -0.5

    def graph_ms(fns):
        return graph_ms_per_call(fns, rep=30)

    rows = []
    for b, ctx in shapes:
        n = ctx - WINDOW
        bb = bf16_bytes(b, h, hq, ctx, d)
        bsets = _input_sets(bb)
        kvs = [(torch.randn(b, hq, 1, d, device=dev, dtype=torch.bfloat16),
                torch.randn(b, h, ctx, d, device=dev, dtype=torch.bfloat16),
                torch.randn(b, h, ctx, d, device=dev, dtype=torch.bfloat16)) for _ in range(bsets)]
        bf = {}
        for name in ("sdpa_enable_gqa", "sdpa_grouped_rows_flash"):
            try:
                bf[name] = graph_ms([bf16_variants(q4, k, v, scale)[name] for q4, k, v in kvs])
            except Exception as err:  # noqa: BLE001
                log(f"  {name}: {type(err).__name__}: {str(err)[:120]}")
        del kvs
        torch.cuda.empty_cache()
        bf16_ms = min(bf.values()) if bf else float("nan")
        for bits, kg, vg in layouts:
            nb = packed_bytes(b, h, hq, n, WINDOW, d, bits, kg, vg)["total"]
            sets = _input_sets(nb)
            inputs = []
            for i in range(sets):
                inputs.append((torch.randn(b, hq, d, device=dev, dtype=torch.bfloat16),
                               packed_inputs(b, h, n, d, bits, kg, vg, dev, seed=i),
                               (torch.randn(b, h, WINDOW, d, device=dev, dtype=torch.bfloat16),
                                torch.randn(b, h, WINDOW, d, device=dev, dtype=torch.bfloat16))))
            best = None
            default = default_for_bits(bits)
            for cfg in configs_for_bits(bits):
                try:
                    ms = graph_ms([kernel_call(q, pk, w, bits, kg, vg, n, scale, cfg) for q, pk, w in inputs])
                except Exception as err:  # noqa: BLE001
                    log(f"  config {cfg_dict(cfg)} failed: {type(err).__name__}: {str(err)[:160]}")
                    continue
                rows.append({"model": model, "batch": b, "context": ctx, "bits": bits, "k_group": kg, "v_group": vg,
                             **cfg_dict(cfg),
                             "ms_graph": ms, "bf16_ms_graph": bf16_ms, "speedup": bf16_ms / ms,
                             "bytes": nb, "bf16_bytes": bb, "default": cfg == default})
                if best is None or ms < best[0]:
                    best = (ms, cfg_dict(cfg))
            dms = [r["ms_graph"] for r in rows if r["default"] and r["batch"] == b and r["context"] == ctx
                   and (r["bits"], r["k_group"], r["v_group"]) == (bits, kg, vg)]
            log(f"  b={b} ctx={ctx:6d} bits={bits} groups {kg}/{vg}: bf16 {bf16_ms:.4f} ms | default {dms[0] if dms else float('nan'):.4f} ms"
                f" | best {best[0] if best else float('nan'):.4f} ms {best[1] if best else ''}")
            del inputs
            torch.cuda.empty_cache()
            _write_json(out_file, {"rows": rows})
    return rows


def main_splits(args) -> None:
    """Split-K parallelism at small batch: (block_n, programs_per_sm, min_split_blocks) on the
    Mistral shape at batch 1 and 8 (CUDA-graph time). Writes ``decode_splits.json``. With
    ``--model`` another shape: (block_n, min_splits, min_split_blocks) at batch 1 (4k-32k) and
    8 (4k), into ``decode_splits_<model>.json``."""
    from kvcalib_kernels.decode_attention import DecodeConfig

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.model != "mistral-7b":
        grid = [(bn, ms, msb) for bn in (32, 64) for ms in (16, 32, 64, 128, 256) for msb in (1, 2)]
        graph_sweep(out / f"decode_splits_{args.model}.json", ((1, 4096), (1, 16384), (1, 32768), (8, 4096)),
                    lambda bits: [DecodeConfig(block_n=bn, min_splits=ms, min_split_blocks=msb)
                                  for bn, ms, msb in grid],
                    lambda bits: DecodeConfig(), model=args.model)
        return
    grid = [(bn, pps, msb) for bn in (32, 64) for pps in (16.0, 32.0, 64.0) for msb in (1, 2, 4)]
    graph_sweep(out / "decode_splits.json", ((1, 4096), (1, 16384), (1, 32768), (8, 4096), (8, 32768)),
                lambda bits: [DecodeConfig(block_n=bn, programs_per_sm=pps, min_split_blocks=msb, num_warps=1,
                                           num_stages=2) for bn, pps, msb in grid],
                lambda bits: DecodeConfig())


def tune_configs() -> list:
    """Tile shapes and register caps for the lane unpack (5) against the byte unpack (2) with
    the former default tile (one warp, 16 rows): the ``--mode tune`` grid."""
    from kvcalib_kernels.decode_attention import DecodeConfig

    tiles = [  # (warps, block_n, min_rows, maxnreg, unpack)
        (1, 64, 16, None, 2), (1, 64, 16, None, 5), (1, 64, 4, None, 5), (2, 64, 4, None, 5),
        (2, 64, 4, 128, 5), (2, 128, 4, None, 5), (4, 128, 4, None, 5), (4, 128, 4, 128, 5),
        (4, 64, 4, None, 5), (2, 64, 8, None, 5), (2, 64, 4, None, 2), (1, 32, 16, None, 5),
    ]
    return [DecodeConfig(block_n=bn, num_warps=w, num_stages=2, unpack=u, min_rows=mr, maxnreg=mx,
                         programs_per_sm=pps)
            for w, bn, mr, mx, u in tiles for pps in (16.0, 32.0)]


def main_tune(args) -> None:
    """The ``tune_configs`` grid on the Mistral shape at batch 1 (4k, 32k) and 8 (32k), CUDA-graph
    time. Writes ``decode_tune.json``."""
    from kvcalib_kernels.decode_attention import DecodeConfig

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    graph_sweep(out / "decode_tune.json", ((1, 4096), (1, 32768), (8, 32768)), lambda bits: tune_configs(),
                lambda bits: DecodeConfig())


def main_sweep(args) -> None:
    """Any config grid on any shapes and layouts, CUDA-graph time with bf16 SDPA beside (the
    experiments behind a change of a default): ``--model``, ``--shapes 1x4096,8x32768`` (batch x
    context), ``--layouts 2/128/128,4/32/32`` (bits / key group / value group), ``--configs
    '[{}, {"maxnreg": 192}]'`` (DecodeConfig fields over the defaults; ``{}`` is the default).
    Writes ``decode_sweep_<--name>.json``."""
    from kvcalib_kernels.decode_attention import DecodeConfig

    def pairs(text, sep):
        return tuple(tuple(int(x) for x in item.split(sep)) for item in text.split(",") if item)

    shapes, layouts = pairs(args.shapes, "x"), pairs(args.layouts, "/")
    if any(len(s) != 2 for s in shapes) or any(len(lay) != 3 for lay in layouts):
        raise SystemExit("--shapes wants BATCHxCONTEXT,... and --layouts BITS/KGROUP/VGROUP,...")
    configs = [DecodeConfig(**c) for c in json.loads(args.configs)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = graph_sweep(out / f"decode_sweep_{args.name}.json", shapes, lambda bits: configs,
                       lambda bits: DecodeConfig(), model=args.model, layouts=layouts)
    _write_json(out / f"decode_sweep_{args.name}.json",
                {"rows": rows, "command": "python kernels/bench/bench_decode.py --mode sweep " + " ".join(
                    f"--{k} '{getattr(args, k)}'" for k in ("name", "model", "shapes", "layouts", "configs"))})


FITTED_VARIANTS = {  # name: (K and V permuted, mean bits of K and V: 0 off, 8 or 16, OTT pool slots)
    "plain": (False, 0, 0),
    "perm": (True, 0, 0),
    "mean8": (False, 8, 0),
    "mean16": (False, 16, 0),
    "perm+mean8": (True, 8, 0),
    "ott": (False, 0, 3 + 32),  # OTT's pool of 3 + extra pool of 32 slots per kv head, quant masks
    "pats": (False, 0, 0),  # PATS middle-heavy tiers (below): one split launch per tier store, one combine
}
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
    K/V at positions inside the packed range) of ``variant``."""
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


def bf16_sdpa_graph_ms(b, h, hq, ctx, d, dev) -> float:
    """CUDA-graph time of bf16 SDPA (``enable_gqa``) at one shape, over rotating random K/V sets
    (>= 256 MB in all, so L2 cannot hold them): the baseline of the fitted and groups tables."""
    bsets = _input_sets(bf16_bytes(b, h, hq, ctx, d))
    kvs = [(torch.randn(b, hq, 1, d, device=dev, dtype=torch.bfloat16),
            torch.randn(b, h, ctx, d, device=dev, dtype=torch.bfloat16),
            torch.randn(b, h, ctx, d, device=dev, dtype=torch.bfloat16)) for _ in range(bsets)]
    ms = graph_ms_per_call([bf16_variants(q4, k, v, d ** -0.5)["sdpa_enable_gqa"] for q4, k, v in kvs], rep=30)
    del kvs
    torch.cuda.empty_cache()
    return ms


def main_fitted(args) -> None:
    """What SKVQ permutations and TaDA means cost the fused kernel: CUDA-graph time of each
    :data:`FITTED_VARIANTS` on the Mistral shape (batch 1 and 8, 4k and 32k, 2 and 4 bits, group
    128, default config) against the plain kernel and bf16 SDPA. Writes ``decode_fitted.json``."""
    from kvcalib_kernels.decode_attention import DecodeConfig, decode_attention

    dev = torch.device("cuda")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    hq, h, d = MODELS["mistral-7b"]
    scale = d ** -0.5
    cfg = DecodeConfig()
    rows = []
    for b, ctx in ((1, 4096), (1, 32768), (8, 32768)):
        n = ctx - WINDOW
        bb = bf16_bytes(b, h, hq, ctx, d)
        bf16_ms = bf16_sdpa_graph_ms(b, h, hq, ctx, d, dev)
        for bits in (2, 4):
            for variant in FITTED_VARIANTS:
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
                ms = graph_ms_per_call(fns, rep=30)
                rows.append({"model": "mistral-7b", "batch": b, "context": ctx, "bits": bits, "variant": variant,
                             "ms_graph": ms, "bf16_ms_graph": bf16_ms, "speedup": bf16_ms / ms, "bytes": nb,
                             "bf16_bytes": bb, "gpu": torch.cuda.get_device_name(0)})
                log(f"  b={b} ctx={ctx:6d} bits={bits} {variant:11s}: {1e3 * ms:7.1f} us (bf16 {1e3 * bf16_ms:.1f} us, "
                    f"{bf16_ms / ms:.2f}x)")
                del fns
                torch.cuda.empty_cache()
        _write_json(out / "decode_fitted.json", {"rows": rows, "config": cfg_dict(cfg),
                                                  "command": "python kernels/bench/bench_decode.py --mode fitted"})


GROUP_VARIANTS = (  # (k_group, v_group, DecodeConfig.value_chunks, DecodeConfig.key_group_pairs)
    (128, 128, True, True), (32, 128, True, False), (32, 128, True, True), (128, 32, False, True),
    (128, 32, True, True), (32, 32, False, False), (32, 32, True, False), (32, 32, True, True))


def value_path(d, bits, v_group, chunks) -> str:
    """The groups table's label of how the kernel reads values of this layout
    (:func:`decode_attention.value_fold`): one fold per plane, one per value group (chunks of a
    plane), or per-element dequantization."""
    from kvcalib_kernels.decode_attention import value_fold

    fold, n_chunks = value_fold(d, bits, v_group, chunks)
    return ("fold" if n_chunks == 1 else "group-fold") if fold else "per-element"


def main_groups(args) -> None:
    """What small groups cost the fused kernel: CUDA-graph time on the Mistral shape (batch 1 at
    4k / 32k, batch 8 at 32k; 4 and 8 bits) of each :data:`GROUP_VARIANTS` -- key groups of 32
    tokens (blocks of one key group, 32 tokens, vs 64-token blocks of two, each half folded with
    its group), value groups of 32 channels (per-element dequantization vs one accumulator per
    value group) -- against bf16 SDPA.
    Writes ``decode_groups.json``."""
    from kvcalib_kernels.decode_attention import DecodeConfig

    dev = torch.device("cuda")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    hq, h, d = MODELS["mistral-7b"]
    scale = d ** -0.5
    rows = []
    for b, ctx in ((1, 4096), (1, 32768), (8, 32768)):
        n = ctx - WINDOW
        bb = bf16_bytes(b, h, hq, ctx, d)
        bf16_ms = bf16_sdpa_graph_ms(b, h, hq, ctx, d, dev)
        for bits in (4, 8):
            for kg, vg, chunks, pairs in GROUP_VARIANTS:
                cfg = DecodeConfig(value_chunks=chunks, key_group_pairs=pairs)
                key_blocks = 2 if (pairs and kg < cfg.block_n) else 1  # key groups per block
                nb = packed_bytes(b, h, hq, n, WINDOW, d, bits, kg, vg)["total"]
                sets = _input_sets(nb)
                inputs = [(torch.randn(b, hq, d, device=dev, dtype=torch.bfloat16),
                           packed_inputs(b, h, n, d, bits, kg, vg, dev, seed=i),
                           (torch.randn(b, h, WINDOW, d, device=dev, dtype=torch.bfloat16),
                            torch.randn(b, h, WINDOW, d, device=dev, dtype=torch.bfloat16))) for i in range(sets)]
                ms = graph_ms_per_call([kernel_call(q, pk, w, bits, kg, vg, n, scale, cfg) for q, pk, w in inputs],
                                       rep=30)
                path = value_path(d, bits, vg, chunks)
                rows.append({"model": "mistral-7b", "batch": b, "context": ctx, "bits": bits, "k_group": kg,
                             "v_group": vg, "key_groups_per_block": key_blocks, "value_path": path, "ms_graph": ms, "bf16_ms_graph": bf16_ms,
                             "speedup": bf16_ms / ms, "bytes": nb, "bf16_bytes": bb,
                             "gpu": torch.cuda.get_device_name(0)})
                log(f"  b={b} ctx={ctx:6d} bits={bits} k_group={kg:3d} x{key_blocks} v_group={vg:3d} {path:11s}: "
                    f"{1e3 * ms:7.1f} us (bf16 {1e3 * bf16_ms:.1f} us, {bf16_ms / ms:.2f}x)")
                del inputs
                torch.cuda.empty_cache()
        _write_json(out / "decode_groups.json", {"rows": rows, "command": "python kernels/bench/bench_decode.py --mode groups"})


# ---------------------------------------------------------------- end to end


def _fill_grow(gb, t: torch.Tensor, slack_rows: int) -> None:
    """Put ``t`` (B, H, rows, X) into a GrowBuffer with room for ``slack_rows`` more (no regrowth)."""
    rows = t.shape[2]
    buf = t.new_empty((*t.shape[:2], rows + slack_rows, *t.shape[3:]))
    buf[:, :, :rows] = t
    gb.buf, gb.n, gb.front = buf, rows, 0


def fill_compressed(cache, b, t, dev, slack_tokens=1024):
    """Fill every CompressedLayer as if a ``t``-token prompt had been prefilled and flushed.

    Random bf16 K/V per layer; the oldest tokens (all but the window and the partial group)
    quantized and packed by the Triton kernel (bit-exact with the runtime's codec, layout from the
    layer's config), the rest left pending in bf16. Needs ``layer._e2e_shape = (kv_heads, D)``.
    """
    from kvcalib_kernels.quant_pack import quantize_pack_keys, quantize_pack_values

    for layer in cache.layers:
        cfg = layer.cfg
        kv_heads, d = layer._e2e_shape
        n = (t - cfg.window) // cfg.flush_block * cfg.flush_block
        # a sliding-window layer has dropped the blocks its next query cannot see (CompressedLayer.flush)
        first = 0 if layer.sliding_window is None else min(n, max(0, t - layer.sliding_window + 1)
                                                             // cfg.flush_block * cfg.flush_block)
        k = torch.randn(b, kv_heads, t, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn(b, kv_heads, t, d, device=dev, dtype=torch.bfloat16)
        layer.lazy_initialization(k[:, :, :0], v[:, :, :0])
        for store, lo, hi in tier_ranges(layer, first, n - first, t):  # one store per PATS tier (one when untiered)
            qk = quantize_pack_keys(k[:, :, lo:hi], store.bits["k"], cfg.k_group, validate=False)
            qv = quantize_pack_values(v[:, :, lo:hi], store.bits["v"], cfg.v_group, validate=False)
            for side, qt in (("k", qk), ("v", qv)):
                _fill_grow(store.parts[f"{side}_codes"], qt.codes, slack_tokens)
                rows_slack = slack_tokens // cfg.k_group if side == "k" else slack_tokens
                _fill_grow(store.parts[f"{side}_scale"], qt.scale, rows_slack)
                _fill_grow(store.parts[f"{side}_zero"], qt.zero, rows_slack)
            store.start, store.n = lo, hi - lo
        layer.pend_k = k[:, :, n:].clone()
        layer.pend_v = v[:, :, n:].clone()
        layer.pend_start = n
        layer.n_seen = t
        del k, v, qk, qv


def tier_ranges(layer, start: int, n: int, t: int) -> list:
    """(store, first, end) per stored tier of ``layer`` (youngest first) for packed tokens at
    positions [start, start + n) at context ``t``: each flush block goes to the store of the tier
    the layer's schedule gives it (``Schedule.block_tier``, where the runtime's flushes and
    ``PackedTiers.advance`` put it; the fill quantizes it straight at that tier's bits instead of
    through the requantization chain: the same bytes to read). Untiered: one store, everything."""
    stores = layer.packed.stores
    sched = getattr(layer.codec.state("schedule"), "schedule", None)
    block = layer.cfg.flush_block
    first = len(sched.tiers) - len(stores) if sched is not None else 0  # schedule index of stored tier 0
    bounds: dict[int, tuple[int, int]] = {}
    for a in range(start, start + n, block):
        e = min(a + block, start + n)
        u = sched.block_tier(e, t) - first if sched is not None else 0
        lo, hi = bounds.get(u, (a, e))
        bounds[u] = (min(lo, a), max(hi, e))
    return [(store, *bounds.get(u, (start, start))) for u, store in enumerate(stores)]


def fill_dynamic(cache, n_layers, b, kv_heads, t, d, dev):
    """Random bf16 K/V of ``t`` tokens into a transformers cache (Dynamic or Static; the
    ``cache_position`` kwarg is what a StaticCache of transformers < 5.2x reads)."""
    where = {"cache_position": torch.arange(t, device=dev)}
    for i in range(n_layers):
        k = torch.randn(b, kv_heads, t, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn(b, kv_heads, t, d, device=dev, dtype=torch.bfloat16)
        cache.update(k, v, i, where)


def decode_steps(model, cache, b, steps, vocab, dev):
    """Greedy decode ``steps`` tokens; per-step wall times (synchronised)."""
    tok = torch.randint(0, vocab, (b, 1), device=dev)
    times = []
    with torch.no_grad():
        for _ in range(steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            logits = model(input_ids=tok, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            tok = logits[:, -1].argmax(-1, keepdim=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    return times


def random_model(cls, conf, dev):
    """``cls(conf)`` with seeded random bf16 weights made on ``dev``, SDPA attention, eval mode."""
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(dev):
            model = cls(conf)
    finally:
        torch.set_default_dtype(prev)
    model.set_attn_implementation("sdpa")
    return model.eval()


def build_model(dev, layers=32, hidden=4096, inter=14336, heads=32, kv_heads=8, head_dim=128, vocab=32000,
                max_pos=140000):
    from transformers import MistralConfig, MistralForCausalLM

    conf = MistralConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                         vocab_size=vocab, max_position_embeddings=max_pos, sliding_window=None)
    return random_model(MistralForCausalLM, conf, dev)


def build_gemma3_model(dev, max_pos=140000):
    """A random-weight Gemma-3-1B shape (26 layers, hidden 1152, 4 heads / 1 kv head, head_dim 256, a
    512-token sliding window on 5 of every 6 layers, vocab 262144), bf16, SDPA."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    layers = 26
    conf = Gemma3TextConfig(hidden_size=1152, intermediate_size=6912, num_hidden_layers=layers,
                            num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
                            sliding_window=512, query_pre_attn_scalar=256, max_position_embeddings=max_pos,
                            layer_types=["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(layers)])
    return random_model(Gemma3ForCausalLM, conf, dev)


def main_e2e(args) -> None:
    from transformers import DynamicCache

    from kvcalib.layout import LayerConfig
    from kvcalib.recipe import Recipe
    from kvcalib.runtime.cache import CompressedCache

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    small = args.quick
    dims = dict(layers=2, hidden=1024, inter=2048, heads=8, kv_heads=2, head_dim=128, vocab=1000) if small else {}
    t = 4096 if small else args.context
    steps = args.steps
    if args.sliding:
        model = build_gemma3_model(dev, max_pos=t + steps + 64)
        name = "random-weight Gemma-3-1B shape"
    else:
        model = build_model(dev, **dims, max_pos=t + steps + 64)
        name = "random-weight Mistral-7B shape" if not small else "small smoke model"
    c = model.config
    n_layers, kv_heads, d = c.num_hidden_layers, c.num_key_value_heads, c.head_dim
    weights = torch.cuda.memory_allocated()
    total_mem = torch.cuda.get_device_properties(0).total_memory
    res = {"gpu": device_info()["gpu"], "model": name,
           "config": {"layers": n_layers, "hidden": c.hidden_size, "heads": c.num_attention_heads,
                      "kv_heads": kv_heads, "head_dim": d, "vocab": c.vocab_size},
           "context": t, "steps": steps, "weights_bytes": weights, "gpu_memory_bytes": total_mem, "runs": [],
           "command": " ".join([os.path.basename(sys.executable), *sys.argv])}
    rec = Recipe(name="kivi2-g128-w128", default_layer=LayerConfig(k_bits=2, v_bits=2, k_group=128, v_group=128,
                                                                   window=128))
    res["recipe"] = rec.default_layer.to_dict()
    e2e_file = "e2e_pats.json" if args.pats else "e2e_sliding.json" if args.sliding else "e2e.json"
    if args.sliding:
        res["sliding_window"] = c.sliding_window
        res["sliding_layers"] = sum(1 for w in c.layer_types if w == "sliding_attention")
    if args.pats:  # PATS middle-heavy: 8 bits from the window to age 1024, 4 to 4096, then 2 (no sinks)
        from kvcalib.methods.schedule import preset_schedule

        tiers = preset_schedule("middle-heavy", window=128, sinks=0)
        pats = Recipe(name="pats-middle-heavy-g128-w128",
                      default_layer=LayerConfig(k_bits=8, v_bits=8, k_group=128, v_group=128, window=128),
                      tensors={f"layers.{i}.kv.schedule": tiers.to_tensor() for i in range(n_layers)})
        res["pats_recipe"] = {**pats.default_layer.to_dict(), "schedule": [[x.age, x.k_bits, x.v_bits] for x in tiers.tiers]}

    def record(kind, b, times, cache_bytes, peak):
        steady = sorted(times[2:]) if len(times) > 4 else sorted(times)
        run = {"cache": kind, "batch": b, "context": t, "steps": len(times),
               "tokens_per_s": b * len(times[2:]) / sum(times[2:]) if len(times) > 2 else b * len(times) / sum(times),
               "median_step_ms": 1e3 * steady[len(steady) // 2], "max_step_ms": 1e3 * max(times[2:] or times),
               "peak_memory_bytes": peak, "cache_bytes": cache_bytes,
               "step_ms": [round(1e3 * x, 3) for x in times],
               "per_sequence_bytes_beyond_weights": (peak - weights) / b}
        run["est_max_batch_at_context"] = int((0.97 * total_mem - weights) // run["per_sequence_bytes_beyond_weights"])
        res["runs"].append(run)
        log(f"  {kind:10s} b={b:3d}: {run['tokens_per_s']:.1f} tok/s, median step {run['median_step_ms']:.2f} ms, "
            f"max {run['max_step_ms']:.2f} ms, peak {peak / 2**30:.1f} GiB, cache {cache_bytes / 2**30:.2f} GiB, "
            f"est. max batch {run['est_max_batch_at_context']}")
        _write_json(out / e2e_file, res)

    def graph_decode(cache, b):
        """Greedy steps replayed from CUDA graphs (kvcalib.runtime.graphs); per-step wall times."""
        from kvcalib.runtime.graphs import GraphDecoder

        times = []
        tok = torch.randint(0, c.vocab_size, (b, 1), device=dev)
        pos = torch.full((b, 1), t, dtype=torch.long, device=dev)
        r = GraphDecoder(model, cache, capture=True).decode(tok, t, pos, steps, step_times=times)
        log(f"    graph: {r.captures} captures, {r.replays} replays, {r.eager_steps} eager steps")
        return times

    def run(kind, b, make, decode):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        try:
            cache, cache_bytes = make(b)
            times = decode(cache, b)
            record(kind, b, times, cache_bytes, torch.cuda.max_memory_allocated())
        except torch.cuda.OutOfMemoryError:
            log(f"  {kind} b={b}: out of memory")
            res["runs"].append({"cache": kind, "batch": b, "context": t, "oom": True})

    def make_dynamic(b):
        model.set_attn_implementation("sdpa")
        cache = DynamicCache(config=model.config)
        fill_dynamic(cache, n_layers, b, kv_heads, t, d, dev)
        return cache, sum(x.numel() * x.element_size() for lay in cache.layers for x in (lay.keys, lay.values))

    def make_static(b):
        from transformers import StaticCache

        model.set_attn_implementation("sdpa")
        cache = StaticCache(config=model.config, max_cache_len=t + steps + 8)
        fill_dynamic(cache, n_layers, b, kv_heads, t, d, dev)
        return cache, sum(x.numel() * x.element_size() for lay in cache.layers for x in (lay.keys, lay.values))

    def make_packed(b, recipe=rec):
        cache = CompressedCache.from_recipe(model, recipe)  # switches attention to kvcalib
        for lay in cache.layers:
            lay._e2e_shape = (kv_heads, d)
        fill_compressed(cache, b, t, dev)
        return cache, sum(sum(lay.nbytes().values()) for lay in cache.layers)

    def eager(cache, b):
        return decode_steps(model, cache, b, steps, c.vocab_size, dev)

    def eager_sliding_reference(cache, b):
        """Eager steps with the sliding-window layers on the PyTorch reference (where they ran
        before the kernel took them); the global layers on the kernel."""
        from kvcalib.runtime import triton_path

        real = triton_path._reason_unsupported
        triton_path._reason_unsupported = lambda q, layer: "sliding-window layer" if layer.is_sliding else real(q, layer)
        try:
            return eager(cache, b)
        finally:
            triton_path._reason_unsupported = real

    if args.sliding:  # per batch: bf16, kvcalib before (sliding layers on the reference), now, graphs
        for b in args.batches_packed:
            run("bf16_dynamic", b, make_dynamic, eager)
            run("kvcalib_2bit_sliding_reference", b, make_packed, eager_sliding_reference)
            run("kvcalib_2bit", b, make_packed, eager)
            if args.graphs:
                run("kvcalib_2bit_graph", b, make_packed, graph_decode)
        _write_json(out / e2e_file, res)
        return
    for b in args.batches_bf16:
        run("bf16_dynamic", b, make_dynamic, eager)
        if args.graphs:
            run("bf16_static_graph", b, make_static, graph_decode)
    if args.pats:  # compile the tier-move kernels (requantize 8 -> 4 -> 2) outside the timed steps
        warm = CompressedCache.from_recipe(model, pats).layers[0].codec
        for side, enc in (("k", warm.encode_keys), ("v", warm.encode_values)):
            blk = enc(torch.randn(1, kv_heads, 128, d, device=dev, dtype=torch.bfloat16))
            for bits in (4, 2):
                blk = warm.requantize(side, blk, bits)
        torch.cuda.synchronize()
    for b in args.batches_packed:
        if args.pats:  # graph decoding only: plain 2-bit, then the PATS tiers
            run("kvcalib_2bit_graph", b, make_packed, graph_decode)
            run("kvcalib_pats_graph", b, lambda b: make_packed(b, pats), graph_decode)
            continue
        run("kvcalib_2bit", b, make_packed, eager)
        if args.graphs:
            run("kvcalib_2bit_graph", b, make_packed, graph_decode)
    _write_json(out / e2e_file, res)


# ---------------------------------------------------------------- report (markdown + plot)


NOTES = """
## What ran where

- CPU (this repo's dev machine, 2 cores, no GPU): `pytest tests/kernels` runs every kernel through
  Triton's interpreter (`TRITON_INTERPRET=1`, set by the test modules) at small shapes
  (`test_decode_attention.py` ~65 s);
  the portable code paths (`unpack` 0, 1, 4, 6; 6 is the interpreter's default, so the folds of
  the lane unpack are checked on every CPU test) are checked there against the PyTorch references.
  Offline SASS: the split kernel compiled for sm_90 with the local Triton 3.9 (`triton.compile`
  with a `GPUTarget`, no GPU) to count loop instructions, registers and spills.
- GPU (NVIDIA H200 through the device tool, torch 2.11 / Triton 3.6): the `gpu`-marked grid plus
  the small grid on CUDA (all pass, including the inline-PTX unpacks 2, 3 and 5 and every tile
  of the tune sweep at 2/4/8 bits), the tile sweep (`--mode tune`), this table and the
  end-to-end run.

## How the kernel got here (Mistral-7B shape, 32k, batch 8, 2-bit; bf16 SDPA 0.257 ms)

1. 4 warps / program, 128-token blocks: 0.648 ms (0.40x). SASS: with 16 query rows (tl.dot's
   minimum M) Triton gives each warp whole rows of the chained QK/PV products, so all 4 warps
   repeated the same MMAs, softmax and (after hoisting a uint8 layout conversion above the
   unpack) the unpack itself: ~131 warp-instructions per token and kv head.
2. 1 warp / program, more programs per SM, per-key-group query fold, lazy rescaling: 0.247 ms.
3. Inline-PTX unpack of bytes, 2-stage pipelining, host-side launcher trimming: 0.205 ms (1.24x).
4. Lane unpack (`unpack=5`: one AND-OR per pair of codes, the code bits left in place; the
   float16 1024 offset and the 2^shift plane scale folded into the key bias / query planes and
   the value accumulators, the lane order undone on the query channels and the value rows) and
   4-row query tiles (`min_rows=4`, Triton pads the MMA): 0.166 ms (1.54x); CUDA-graph time
   0.196 -> 0.159 ms (`decode_tune.json`). Loop body 2,529 -> 1,839 SASS instructions per 64
   tokens (`scripts/compile_sm90.py 2 64 1 5 2 4`).
5. Batch 1: the merge of the split partials ran one program per query row, looping over up to
   256 partials (32 programs at batch 1): most of the call at 32k. Now a program per (row, 2-32
   channels) merges all partials at once, and short caches split down to one block per split
   (`min_splits`, 64): batch 1 CUDA-graph time 43.4 -> 28.5 us at 32k (0.86x -> 1.31x of bf16),
   15.4 -> 10.9 us at 4k (0.75x -> 1.05x) (`decode_splits.json`, `decode_latency.json`).
6. Key products transposed ("swap AB"): scores^T (BLOCK_N, R) = codes (BLOCK_N, PK) @ (q * s)^T,
   so a block's 64 tokens fill the MMA rows and the 4 query rows of the GQA group are its small
   N; before, the 4 query rows were the M side, padded into 16-row fragments that Triton built
   with register moves. Probe first (`kernels/bench/probe_swap.py`, a plain-layout copy of the
   loop, `probe_swap.json`): 155 -> 111 us at batch 8 / 32k, 27.0 -> 22.5 us at batch 1 / 32k
   (transposing the value products as well was slower: 143 us). In the production kernel
   (masks, ranges, OTT, permutations, means kept): CUDA-graph time 0.155 -> 0.127 ms at batch 8
   / 32k (1.57x -> 1.92x of bf16), 4-bit 0.166 -> 0.145 ms (1.47x -> 1.68x), batch 1 / 32k
   28.2 -> 25.0 us (`decode_fitted.json`, `decode_latency.json`). Loop body 1,923 -> 1,673 SASS
   instructions per 64 tokens, register moves 511 -> 288, HMMA 132 -> 96
   (`scripts/compile_sm90.py 2 64 1 5 2 4` on the kernel before and after).
7. All planes of a byte tile unpacked by one PTX block (`_code_planes`): two `prmt` per 4 bytes
   set the float16 exponent byte once, then one AND with an immediate per pair of codes and
   plane. The per-plane `(x & mask) | 0x6400` needs a second constant in a register, which ptxas
   rematerialized before each use at 255 registers: loop body 1,673 -> 1,490 SASS instructions.
   CUDA-graph time at batch 8 / 32k 126.7 -> 117.3 us (2-bit, 1.92x -> 2.03x of bf16), 145.1 ->
   134.2 us (4-bit). Tried with it in the probe (`probe_swap.py --sweep vlayout`,
   `probe_vlayout.json`): value codes stored 4 tokens of a byte column per 32-bit word (the value
   MMA's token pairs from one word, no byte gathers): slower (103.9 -> 113.4 us), not adopted.
8. Value groups narrower than a plane of codes (4-bit, head_dim 128, group 32: the KIVI presets'
   and `kvcalib export`'s default group) fold like whole planes: chunk c of a row's code bytes
   holds, in plane s, channels of value group `s * chunks + c` only, so each (plane, chunk) tile
   gets its group's `p * scale` and its own accumulator (at most 4 groups per head; more keep the
   per-element path). The group's zero sum and lane 1024 are one reduction, and the key fold sums
   the bias terms of all planes in one reduction (it runs every block with 32-token key groups).
   Group-32 rows of the grid (CUDA-graph time): Mistral 4-bit batch 8 / 32k 378.6 -> 214.7 us
   (0.63x -> 1.11x of bf16), batch 1 / 32k 58.6 -> 37.2 us (0.63x -> 1.00x); group-128 rows moved
   4-7% with the key-fold change (2-bit batch 8 / 32k 117.7 -> 109.9 us). What each group costs:
   `bench_decode.py --mode groups` (`decode_groups.json`, section below).
9. Two key groups per block (`key_group_pairs`, on by default at head_dim <= 64 with <= 4 padded
   query rows and <= 4 bits): the query rows doubled into virtual rows, one set per 32-token key
   group of a 64-token block (its own scales, tokens, online softmax and accumulators), merged
   by log-sum-exp at the end; one key product and one softmax per 64 tokens. Offline 2,840 ->
   2,369 SASS instructions per 64 tokens (4-bit, groups 32 / 32). SmolLM2 shape, group 32, batch
   8 / 32k: 4-bit 64.8 -> 45.2 us, 2-bit 82.9 -> 41.9 us (`decode_sweep_pairs-smol.json`); at
   head_dim 128 slower (Mistral 32 / 32 211 -> 221 us, `decode_groups.json`; Qwen batch 1 / 128k
   46 -> 57 us, `decode_sweep_pairs-b1.json`), so off there. The `--mode sweep` files beside it:
   register caps (more warps per SM) slower on every layout (`decode_sweep_occupancy.json`);
   8-bit at batch 1 / 4k 12.0 -> 10.6 us with 32-token blocks below `min_programs`
   (`decode_sweep_b1-8bit.json`, `decode_sweep_b1-8bit-after.json`).
10. Host side (GPU time unchanged: this grid's CUDA-graph columns repeat the previous run's within
   a few percent): launches through `kvcalib_kernels.launch.FastLauncher` (the compiled kernel kept
   per specialization key, launched without Triton re-binding ~90 arguments: a call at batch 1 /
   4k 296-302 -> 220-227 us of host time in one process, `host.md`) and less Python per step in the
   runtime. The `ms` / `speedup`
   (do_bench) columns are host-bound wherever the kernel is short and move with the shared host:
   the same code gave 1.26x and 1.99x at batch 8 / 32k 2-bit in two runs an hour apart (the other
   rows within 0.01x). Eager host time per call and whole eager steps: `bench_host.py`, `host.md`.
11. Whole waves of split programs: the plan aimed at 16 one-warp programs per SM (two waves at
   the 8 that fit at ~255 registers), rounding each row's splits up, so rows that did not divide
   the target spilled a few programs into a wave of their own. Now 8 per SM, rounded down
   (`programs_per_sm`, `whole_waves`): Mistral batch 32 / 32k 0.476 -> 0.397 ms (2-bit), batch 1
   / 32k 2-bit 19.6 -> 16.4 us, Qwen batch 1 / 128k group 32 44.6 -> 35.3 us; median of the grid
   1.04x faster, rows below bf16 13 -> 5 (`decode_sweep_waves-mistral.json`,
   `decode_sweep_ppsm8-*.json`, `decode_sweep_qwen-g32-b1-splits.json`).
12. Value codes read as int16 units (`value_units`): a byte tile reached the value MMA's operand
   by one shared-memory load per byte plus permutes pairing consecutive tokens (64 LDS.U8 and ~40
   PRMT per 64 tokens); a tile of 16-bit units (two code bytes) gets there by `ldmatrix.trans`, and
   each unit unpacks elementwise into every plane of its low and its high byte (the same PTX
   block, two accumulators per plane). Loop body 1,456 -> 1,281 SASS instructions (2-bit), 1,768
   -> 1,414 (4-bit), 2,270 -> 1,662 (8-bit). Same-run A/B (`decode_sweep_units-*.json`, CUDA-graph
   time): Mistral batch 8 / 32k 107.8 -> 99.6 us (2-bit, 2.26x -> 2.45x of bf16), 128.3 -> 113.0
   us (4-bit, 1.90x -> 2.15x), 180.0 -> 158.2 us (8-bit); batch 32 and 128k 8-15% faster; SmolLM2
   4-bit 5-9%. Slower: the Qwen shape at batch 1 (11.8 -> 12.4 us at 32k 2-bit, 2-5%) and
   batch 8 / 4k 4-bit (10.3 -> 11.0 us in the grid). Off where units measured slower: two key
   groups per block (SmolLM2 group 32: 0.93x, `decode_units_everywhere.json`) and a TaDA value
   mean without a permutation (mean8 302 -> 355 us, `decode_fitted_units_everywhere.json`).
13. Group 32 at head_dim 128 (4-bit, the KIVI presets' and `kvcalib export`'s default group).
   Values: the group accumulators read int16 units too (a chunk of a row is whole units), the
   probabilities take their one layout change per block (not one per group) and are scaled per
   group in the products' operand (float16), and each group's zero sum and lane 1024 come from
   small products (a zero-point tile, a constant tile) into one accumulator instead of two
   reductions across the warp per group: loop body (Mistral shape, keys 128 / values 32, 64
   tokens) 2,392 -> 1,605 SASS instructions. Keys (`key_group_halves`): a 64-token block holds
   two 32-token key groups, one per half, each half's codes times its own folded query planes,
   the two score tiles stacked (instead of 32-token blocks): 2 x 994 -> 1,903 per 64 tokens;
   off where a split would run a single block (Mistral batch 1 / 4k 10.1 -> 11.2 us with it).
   CUDA-graph time, old code vs new in one run (`decode_sweep_vg32-old-*.json` ran the previous
   commit's kernels, `decode_sweep_vg32-new-*.json` this value path, `decode_sweep_halves-*.json`
   the key halves on and off): Mistral batch 8 / 32k groups 32 / 32 216.7 -> 197.7 (values) ->
   159.0 us (keys; 194.8 without), keys 128 / values 32 173.8 -> 130.7 us, batch 1 / 32k 35.4 ->
   28.0 us. In the grid: Mistral group 32 1.14x -> 1.50x of bf16 at batch 8 / 32k, 1.16x -> 1.53x at
   batch 32 / 128k; Qwen batch 8 and 32 at >= 16k 1.04-1.10x -> 1.29-1.40x. Not helped: the Qwen
   shape at batch 1 (2 kv heads, a few blocks per program: 4k 0.98x unchanged, 16k 0.93x -> 0.85x,
   32k 0.93x -> 0.90x in the grid; the A/B sweeps put those within +-0.6 us either way) and
   SmolLM2 (pairs, value planes of one group: unchanged).
14. Value planes of one group (group 128 at head_dim 128, `DecodeConfig.value_sum_products`):
   `p * scale` built in the float16 operand after the one layout change, each plane's lane 1024
   term from one small product with a constant tile instead of a float32 tile and its reduction
   (SASS per 64 tokens, Mistral shape 2-bit: 1,281 -> 1,198). On by default at 2 bits with one
   key group per block only: on vs off in one run (`decode_sweep_sums3-*.json`) Mistral batch 8 /
   32k 99.5 -> 96.6 us (99.3 -> 96.1 in `decode_sweep_sums2-mistral.json`), batch 1 / 32k 19.3 ->
   18.6 us, SmolLM2 groups 64 batch 8 39.0 -> 37.1 us, Qwen within +-1%; 4-bit within +-1%, 8-bit
   1-2% slower, SmolLM2 groups 32 (key pairs) 3-4% slower. An earlier form of the same
   computation (1,227 instructions) was slower even at 2 bits (`decode_sweep_sums-*.json`: 99.5
   -> 102.5 us): the gain follows the compiler's schedule more than the instructions removed.
15. The merge of the split partials: one warp per program, up to 128 partials a step, 16 channels
   a program (32 with <= 64 partials) instead of 4 warps, all partials in one step and <= 2,048
   values a program (2-4 channels with many partials: 8-16-byte reads at a partial row's stride).
   The merge alone (`combine_sweep.json`, 27 choices per shape, the new rule within 1% of the best
   at each): batch 1 Qwen shape 12 rows x 530 partials 5.2 -> 3.4 us, Mistral 32 x 258 4.5 -> 2.8
   us, batch 8 / 4k Qwen 96 x 130 5.4 -> 3.0 us. Whole calls in the grid: median 1.1% faster,
   batch 1 up to 9%; rows below bf16 5 -> 3 (Qwen batch 1 / 4k group 32 0.97x -> 1.00x, SmolLM2
   batch 8 / 4k group 32 0.98x -> 1.03x).
16. Key-group halves kept where a split runs one block unless one group per block gives >= 1.5x
   the splits and <= 256 a row (`halves_split_gain`, `halves_max_splits`): old vs new rule in one
   run (`decode_sweep_halves-rule-*.json`) Qwen batch 1 / 16k 12.58 -> 11.82 us, 32k 15.74 ->
   15.06 us, batch 8 / 4k 14.09 -> 13.59 us, the Mistral rows within 0.1 us.
17. Each block's per-token value scales and zeros loaded at the top of the block, before the key
   work (`early_value_scales`): Nsight Compute (`ncu_split_before.json`) put 17% of the 2-bit
   kernel's stall samples on their first uses, right after the softmax; off -> on in one run
   (`decode_sweep_early2-*.json`) Mistral batch 8 / 32k 2-bit 90.9 -> 81.5 us, 4-bit 109.2 ->
   100.1 us, groups 32 158.3 -> 144.6 us; issue 37% -> 44.5% busy (`ncu_split.json`).
18. A third pipeline stage where every split runs >= 16 blocks of a layout with one key group per
   block (`deep_pipeline_blocks`): the next block's code tiles were copied at the end of a block
   and waited for a few hundred instructions later (8.1% of the stall samples); 2 -> 3 stages in one
   run (`decode_sweep_stages-*.json`) batch 8 / 32k 2-bit 81.0 -> 78.4 us, 4-bit 99.6 -> 95.8 us,
   slower with short splits and with groups 32, which the rule leaves out.
19. Value products transposed (`value_products_t`): the value codes of a units layout are loaded
   as a (channels, tokens) tile and multiply the probabilities in the key product's (tokens, rows)
   orientation, `acc^T += codes^T @ (p * scale)`: the 4 query rows are the MMA's N (padded to 8)
   instead of an M padded to 16, and p is never transposed. The byte-tile form of this (step 6's
   probe) was slower because its transposed operand went through shared memory after the unpack;
   loading the tile transposed keeps the unpack on the MMA operand's registers. Loop body 1,232 ->
   1,083 SASS instructions (HMMA 100 -> 68); one run (`decode_sweep_vt-*.json`) batch 8 / 32k
   2-bit 78.0 -> 70.4 us, 4-bit 97.5 -> 87.1 us, 8-bit 152.7 -> 140.2 us. Value-group
   accumulators take it too (keys 128 / values 32 4-bit 118.9 -> 108.2 us), but for 4-bit groups
   32 / 32 beside keys in block halves, which did not gain (`decode_sweep_vt-chunks-*.json`).
20. Fewer instructions per block, same arithmetic: the lane unpack's even bytes by one `lop3` per
   plane (one `prmt` per 4 bytes instead of two), and no bounds masks where every packed block of
   the call is whole and visible (`whole_blocks`). Loop body 2-bit 1,083 -> 974, 4-bit 1,240 ->
   1,069, 8-bit 1,471 -> 1,017 SASS instructions; batch 8 / 32k 2-bit 70.8 -> 65.7 us, groups 32 /
   32 143.7 -> 130.5 us, but 4-bit 85.8 -> 84.5 and 8-bit 140.8 -> 137.7 (near memory-bound: 0.79
   and 0.94 of copy bandwidth) (`decode_sweep_whole-*.json`, `decode_sweep_occ3-*.json`).

## Why the 5x / 3x targets are missed

At 3.71x (graph time, this grid: 65.9 us at 2 bits against bf16's 244 us) the kernel moves ~2.4 TB/s, 0.55 of the 4.3 TB/s copy bandwidth: it is
bound by instruction issue and latency, not memory (Nsight Compute, `ncu_split.json`: the
schedulers issued on 44.5% of cycles, 2 warps each, before steps 18-20). A 64-token block of one kv head costs one warp
~970 instructions (`scripts/compile_sm90.py`): the unpack's 259 LOP3 (one per pair of codes,
the floor with 16-bit lanes) and ~90 PRMT, 68 HMMA (the 4 query rows padded to 8 MMA columns on
both sides), ~300 softmax and scale-sum instructions, at 255 registers, so only 8 warps fit on
an SM and their stalls are not hidden. At 4 bits (2.87x, 0.79 of copy bandwidth) the kernel is
close to the memory's limit: 14% fewer instructions there (step 20) gave 1.5%; 3x needs ~81 us, 0.83.
The split merge is ~3 us of that call (profiler, `profile_calls_mistral_b8.json`: split kernel
81.95 us, merge 2.18 us, CUDA-graph call 85.0 us): fusing it away would give ~2.98x at most.
Transposing the key side removed the key half of the padding moves (step 6), transposing the
value side the other half (step 19); reading the values as 16-bit units removed the byte gathers
(step 12: ~8% at batch 8); a value layout stored for the MMA was slower
(step 7). Multi-warp tiles, 128-token blocks
and register caps (`decode_tune.json`, `probe_vlayout.json`) traded the moves for shared-memory
traffic or spills and were slower at batch 8 (two-warp programs over 128-token blocks again on the
step-20 kernel: 1.2-1.6x slower, `decode_sweep_w2-mistral.json`). The 5x would need fewer instructions per code
than one LOP3 per pair and more warps in flight per SM; no single change measured here gets
there.
Called eagerly, small shapes (batch 1, short context, the small models) are host-bound: ~150 us of
Python + two Triton launches per call vs a GPU time of 6-25 us (see the latency table); CUDA-graph
capture of the decode step removes that (`GraphDecoder`, `e2e.md`).
Group 32 (4-bit) costs 1.4x group 128 at batch 8 / 32k (step 13): two key folds per 64-token
block instead of one every other block, and four value groups per head four scaled operands and
accumulators per block instead of one; the grid's group-32 rows run at 1.05-1.96x of bf16
(Mistral, Qwen shapes; the low end Qwen at batch 1), against a byte ratio of ~3.2x.
"""


def _targets_section(rows, meta, out: Path) -> list[str]:
    """The issue's targets, each with the measured numbers (met / missed)."""
    def row(model, b, ctx, bits, group):
        for r in rows:
            if (r["model"], r["batch"], r["context"], r["bits"], r["group"]) == (model, b, ctx, bits, group):
                return r
        return None

    out_lines = ["", "## Targets (issue 6) against these numbers", ""]
    for bits, want in ((2, 5.0), (4, 3.0)):
        r = row("mistral-7b", 8, 32768, bits, 128)
        if r:
            ok1 = r["speedup"] >= 0.8 * r["byte_ratio"]
            ok2 = r["speedup"] >= want
            out_lines.append(f"- Mistral shape, 32k, batch 8, {bits}-bit g128: speedup {r['speedup']:.2f}x vs byte ratio "
                             f"{r['byte_ratio']:.2f}x -> >= 0.8 x byte ratio ({0.8 * r['byte_ratio']:.2f}x): "
                             f"**{'met' if ok1 else 'missed'}**; >= {want:g}x: **{'met' if ok2 else 'missed'}** "
                             f"({r['gbps']:.0f} GB/s = {r['frac_copy_bw']:.2f} of copy bandwidth)"
                             + (f"; `graph` columns {r['speedup_graph']:.2f}x, {r['gbps_graph']:.0f} GB/s: "
                                f">= 0.8 x byte ratio **{'met' if r['speedup_graph'] >= 0.8 * r['byte_ratio'] else 'missed'}**, "
                                f">= {want:g}x **{'met' if r['speedup_graph'] >= want else 'missed'}**"
                                if "speedup_graph" in r else "") + ".")
    slow = [r for r in rows if r["batch"] == 1 and r["context"] >= 4096 and r["speedup"] < 1.0]
    b1 = [r for r in rows if r["batch"] == 1]
    out_lines.append(f"- Batch 1 not slower than bf16 at any context >= 4k: **{'met' if not slow else 'missed'}** "
                     f"({len(slow)} of {len(b1)} batch-1 rows slower; speedups "
                     f"{min((r['speedup'] for r in b1), default=float('nan')):.2f}x to "
                     f"{max((r['speedup'] for r in b1), default=float('nan')):.2f}x).")
    b1e = [r for r in b1 if r["context"] >= 4096 and "speedup_eager" in r]
    if b1e:  # the same calls made eagerly: host time included
        slow_e = [r for r in b1e if r["speedup_eager"] < 1.0]
        out_lines.append(
            f"- The same for eager calls (`speedup_eager`, host time included): {len(slow_e)} of {len(b1e)} batch-1 "
            f"rows slower (host time per call is most of a batch-1 call: see the GPU time vs host time table).")
    b1g = [r for r in b1 if r["context"] >= 4096 and "speedup_graph" in r]
    if b1g:  # the grid's GPU-time columns
        slow_g = [r for r in b1g if r["speedup_graph"] < 1.0]
        out_lines.append(
            f"- The same on this grid's `graph` columns (rotating input sets, no flush): "
            f"**{'met' if not slow_g else 'missed'}** ({len(slow_g)} of "
            f"{len(b1g)} batch-1 rows slower"
            + ("; " + ", ".join(f"{r['model']} {r['context'] // 1024}k {r['bits']}b g{r['group']} "
                                f"{r['speedup_graph']:.2f}x" for r in slow_g) if slow_g else "")
            + f"; lowest {min(r['speedup_graph'] for r in b1g):.2f}x).")
    lat_path = out / "decode_latency.json"
    if lat_path.exists():  # the same target on GPU time (CUDA-graph replay), which the host does not mask
        lat = [r for r in json.loads(lat_path.read_text())["rows"] if r["batch"] == 1 and r.get("speedup_graph")]
        if lat:
            slow_g = [r for r in lat if r["speedup_graph"] < 1.0]
            out_lines.append(
                f"- The same on GPU time (`decode_latency.json`, CUDA-graph replay, 2-bit g128, 4k, 16k and 32k, three shapes): "
                f"**{'met' if not slow_g else 'missed'}** ({len(slow_g)} of {len(lat)} rows slower; "
                + ", ".join(f"{r['model']} {r['context'] // 1024}k {r['speedup_graph']:.2f}x" for r in lat)
                + "). Eager calls (`speedup_eager`) add ~0.1-0.25 ms of host time per call (Python + two launches), "
                "which a captured decode step (`kvcalib.runtime.graphs.GraphDecoder`) removes.")
    q = meta.get("quant_vs_prefill")
    if q:
        worst = max(q.get("quant_pack_2b_frac_of_prefill", 0), q.get("quant_pack_4b_frac_of_prefill", 0))
        out_lines.append(f"- Quantize-and-pack of a 32k prompt <= 5% of its prefill attention: "
                         f"**{'met' if worst <= 0.05 else 'missed'}** ({100 * worst:.2f}% at worst).")
    return out_lines


def _json_section(path: Path, title: str, intro, header: str, rule: str, row) -> list[str]:
    """A report section from one benchmark JSON with a ``rows`` list (nothing if the file is
    absent): ``## title``, ``intro(doc)``, a table of ``header`` / ``rule`` and ``row(doc, r)`` per row."""
    if not path.exists():
        return []
    doc = json.loads(path.read_text())
    return ["", f"## {title}", "", intro(doc), "", header, rule] + [row(doc, r) for r in doc["rows"]]


def main_report(args) -> None:
    out = Path(args.out)
    rows = json.loads((out / "decode_attention.json").read_text())
    meta_path = out / "decode_bench_meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    dev = meta.get("device", {})
    eager_cols = all("ms_eager" in r for r in rows)  # (grids before the graph-replay do_bench: eager only)
    lines = ["# Fused decode attention over packed 2/4-bit KV vs bf16", ""]
    lines += [f"GPU: **{dev.get('gpu', rows[0]['gpu'] if rows else '?')}** ({dev.get('sms', '?')} SMs), torch "
              f"{dev.get('torch', '?')}, triton {dev.get('triton', '?')}, CUDA {dev.get('cuda', '?')}. "
              f"Measured device-to-device copy bandwidth: {meta.get('copy_bw_gbps', float('nan')):.0f} GB/s "
              "(bytes read + written).", ""]
    lines += ["Command (on the GPU machine, through `scripts/gpu_bench.sh`): `" + meta.get("command", "?") + "`", ""]
    lines += ["One attention layer per row. Cache = `context` tokens: the last 128 in bf16 (window), the rest "
              "packed (K per channel over `group` tokens, V per token over `min(group, head_dim)` channels). "
              + ("`ms`: median of `triton.testing.do_bench` (L2 flushed before each call) of a CUDA-graph replay of "
                 "one call of the fused kernel (split + combine launches): its GPU time from a cold L2, as a "
                 "captured decode step runs it (`ms_eager` / `speedup_eager` in the JSON and the last column: "
                 "do_bench of the eager call, which adds whatever host time -- Python and two launches, "
                 "~0.1-0.25 ms -- the flush does not hide). `ms_bf16`: the same for the fastest of the bf16 baselines "
                 if eager_cols else
                 "`ms`: median of `triton.testing.do_bench` (L2 flushed before each call) of the fused kernel "
                 "(split + combine launches). `ms_bf16`: the fastest of the bf16 baselines ")
              + "(`bf16_baseline` column: SDPA with `enable_gqa`, SDPA with the GQA group as query rows on each "
              "backend, explicit matmuls; flash-attn's kvcache kernel when importable) over the same context in "
              "bf16. `GB/s`: bytes the kernel must read (codes + scales/zeros + bf16 window + q) / time; `frac`: "
              "that / copy bandwidth. `bytes x`: bf16 bytes / packed bytes (the ideal speedup of a memory-bound "
              "kernel).", ""]
    if meta.get("chosen_config"):
        lines += ["Kernel config (chosen by the sweep on the Mistral 32k batch-1/8 shapes): "
                  + ", ".join(f"{k}-bit: `{v}`" for k, v in meta["chosen_config"].items()), ""]
    elif "--no-sweep" in meta.get("command", ""):
        from kvcalib_kernels.decode_attention import DecodeConfig

        cfg = meta.get("default_config") or cfg_dict(DecodeConfig())
        lines += [f"Kernel config: `DecodeConfig()` defaults, `{cfg}` (`unpack` None resolves to the lane "
                  "unpack 5 on every layout of this table; `decode_tune.json` has the tile sweep behind them).", ""]
    graph = all("ms_graph" in r for r in rows)
    if graph:
        rotating = all("input_sets_graph" in r for r in rows)
        sets_note = ("rotating input sets, >= 256 MB in all on each side, so that L2 holds neither side's cache "
                     "between calls, as in a decode step" if rotating else
                     "one input set: small caches may sit in L2 on both sides")
        lines += [f"`graph` columns: the same calls as CUDA-graph replays (`graph_ms_per_call`, {sets_note}): GPU "
                  "time without the host's ~0.1-0.2 ms per eager call, which do_bench measures wherever the kernel "
                  "is faster than that; `GB/s graph` is the bytes read over that time.", ""]
    head = "| model | batch | context | bits | group | ms | ms bf16 | speedup | bytes x | GB/s | frac copy bw | bf16 baseline |"
    if graph:
        head += " ms graph | ms bf16 graph | speedup graph | GB/s graph |"
    if eager_cols:
        head += " speedup eager |"
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        line = (f"| {r['model']} | {r['batch']} | {r['context']} | {r['bits']} | {r['group']} | {r['ms']:.4f} | "
                f"{r['ms_bf16']:.4f} | {r['speedup']:.2f} | {r['byte_ratio']:.2f} | {r['gbps']:.0f} | "
                f"{r['frac_copy_bw']:.2f} | {r['bf16_baseline']} |")
        if graph:
            line += (f" {r['ms_graph']:.4f} | {r['ms_bf16_graph']:.4f} | {r['speedup_graph']:.2f} | "
                     f"{r['gbps_graph']:.0f} |")
        if eager_cols:
            line += f" {r['speedup_eager']:.2f} |"
        lines.append(line)
    q = meta.get("quant_vs_prefill")
    if q:
        lines += ["", "## Quantize-and-pack vs prefill (one Mistral-7B layer, 32k-token prompt, batch 1)", "",
                  f"Prefill attention (SDPA causal, enable_gqa, bf16): {q['prefill_attention_ms']:.3f} ms.", ""]
        for bits in (2, 4):
            if f"quant_pack_{bits}b_ms" in q:
                lines.append(f"- {bits}-bit, group 128: Triton quantize+pack of K and V {q[f'quant_pack_{bits}b_ms']:.4f} ms "
                             f"= {100 * q[f'quant_pack_{bits}b_frac_of_prefill']:.2f}% of prefill attention "
                             f"(bit-exact with the reference: {q[f'quant_pack_{bits}b_bit_exact']}; the PyTorch reference "
                             f"path takes {q[f'quant_pack_{bits}b_torch_reference_ms']:.3f} ms).")
    lines += _targets_section(rows, meta, out)
    lines += NOTES.splitlines()
    lines += _json_section(
        out / "decode_latency.json", "GPU time vs host time (2-bit, group 128)",
        lambda lat: "`do_bench` times include whatever host time the L2 flush between calls does not hide; "
        "`graph`: median CUDA-graph replay over enough rotating input sets (>= 256 MB) that L2 cannot "
        "hold them, i.e. GPU time only; `host us`: Python + launch time per call (200 calls, no sync). "
        "bf16 graph = the faster of SDPA `enable_gqa` and SDPA grouped rows on the flash backend, timed "
        "the same way. Config: `" + json.dumps(lat.get("config")) + "`.",
        "| model | batch | context | ours do_bench ms | ours graph ms | ours host us | bf16 graph ms | "
        "bf16 host us | speedup (graph) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        lambda lat, r: f"| {r['model']} | {r['batch']} | {r['context']} | {r['ms_do_bench']:.4f} | "
        f"{r['ms_graph']:.4f} | {r['host_us']:.0f} | {r['bf16_best_ms_graph']:.4f} | "
        f"{r.get('bf16_sdpa_enable_gqa_host_us'):.0f} | {r['speedup_graph']:.2f} |")

    def fitted_row(fit, r):  # each variant against the plain row of its shape
        base = next((x["ms_graph"] for x in fit["rows"] if x["variant"] == "plain" and
                     (x["batch"], x["context"], x["bits"]) == (r["batch"], r["context"], r["bits"])), float("nan"))
        return (f"| {r['batch']} | {r['context']} | {r['bits']} | {r['variant']} | {1e3 * r['ms_graph']:.1f} | "
                f"{r['ms_graph'] / base:.2f}x | {1e3 * r['bf16_ms_graph']:.1f} | {r['speedup']:.2f} | "
                f"{r['bytes'] / 1e6:.0f} |")

    lines += _json_section(
        out / "decode_fitted.json",
        "SKVQ permutations, TaDA means and OTT pools in the kernel (Mistral-7B shape, group 128)",
        lambda fit: "CUDA-graph time (median replay over rotating input sets, GPU time only) of the default config "
        "on packed K/V plus: `perm` a channel permutation of K and of V per kv head (the query is read at "
        "the permuted channels, values written back to theirs); `mean8`/`mean16` TaDA per-token means of "
        "K and V over the kv heads at 8 bits (codes + per-token scale/zero) or 16 bits, added in the same "
        "pass (`q . mean` per score, `sum p * mean` per output); `ott` OTT quant masks (one bit per "
        "packed token and kv head, read in the loop) and a 35-slot outlier pool per kv head (OTT's 3 + 32 "
        "extra, bf16, at their own positions) as one more segment; `pats` PATS middle-heavy tiers (8 bits "
        "to age 1024, 4 bits to 4096, then 2 bits) as the runtime runs them: one split launch per tier "
        "store (the first with the window) into one buffer of partials, one combine "
        "(`decode_attention_parts`); `perm+mean8` accumulates the value mean apart in input channel "
        "order. `bytes` counts the means "
        "(one (N, D) tensor per sequence and side, shared by the 8 kv heads), the OTT parts and the "
        "tiers' extra bits. bf16: SDPA "
        "`enable_gqa`, same timing. "
        "Command: `" + fit.get("command", "?") + "`.",
        "| batch | context | bits | variant | us | vs plain | bf16 us | speedup vs bf16 | MB read |",
        "|---:|---:|---:|---|---:|---:|---:|---:|---:|", fitted_row)
    lines += _json_section(
        out / "decode_groups.json", "Key and value groups of 32 (Mistral-7B shape)",
        lambda grp: "CUDA-graph time of the default config with key groups (`k_group` tokens per key scale) and value "
        "groups (`v_group` channels per value scale) of 128 or 32. `key groups per block`: 1 (blocks of "
        "one key group: 32 tokens for group 32) or 2 (`key_group_pairs`: 64-token blocks, one set of virtual "
        "query rows per key group). `value path`: `fold` (a plane of codes "
        "lies in one value group: `p * scale` once per plane), `group-fold` (groups narrower than a plane: "
        "one accumulator per (plane, chunk) = value group), `per-element` (`DecodeConfig(value_chunks="
        "False)`: every code dequantized before the product, the path before). bf16: SDPA `enable_gqa`. "
        "Command: `" + grp.get("command", "?") + "`.",
        "| batch | context | bits | k_group | key groups per block | v_group | value path | us | bf16 us | "
        "speedup vs bf16 | MB read |",
        "|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|",
        lambda grp, r: f"| {r['batch']} | {r['context']} | {r['bits']} | {r['k_group']} | "
        f"{r.get('key_groups_per_block', 1)} | {r['v_group']} | "
        f"{r['value_path']} | {1e3 * r['ms_graph']:.1f} | {1e3 * r['bf16_ms_graph']:.1f} | "
        f"{r['speedup']:.2f} | {r['bytes'] / 1e6:.0f} |")
    if meta.get("sweep"):
        lines += ["", "## Config sweep (Mistral-7B shape, 32k context)", "",
                  "Median ms per config; `unpack`: 1 Triton-ops bytes, 2 PTX bytes, 3 PTX words, 4 Triton-ops words "
                  "(see `DecodeConfig`). " + meta.get("sweep_note", ""), "",
                  "| bits | batch | warps | block_n | stages | unpack | programs/SM | min split blocks | ms |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in sorted(meta["sweep"], key=lambda r: (r["bits"], r["batch"], r["ms"] or 1e9)):
            lines.append(f"| {r['bits']} | {r['batch']} | {r['num_warps']} | {r['block_n']} | {r['num_stages']} | "
                         f"{r['unpack']} | {r['programs_per_sm']:g} | {r.get('min_split_blocks', 4)} | "
                         f"{(r['ms'] or float('nan')):.4f} |")
    (out / "decode_attention.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(MODELS), figsize=(5 * len(MODELS), 4), sharey=True)
        for ax, model in zip(axes, MODELS):
            for (bits, group), style in zip(SETTINGS, ("-", "--", ":")):
                for b, color in zip(BATCHES, ("C0", "C1", "C2")):
                    pts = sorted((r["context"], r["speedup"]) for r in rows
                                 if r["model"] == model and r["bits"] == bits and r["group"] == group and r["batch"] == b)
                    if pts:
                        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=color, marker="o", ms=3,
                                label=f"{bits}-bit g{group}, batch {b}")
            ax.axhline(1.0, color="grey", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_title(model)
            ax.set_xlabel("context (tokens)")
        axes[0].set_ylabel("speedup over fastest bf16 baseline")
        axes[-1].legend(fontsize=7)
        fig.suptitle(f"Packed-KV decode attention vs bf16 ({dev.get('gpu', '')})")
        fig.tight_layout()
        fig.savefig(out / "decode_attention.png", dpi=120)
    except ImportError:
        log("matplotlib not installed: no plot")
    e2e_path = out / "e2e.json"
    if e2e_path.exists():
        e = json.loads(e2e_path.read_text())
        el = ["# End to end: random-weight Mistral-7B shape, decode at 32k context", "",
              f"GPU: **{e['gpu']}**. Model: {e['model']} {e['config']}, bf16, random init (no download). "
              f"Context {e['context']} tokens, {e['steps']} greedy decode steps timed one by one (synchronised); "
              "tokens/s = batch x steps / time over steps 3.., so the first two (warm-up, kernel compilation) are "
              "left out.", "",
              "How the caches were made (no 32k prefill was run): the bf16 `DynamicCache` got random bf16 K/V "
              "through `cache.update`; the `CompressedCache` (recipe " + json.dumps(e.get("recipe", {})) + ") got "
              "random bf16 K/V per layer, the oldest tokens quantized and packed by the Triton quantize-and-pack "
              "kernel straight into the layer's packed buffers, the newest 128 left pending in bf16. Decode then "
              "runs the real runtime: HF attention -> kvcalib attention function -> Triton kernel per layer; a "
              "flush (through the codec, on CUDA the quantize-and-pack kernel in one launch per side) happens every 128 steps and is inside the timed steps "
              "when steps > 128.", "",
              "Eager rows (`bf16_dynamic`, `kvcalib_2bit`) launch every kernel of every step from Python, as "
              "`model.generate` does. Graph rows replay each whole step from a CUDA graph "
              "(`kvcalib.runtime.graphs.GraphDecoder`): `bf16_static_graph` over a transformers `StaticCache` "
              "(bf16, sized context + steps, SDPA under a 4D visibility mask), `kvcalib_2bit_graph` over the "
              "`CompressedCache` in static mode (fixed pending buffer, one eager step + one capture per 128-step "
              "flush period, both inside the timed steps).", "",
              "| cache | batch | tokens/s | median step ms | max step ms | peak GiB | cache GiB | est. max batch at this context |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
        el += _run_rows(e["runs"], 8, lambda r: (
            f"{r['tokens_per_s']:.1f}", f"{r['median_step_ms']:.2f}", f"{r['max_step_ms']:.2f}",
            f"{r['peak_memory_bytes'] / 2**30:.1f}", f"{r['cache_bytes'] / 2**30:.2f}", f"{r['est_max_batch_at_context']}"))
        by = {(r["cache"], r["batch"]): r for r in e["runs"] if not r.get("oom")}
        ratios = []
        for ours, base in (("kvcalib_2bit", "bf16_dynamic"), ("kvcalib_2bit_graph", "bf16_dynamic"),
                           ("kvcalib_2bit_graph", "kvcalib_2bit")):
            for (kind, b), r in sorted(by.items()):
                if kind == ours and (base, b) in by:
                    ratios.append(f"- batch {b}: `{ours}` / `{base}` = "
                                  f"{r['tokens_per_s'] / by[(base, b)]['tokens_per_s']:.2f}x tokens/s")
        if ratios:
            el += ["", "Ratios (same batch):", *ratios]
        meta_path = out / "decode_bench_meta.json"
        copy_bw = json.loads(meta_path.read_text()).get("copy_bw_gbps") if meta_path.exists() else None
        ceil = []
        for (kind, b), r in sorted(by.items()):
            if kind == "bf16_dynamic" and copy_bw:
                floor_ms = (e["weights_bytes"] + r["cache_bytes"]) / (copy_bw * 1e9) * 1e3
                best = max((x for (k2, b2), x in by.items() if k2.startswith("kvcalib") and b2 == b),
                           key=lambda x: x["tokens_per_s"], default=None)
                line = (f"- batch {b}: reading the weights and the bf16 K/V once at the measured copy bandwidth "
                        f"({copy_bw:.0f} GB/s) takes {floor_ms:.2f} ms per step, so no bf16 implementation passes "
                        f"{b / floor_ms * 1e3:.0f} tokens/s here")
                if best is not None:
                    line += (f"; `{best['cache']}` reaches {best['tokens_per_s']:.0f} "
                             f"({best['tokens_per_s'] / (b / floor_ms * 1e3):.2f}x that ceiling)")
                ceil.append(line + ".")
        if ceil:
            el += ["", "The bf16 ceiling (what a perfect bf16 engine could do, not a measurement):", *ceil,
                   "", "`bf16_static_graph` is slower than eager `bf16_dynamic`: under an attention mask, "
                   "transformers' SDPA integration repeats each kv head's K/V for its query heads (no "
                   "`enable_gqa` with a mask on CUDA), so every step copies the 32k-token cache 4x over; it is "
                   "the graph-capturable bf16 path transformers offers, not the best bf16 could do (see the "
                   "ceiling)."]
        el += ["", "Largest batch: an *estimate*, (0.97 x GPU memory - weights) / (measured peak - weights) x batch, "
               "i.e. assuming everything beyond the weights grows linearly with the batch; not verified by a run at "
               "that batch.", "", "Command: `" + e.get("command", "?") + "`"]
        el += _pats_e2e_section(out / "e2e_pats.json")
        el += _sliding_e2e_section(out / "e2e_sliding.json")
        (out / "e2e.md").write_text("\n".join(el) + "\n")


def _run_rows(runs, width: int, cells) -> list[str]:
    """Markdown rows of e2e runs, ``width`` columns: cache, batch, then ``cells(run)``; a run that
    ran out of memory says so."""
    return [f"| {r['cache']} | {r['batch']} | out of memory |" + " |" * (width - 3) if r.get("oom")
            else "| " + " | ".join((r["cache"], str(r["batch"]), *cells(r))) + " |" for r in runs]


def _pats_e2e_section(path: Path) -> list[str]:
    """The e2e.md section of ``e2e_pats.json`` (``--mode e2e --pats``), if it exists."""
    if not path.exists():
        return []
    e = json.loads(path.read_text())
    lines = ["", "## PATS tiers under CUDA-graph decoding", "",
             f"GPU: **{e['gpu']}**, same model and context ({e['context']} tokens), {e['steps']} steps, one run "
             "(the same process) of each cache: `kvcalib_2bit_graph` as above, `kvcalib_pats_graph` a PATS "
             "middle-heavy cache (" + json.dumps(e.get("pats_recipe", {})) + ": the stored blocks in one store "
             "per bit width, filled as a 32k prompt leaves them). Every 128 steps a flush also moves the blocks "
             "that reach a tier's age down to it (requantized by the quantize-and-pack kernel, compiled before "
             "the timed steps) and the next step starts a new graph period. `slow steps ms`: the steps over 3x the "
             "median (PATS: the flush with its tier moves, then the eager + capture step of the next period; "
             "plain: only the eager + capture step, its flush is one kernel launch per side).", "",
             "| cache | batch | tokens/s | median step ms | slow steps ms | cache GiB | est. max batch |",
             "|---|---:|---:|---:|---|---:|---:|"]
    lines += _run_rows(e["runs"], 7, lambda r: (
        f"{r['tokens_per_s']:.1f}", f"{r['median_step_ms']:.2f}",
        ", ".join(f"{x:.0f}" for x in r["step_ms"][1:] if x > 3 * r["median_step_ms"]),
        f"{r['cache_bytes'] / 2**30:.2f}", f"{r['est_max_batch_at_context']}"))
    return lines + ["", "Command: `" + e.get("command", "?") + "`"]


def _sliding_e2e_section(path: Path) -> list[str]:
    """The e2e.md section of ``e2e_sliding.json`` (``--mode e2e --sliding``), if it exists."""
    if not path.exists():
        return []
    e = json.loads(path.read_text())
    cfg = e["config"]
    lines = ["", "## Sliding-window layers (Gemma 3 shape)", "",
             f"GPU: **{e['gpu']}**. Model: {e['model']} ({cfg['layers']} layers, {e.get('sliding_layers', '?')} of "
             f"them with a {e.get('sliding_window', '?')}-token sliding window, {cfg['heads']} heads / "
             f"{cfg['kv_heads']} kv head, head_dim {cfg['head_dim']}, vocab {cfg['vocab']}), context "
             f"{e['context']}, {e['steps']} greedy steps each, one process. `bf16_dynamic`: transformers' "
             "`DynamicCache` (its sliding layers keep only their window). kvcalib caches: recipe "
             + json.dumps(e.get("recipe", {})) + "; a sliding layer holds the blocks its window still reaches "
             "(older ones are dropped at flushes). `kvcalib_2bit_sliding_reference`: eager steps with the "
             "sliding layers on the PyTorch reference path, where they ran before the kernel covered them (the "
             "benchmark forces it); `kvcalib_2bit`: every layer on the kernel; `kvcalib_2bit_graph`: CUDA-graph "
             "steps, which refused models with sliding layers before.", "",
             "| cache | batch | tokens/s | median step ms | peak GiB | cache GiB |",
             "|---|---:|---:|---:|---:|---:|"]
    lines += _run_rows(e["runs"], 6, lambda r: (
        f"{r['tokens_per_s']:.1f}", f"{r['median_step_ms']:.2f}", f"{r['peak_memory_bytes'] / 2**30:.1f}",
        f"{r['cache_bytes'] / 2**30:.3f}"))
    return lines + ["", "Command: `" + e.get("command", "?") + "`"]


# (rows = batch x query heads, partials per row, head_dim) of the grid's calls: batch 1 Qwen2.5-1.5B
# (12 rows; 130-1026 partials from 4k to 128k with 32-token blocks), Mistral-7B (32 rows), SmolLM2
# (9 rows, head_dim 64), batch 8 (72-256 rows, 10-130 partials), batch 32 (288-1024 rows)
COMBINE_SHAPES = ((12, 130, 128), (12, 258, 128), (12, 530, 128), (12, 1026, 128), (32, 132, 128), (32, 258, 128),
                  (32, 530, 128), (9, 354, 64), (72, 46, 64), (96, 130, 128), (96, 34, 128), (256, 18, 128),
                  (256, 10, 128), (288, 14, 64), (1024, 6, 128), (384, 44, 128))


def main_combine(args) -> None:
    """CUDA-graph time of the split merge per (rows, partials, head_dim) of ``COMBINE_SHAPES``:
    the launcher's choice (``_combine``) and each (partials per step cap, channels per program,
    warps) of a 3 x 3 x 3 grid, checked against the launcher's output. Writes ``combine_sweep.json``."""
    import itertools

    import triton

    from kvcalib_kernels.decode_attention import _combine, _combine_kernel

    dev = torch.device("cuda")
    rows_out = []
    for rows, s_tot, d in COMBINE_SHAPES:
        m = torch.randn(rows, s_tot, device=dev)  # (ROWS, S)
        l = torch.rand(rows, s_tot, device=dev) + 0.5  # (ROWS, S)
        o = torch.randn(rows, s_tot, d, device=dev)  # (ROWS, S, D)
        out = torch.empty(rows, 1, d, device=dev, dtype=torch.bfloat16)  # (ROWS, 1, D)
        _combine(m, l, o, s_tot, out)
        ref = out.float().clone()
        row = {"rows": rows, "partials": s_tot, "head_dim": d,
               "launcher_us": 1e3 * graph_ms_per_call([lambda: _combine(m, l, o, s_tot, out)] * 20, rep=30), "us": {}}
        for cap, db, warps in itertools.product((64, 128, 256), (8, 16, 32), (1, 2, 4)):
            sb = min(cap, max(16, triton.next_power_of_2(s_tot)))

            def fn(sb=sb, db=db, warps=warps):
                _combine_kernel[(rows, d // db)](m, l, o, s_tot, out, out, D=d, DB=db, S_BLOCK=sb, num_warps=warps)
            fn()
            torch.cuda.synchronize()
            if float((out.float() - ref).abs().max()) > 1e-2:
                raise RuntimeError(f"combine {cap}/{db}/{warps} disagrees with the launcher's at {rows} x {s_tot}")
            row["us"][f"{cap}/{db}/{warps}"] = 1e3 * graph_ms_per_call([fn] * 20, rep=30)
        best = min(row["us"], key=row["us"].get)
        log(f"  rows {rows:5d} partials {s_tot:5d} d {d}: launcher {row['launcher_us']:.2f} us, "
            f"best {row['us'][best]:.2f} us ({best}: step cap / channels / warps)")
        rows_out.append(row)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_json(out_dir / "combine_sweep.json", {
        "rows": rows_out, "gpu": device_info(),
        "command": "python kernels/bench/bench_decode.py --mode combine --out artifacts/bench"})


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("micro", "latency", "splits", "tune", "sweep", "fitted", "groups", "e2e", "combine",
                                       "report"),
                    default="micro")
    ap.add_argument("--out", default="artifacts/bench")
    ap.add_argument("--quick", action="store_true", help="a few shapes only (smoke test)")
    ap.add_argument("--no-sweep", action="store_true", help="default config, no sweep")
    ap.add_argument("--config", default=None, help='JSON {"2": {DecodeConfig fields}, "4": {...}}: skip the sweep')
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--model", choices=tuple(MODELS), default="mistral-7b", help="splits / sweep: the shape to sweep")
    ap.add_argument("--shapes", default="1x32768,8x32768", help="sweep: BATCHxCONTEXT,...")
    ap.add_argument("--layouts", default="2/128/128,4/128/128", help="sweep: BITS/KGROUP/VGROUP,...")
    ap.add_argument("--configs", default="[{}]", help="sweep: JSON list of DecodeConfig fields ({} = defaults)")
    ap.add_argument("--name", default="custom", help="sweep: writes decode_sweep_NAME.json")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batches-bf16", type=int, nargs="*", default=[8])
    ap.add_argument("--batches-packed", type=int, nargs="*", default=[8, 32])
    ap.add_argument("--sliding", action="store_true",
                    help="e2e: a Gemma-3-1B shape (sliding-window layers): bf16, kvcalib with its sliding layers on "
                         "the reference and on the kernel, CUDA graphs; writes e2e_sliding.json")
    ap.add_argument("--pats", action="store_true",
                    help="e2e: CUDA-graph decoding of a PATS middle-heavy cache beside plain 2-bit (e2e_pats.json)")
    ap.add_argument("--no-graphs", dest="graphs", action="store_false",
                    help="e2e: eager steps only (no CUDA-graph runs of either cache)")
    args = ap.parse_args(argv)
    {"micro": main_micro, "latency": main_latency, "splits": main_splits, "tune": main_tune, "sweep": main_sweep, "fitted": main_fitted,
     "groups": main_groups, "e2e": main_e2e, "combine": main_combine, "report": main_report}[args.mode](args)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: kvcalib importable
    main()
