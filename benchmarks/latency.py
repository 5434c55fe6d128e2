"""Benchmark: small shapes are launch-bound. ``--mode latency`` separates the kernel's GPU time
(CUDA-graph replay over rotating input sets) from its host time per call, beside bf16 SDPA's
(``decode_latency.json``); ``--mode splits`` / ``tune`` time DecodeConfig grids of split-K
parallelism / tile shape, pipelining and unpack (``decode_splits*.json`` / ``decode_tune.json``).

    python -m benchmarks.latency --mode latency --out artifacts/bench     (CUDA, repository root)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.common import (MODELS, WINDOW, _bench, _input_sets, _write_json, bf16_bytes, bf16_variants,
                               cfg_dict, graph_ms_per_call, graph_sweep, host_us, kernel_call, log, packed_bytes,
                               packed_inputs)


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


def main_splits(args) -> None:
    """Split-K parallelism at small batch: (block_n, programs_per_sm) on ``--model``'s shape at
    batch 1 (4k-32k) and 8 (4k, 32k), CUDA-graph time. Writes ``decode_splits.json`` (Mistral
    shape) or ``decode_splits_<model>.json``."""
    from kvcalib_kernels.decode_attention import DecodeConfig

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "decode_splits.json" if args.model == "mistral-7b" else f"decode_splits_{args.model}.json"
    grid = [(bn, pps) for bn in (32, 64) for pps in (4.0, 8.0, 16.0, 32.0)]
    graph_sweep(out / name, ((1, 4096), (1, 16384), (1, 32768), (8, 4096), (8, 32768)),
                lambda bits: [DecodeConfig(block_n=bn, programs_per_sm=pps) for bn, pps in grid],
                lambda bits: DecodeConfig(), model=args.model)


def tune_configs() -> list:
    """Tile shapes, pipelining and the unpack: the ``--mode tune`` grid (DecodeConfig's fields)."""
    from kvcalib_kernels.decode_attention import DecodeConfig

    tiles = [  # (warps, block_n, stages, unpack)
        (1, 64, 2, None), (1, 64, 2, 6), (1, 64, 2, 2), (1, 32, 2, None), (1, 64, 3, None), (1, 64, 1, None),
        (2, 64, 2, None), (2, 128, 2, None), (4, 128, 2, None), (4, 64, 2, None),
    ]
    return [DecodeConfig(block_n=bn, num_warps=w, num_stages=st, unpack=u) for w, bn, st, u in tiles]


def main_tune(args) -> None:
    """The ``tune_configs`` grid on the Mistral shape at batch 1 (4k, 32k) and 8 (32k), CUDA-graph
    time. Writes ``decode_tune.json``."""
    from kvcalib_kernels.decode_attention import DecodeConfig

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    graph_sweep(out / "decode_tune.json", ((1, 4096), (1, 32768), (8, 32768)), lambda bits: tune_configs(),
                lambda bits: DecodeConfig())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("latency", "splits", "tune"), default="latency")
    ap.add_argument("--out", default="artifacts/bench")
    ap.add_argument("--config", default=None, help='latency: JSON {"2": {DecodeConfig fields}}')
    ap.add_argument("--model", choices=tuple(MODELS), default="mistral-7b", help="splits: the shape to sweep")
    args = ap.parse_args(argv)
    {"latency": main_latency, "splits": main_splits, "tune": main_tune}[args.mode](args)


if __name__ == "__main__":
    main()
