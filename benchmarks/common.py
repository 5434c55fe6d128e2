"""Shared pieces of the decode benchmarks: the benchmark shapes, timing (do_bench of eager calls
and of CUDA-graph replays, over rotating input sets), random packed inputs, byte counts, the
bf16 baselines and the device facts every table records.

Protocol (DESIGN.md, "GPU benchmark protocol"): shapes of Mistral-7B (32 q / 8 kv heads,
head_dim 128), Qwen2.5-1.5B (12/2/128), SmolLM2-135M (9/3/64); batch 1/8/32; context
4k/16k/32k/128k; median time of ``triton.testing.do_bench`` (which flushes L2 before every call);
bytes actually read / time; that over the measured device-to-device copy bandwidth (bytes read +
written); speedup over the fastest bf16 baseline we could build (several SDPA forms, the
explicit-matmul form, and flash-attn's kvcache kernel if importable), and the byte ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
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
SETTINGS = ((2, 128), (3, 128), (4, 128), (4, 32))  # (bits for K and V, group)
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


def time_bf16(q4, k, v, scale, warmup=25, rep=100, replay=False, names=None) -> dict:
    """name -> median ``do_bench`` ms of each bf16 variant (``names``: those only; ``replay``: of
    its CUDA-graph replay, see :func:`_replay`; a variant that cannot be captured is timed
    eagerly); None = refused."""
    res = {}
    for name, fn in bf16_variants(q4, k, v, scale).items():
        if names is not None and name not in names:
            continue
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


def cfg_dict(c) -> dict:
    """A DecodeConfig's fields (of whichever kernels tree is imported: ``KV_KERNELS`` may be an
    older one with more fields)."""
    return dataclasses.asdict(c)


def copy_bandwidth(dev) -> float:
    n = 2 << 30
    x = torch.randint(0, 255, (n,), dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    ms = _bench(lambda: y.copy_(x))
    del x, y
    torch.cuda.empty_cache()
    return 2 * n / (ms * 1e-3) / 1e9


def kernels_origin() -> dict:
    """Which kernels tree this process imported (``scripts/gpu_bench.sh`` links ``$KV_KERNELS`` in as
    ``kvcalib_kernels``; ``$KV_KERNELS_LABEL`` names it, e.g. its commit)."""
    import kvcalib_kernels

    where = Path(kvcalib_kernels.__file__).parent
    return {"path": str(where), "resolved": str(where.resolve()), "label": os.environ.get("KV_KERNELS_LABEL", "")}


def device_info() -> dict:
    import triton

    p = torch.cuda.get_device_properties(0)
    return {"gpu": p.name, "sms": p.multi_processor_count, "memory_gib": round(p.total_memory / 2 ** 30, 1),
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda}


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


def main_with_out(run, doc: str, argv=None) -> None:
    """The command line of a benchmark whose one option is ``--out`` (the JSON folder): parse
    ``argv``, then ``run(args)``."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", default="artifacts/bench")
    run(ap.parse_args(argv))
