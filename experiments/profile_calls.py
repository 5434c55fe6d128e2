"""Per-kernel GPU time of one decode-attention call (the split kernel and the merge) beside the
kernels of bf16 SDPA on the same shape (GPU only), at batch ``$BATCH`` (default 1).

For each model shape in ``$MODELS`` (default the Qwen2.5-1.5B shape, whose 2 kv heads make batch 1
the hardest case) and context in ``$CTXS`` (default 4k, 16k, 32k), layouts 4-bit group 32, 4-bit
and 2-bit group 128 (the grid's), each ``DecodeConfig`` of ``$CFGS`` (JSON list, default ``[{}]``):
the median device time of every kernel over 50 eager calls (torch.profiler / CUPTI) and the
CUDA-graph time of a call (8 rotating input sets, as the grid). Writes ``$OUT/profile_calls.json``.

    python -m experiments.profile_calls      (from the repository root, as scripts/gpu_bench.sh sets up)
"""
import json
import os

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import MODELS, WINDOW, bf16_variants, device_info, graph_ms_per_call, kernel_call, packed_inputs
from kvcalib_kernels.decode_attention import DecodeConfig

OUT = os.environ.get("OUT", "/tmp/out")
LAYOUTS = ((4, 32, 32), (4, 128, 128), (2, 128, 128))  # (bits, key group, value group)


def kernel_us(fn, calls: int = 50) -> dict:
    """Median device time (us) of each kernel ``fn`` launches, over ``calls`` eager calls."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times = {}
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            times.setdefault(ev.name[:48], []).append(getattr(ev, "device_time", None) or ev.cuda_time)
    return {name: round(sorted(t)[len(t) // 2], 2) for name, t in times.items()}


def main() -> None:
    dev = torch.device("cuda")
    configs = json.loads(os.environ.get("CFGS", "[{}]"))
    rows = []
    for model in os.environ.get("MODELS", "qwen2.5-1.5b").split(","):
        hq, h, d = MODELS[model]
        for ctx in (int(c) for c in os.environ.get("CTXS", "4096,16384,32768").split(",")):
            b, n, scale = int(os.environ.get("BATCH", "1")), ctx - WINDOW, d ** -0.5
            q4 = torch.randn(b, hq, 1, d, device=dev, dtype=torch.bfloat16)  # (B, Hq, 1, D)
            k = torch.randn(b, h, ctx, d, device=dev, dtype=torch.bfloat16)  # (B, H, T, D)
            v = torch.randn_like(k)  # (B, H, T, D)
            for name in ("sdpa_enable_gqa", "sdpa_grouped_rows_flash"):
                fn = bf16_variants(q4, k, v, scale)[name]
                rows.append({"model": model, "batch": b, "context": ctx, "call": name, "kernels_us": kernel_us(fn),
                             "graph_us": 1e3 * graph_ms_per_call([fn] * 8, rep=30)})
                print(rows[-1], flush=True)
            for bits, kg, vg in LAYOUTS:
                sets = [(torch.randn(b, hq, d, device=dev, dtype=torch.bfloat16),  # (B, Hq, D)
                         packed_inputs(b, h, n, d, bits, kg, vg, dev, seed=i),
                         (torch.randn(b, h, WINDOW, d, device=dev, dtype=torch.bfloat16),
                          torch.randn(b, h, WINDOW, d, device=dev, dtype=torch.bfloat16))) for i in range(8)]
                for cfg in configs:
                    fns = [kernel_call(q, pk, w, bits, kg, vg, n, scale, DecodeConfig(**cfg)) for q, pk, w in sets]
                    rows.append({"model": model, "batch": b, "context": ctx, "call": f"{bits}-bit groups {kg}/{vg}", "config": cfg,
                                 "kernels_us": kernel_us(fns[0]), "graph_us": 1e3 * graph_ms_per_call(fns, rep=30)})
                    print(rows[-1], flush=True)
                del sets
    os.makedirs(OUT, exist_ok=True)
    path = os.path.join(OUT, "profile_calls.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"rows": rows, "gpu": device_info(),
                   "command": "python -m experiments.profile_calls (MODELS=" + os.environ.get("MODELS", "qwen2.5-1.5b")
                   + " CTXS=" + os.environ.get("CTXS", "4096,16384,32768") + " BATCH=" + os.environ.get("BATCH", "1") + " CFGS='" + json.dumps(configs) + "')"}, f, indent=1)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
