"""Where a CUDA-graph decode step's GPU time goes (GPU only).

Random-weight Mistral-7B and Gemma-3-1B shapes at 32k context, batch 1 and 8, 2-bit group-128
recipe, steps replayed by ``GraphDecoder``: a torch.profiler run gives the kernels of a step (GPU
time and launches per step, averaged over 60 steps), then tokens/s of two more runs of 100 steps.
Writes ``$OUT/profile_step.json``. (The run in ``artifacts/bench/HISTORY.md`` also timed two
launch variants since removed: a float32 combine output with a cast kernel after it, and the
combine as a programmatic dependent launch.)

    python -m experiments.profile_step      (from the repository root, as scripts/gpu_bench.sh sets up)
"""
import json
import os
import statistics

import torch

from benchmarks.e2e import build_gemma3_model, build_model, fill_compressed
from kvcalib.layout import LayerConfig
from kvcalib.recipe import Recipe
from kvcalib.runtime.cache import CompressedCache
from kvcalib.runtime.graphs import GraphDecoder

OUT = os.environ.get("OUT", "/tmp/out")
dev = torch.device("cuda")
T = 32768
rec = Recipe(name="k2", default_layer=LayerConfig(k_bits=2, v_bits=2, k_group=128, v_group=128, window=128))

def run(model, b, steps, prof=False):
    c = model.config
    cache = CompressedCache.from_recipe(model, rec)
    for lay in cache.layers:
        lay._e2e_shape = (c.num_key_value_heads, c.head_dim)
    fill_compressed(cache, b, T, dev)
    tok = torch.randint(0, c.vocab_size, (b, 1), device=dev)
    pos = torch.full((b, 1), T, dtype=torch.long, device=dev)
    times = []
    if prof:
        from torch.profiler import profile, ProfilerActivity
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            GraphDecoder(model, cache, capture=True).decode(tok, T, pos, steps, step_times=times)
        agg = {}
        for e in p.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                a = agg.setdefault(e.name, [0, 0.0])
                a[0] += 1
                a[1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        del cache
        torch.cuda.empty_cache()
        return times, agg
    GraphDecoder(model, cache, capture=True).decode(tok, T, pos, steps, step_times=times)
    del cache
    torch.cuda.empty_cache()
    return times, None


res = {"runs": [], "profiles": {}}
lines = []
for mname, b in (("mistral", 1), ("mistral", 8), ("gemma3", 1), ("gemma3", 8)):
    model = build_model(dev, max_pos=T + 200) if mname == "mistral" else build_gemma3_model(dev, max_pos=T + 200)
    steps = 100
    times, agg = run(model, b, 60, prof=True)
    tot = sum(v[1] for v in agg.values()) / 60
    top = sorted(agg.items(), key=lambda kv: -kv[1][1])[:25]
    res["profiles"][f"{mname}-b{b}"] = {"gpu_us_per_step": tot, "median_step_ms": statistics.median(times[2:]) * 1e3,
                                       "kernels": [(k[:110], v[0] / 60, v[1] / 60) for k, v in top],
                                       "kernels_per_step": sum(v[0] for v in agg.values()) / 60}
    print(f"== {mname} b{b}: GPU kernel time {tot:.0f} us/step, median step {statistics.median(times[2:])*1e3:.2f} ms, "
          f"{sum(v[0] for v in agg.values())/60:.0f} kernels/step", flush=True)
    for k, v in top[:14]:
        print(f"   {v[1]/60:8.1f} us  x{v[0]/60:5.1f}  {k[:90]}", flush=True)
    for rep in range(2):
        times, _ = run(model, b, steps)
        med = statistics.median(times[2:]) * 1e3
        tps = b * len(times[2:]) / sum(times[2:])
        res["runs"].append({"model": mname, "batch": b, "rep": rep, "median_step_ms": med,
                            "tokens_per_s": tps, "step_ms": [round(x * 1e3, 3) for x in times]})
        lines.append(f"{mname:8s} b{b:<2d} rep{rep}: median step {med:7.3f} ms  {tps:8.1f} tok/s")
        print(lines[-1], flush=True)
    del model
    torch.cuda.empty_cache()
    json.dump(res, open(f"{OUT}/profile_step.json", "w"), indent=1)
print("\n".join(lines))
