"""Where the host time of eager ``model.generate`` goes (issue 35): a profile, not a benchmark.

Warm greedy ``model.generate`` over a real model (default SmolLM2-135M, bf16, a 6,000-token
prompt of the Britannica article) with transformers' ``DynamicCache`` and with a
``CompressedCache`` per recipe: per cache, ``cProfile``'s top functions by own time (the Python
that runs per decode step) and ``torch.profiler``'s host-side operator and CUDA-runtime counts
per generated token (launches, synchronisations, copies). GPU only (a CPU run profiles the
reference path, which is another program).

    python -m benchmarks.profile_eager --out DIR [--recipes kivi-2,PATH] [--batch 1] [--new-tokens 32]

Writes ``DIR/profile_<cache>.txt`` per cache and prints a short table of host ms per token.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path

import torch

from benchmarks.real_model import prompts, run_generate


def _profile(label: str, fn, new: int, batch: int, out: Path) -> dict:
    fn(new)  # warm-up: kernels compiled, allocator filled
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    fn(new)
    prof.disable()
    seconds = time.perf_counter() - t0
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats(r"kvcalib", 45)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as tp:
        fn(new)
    events = tp.key_averages()
    text.write("\n# torch.profiler, host self time, top 50\n")
    text.write(events.table(sort_by="self_cpu_time_total", row_limit=50))
    counts = {e.key: e.count for e in events}
    per_token = {k: counts.get(k, 0) / new for k in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                                                     "cudaStreamSynchronize", "cudaMemcpyAsync",
                                                     "cudaDeviceSynchronize", "aten::item", "aten::copy_",
                                                     "aten::_local_scalar_dense")}
    (out / f"profile_{label.replace('/', '_')}.txt").write_text(text.getvalue())
    row = {"cache": label, "batch": batch, "tokens": new, "ms_per_token": 1000 * seconds / new,
           **{f"{k}/token": round(v, 1) for k, v in per_token.items()}}
    print(row, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompt-len", type=int, default=6000)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--recipes", default="kivi-2")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    from transformers import DynamicCache

    from kvcalib.models import load_model
    from kvcalib.recipe import resolve_recipe
    from kvcalib.runtime.cache import CompressedCache

    args.out.mkdir(parents=True, exist_ok=True)
    loaded = load_model(args.model, device="cuda", dtype="bf16")
    model, tok = loaded.model, loaded.tokenizer
    ids = prompts(tok, args.batch, args.prompt_len).cuda()  # (B, L)
    rows = [_profile("bf16", lambda n: run_generate(model, ids, DynamicCache, n), args.new_tokens, args.batch, args.out)]
    for spec in [r for r in args.recipes.split(",") if r]:
        recipe = resolve_recipe(spec)
        rows.append(_profile(recipe.name, lambda n: run_generate(
            model, ids, lambda: CompressedCache.from_recipe(model, recipe), n), args.new_tokens, args.batch, args.out))
    print(f"\n{'cache':<28} {'ms/token':>9} {'launch/tok':>10} {'sync/tok':>9} {'item/tok':>9}")
    for r in rows:
        launches = r["cudaLaunchKernel/token"] + r["cuLaunchKernel/token"] + r["cuLaunchKernelEx/token"]
        print(f"{r['cache'][:28]:<28} {r['ms_per_token']:9.2f} {launches:10.1f} "
              f"{r['cudaStreamSynchronize/token']:9.1f} {r['aten::_local_scalar_dense/token']:9.1f}")


if __name__ == "__main__":
    main()
