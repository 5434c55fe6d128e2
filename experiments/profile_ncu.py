"""The split kernel under Nsight Compute: where its time goes (GPU only, needs ``ncu``).

Runs one decode-attention call per (shape, layout) of ``$NCU_CASES`` (``model:batch:context:bits:
k_group:v_group``, comma-separated; default the grid's headline row, Mistral-7B shape batch 8 / 32k
at 2 and 4 bits, group 128) after a warm-up, each between ``cudaProfilerStart`` / ``Stop`` so
``ncu --profile-from-start off`` sees only those calls. ``scripts/gpu_bench.sh ncu`` runs it under
``ncu`` (full section set, clocks left alone) and writes the details and SASS-level source
counters (stall reasons per instruction) under ``$OUT``; ``--summarize DIR`` reads those exports
(``ncu_raw.csv``, ``ncu_source.csv``) and writes ``DIR/ncu_split.json``: per profiled call its
duration, occupancy, issue rate, the warp stall reasons per issued instruction, and the SASS
instructions with the most stall samples, in the main loop and in the whole kernel (with how
often each ran: a key group's fold runs every other block, outside the loop's most-run lines).

    ncu --profile-from-start off -k regex:_decode_split_kernel --set full --clock-control none \\
        -o $OUT/split python -m experiments.profile_ncu
    python -m experiments.profile_ncu --summarize $OUT
"""
import csv
import json
import os
import sys
from collections import Counter
from pathlib import Path

RAW_METRICS = {  # json key: ncu raw metric
    "duration_us": "gpu__time_duration.sum",
    "registers_per_thread": "launch__registers_per_thread",
    "achieved_warps_per_sm": "sm__warps_active.avg.per_cycle_active",
    "issue_slots_busy_pct": "sm__inst_issued.avg.pct_of_peak_sustained_elapsed",
    "warp_cycles_per_issue": "smsp__average_warp_latency_per_inst_issued.ratio",
    "dram_throughput_pct": "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
    "instructions": "smsp__inst_executed.sum",
    # what bounds the programs an SM holds (one warp a program): shared memory or registers
    "smem_dynamic_per_program": "launch__shared_mem_per_block_dynamic",
    "smem_static_per_program": "launch__shared_mem_per_block_static",
    "programs_per_sm_limit_smem": "launch__occupancy_limit_shared_mem",
    "programs_per_sm_limit_registers": "launch__occupancy_limit_registers",
    "l1_hit_pct": "l1tex__t_sector_hit_rate.pct",
}
STALL_PREFIX = "smsp__average_warps_issue_stalled_"
STALL_SUFFIX = "_per_issue_active.ratio"


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def summarize(out: Path) -> dict:
    """ncu_split.json from the raw-page and source-page CSV exports under ``out``."""
    rows = list(csv.reader((out / "ncu_raw.csv").open()))
    header, calls = rows[0], rows[2:]  # (row 1: units)
    col = {name: i for i, name in enumerate(header)}
    cases = CASES.split(",")
    result = {"cases": []}
    kernels = _source_kernels(out / "ncu_source.csv")
    for i, row in enumerate(calls):
        entry = {"case": cases[i] if i < len(cases) else f"call {i}"}
        for key, metric in RAW_METRICS.items():
            if metric in col:
                entry[key] = _number(row[col[metric]])
        if entry.get("duration_us") is not None and "nsecond" in rows[1][col[RAW_METRICS["duration_us"]]]:
            entry["duration_us"] /= 1e3
        stalls = {}
        for name, j in col.items():
            if name.startswith(STALL_PREFIX) and name.endswith(STALL_SUFFIX) and "_not_issued" not in name:
                v = _number(row[j])
                if v:
                    stalls[name[len(STALL_PREFIX):-len(STALL_SUFFIX)]] = round(v, 3)
        entry["stall_cycles_per_issue"] = dict(sorted(stalls.items(), key=lambda kv: -kv[1]))
        if i < len(kernels):
            entry.update(kernels[i])
        result["cases"].append(entry)
    (out / "ncu_split.json").write_text(json.dumps(result, indent=1))
    return result


def _source_kernels(path: Path) -> list[dict]:
    """Per profiled call: the main loop (the instructions executed most often) and the SASS
    instructions with the most warp stall samples, in it and in the whole kernel."""
    kernels, cur, header = [], None, None
    for row in csv.reader(path.open()):
        if row and row[0] == "Kernel Name":
            cur = []
            kernels.append(cur)
        elif row and row[0] == "Address":
            header = {name: i for i, name in enumerate(row)}
        elif cur is not None and row:
            cur.append(row)
    out = []
    for rows in kernels:
        def val(r, name):
            return _number(r[header[name]]) or 0.0 if name in header else 0.0
        executed = [int(val(r, "Instructions Executed")) for r in rows]
        loop_count = max(Counter(e for e in executed if e).items(), key=lambda kv: kv[0] * kv[1])[0]
        loop = [r for r, e in zip(rows, executed) if e == loop_count]
        total = sum(val(r, "Warp Stall Sampling (All Samples)") for r in rows)
        in_loop = sum(val(r, "Warp Stall Sampling (All Samples)") for r in loop)
        reasons = [n for n in header if n.startswith("stall_") and "(Not Issued)" not in n]

        def top(lines):
            lines = sorted(lines, key=lambda r: -val(r, "Warp Stall Sampling (All Samples)"))[:10]
            return [{
                "sass": r[header["Source"]].strip(), "executions": int(val(r, "Instructions Executed")),
                "share_of_samples": round(val(r, "Warp Stall Sampling (All Samples)") / max(total, 1), 4),
                "reasons": {n[6:]: int(val(r, n)) for n in reasons if val(r, n) >= 0.1 * val(
                    r, "Warp Stall Sampling (All Samples)") and val(r, n) > 0}} for r in lines]

        out.append({
            "loop_instructions": len(loop), "loop_executions": loop_count,
            "stall_samples": total, "stall_samples_in_loop": in_loop,
            "top_loop_instructions": top(loop), "top_instructions": top(rows),
        })
    return out

CASES = os.environ.get("NCU_CASES", "mistral-7b:8:32768:2:128:128,mistral-7b:8:32768:4:128:128")


def main() -> None:
    import torch

    from benchmarks.common import MODELS, WINDOW, kernel_call, packed_inputs

    dev = torch.device("cuda")
    for case in CASES.split(","):
        model, b, ctx, bits, kg, vg = case.split(":")
        b, ctx, bits, kg, vg = int(b), int(ctx), int(bits), int(kg), int(vg)
        hq, h, d = MODELS[model]
        n = ctx - WINDOW
        q = torch.randn(b, hq, d, device=dev, dtype=torch.bfloat16)  # (B, Hq, D)
        packed = packed_inputs(b, h, n, d, bits, kg, vg, dev)
        window = (torch.randn(b, h, WINDOW, d, device=dev, dtype=torch.bfloat16),  # (B, H, W, D)
                  torch.randn(b, h, WINDOW, d, device=dev, dtype=torch.bfloat16))
        fn = kernel_call(q, packed, window, bits, kg, vg, n, d ** -0.5, None)
        for _ in range(3):  # compile and warm up outside the profiled range
            fn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        fn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        print(f"profiled {case}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--summarize":
        summary = summarize(Path(sys.argv[2]))
        for c in summary["cases"]:
            print(f"{c['case']}: {c.get('duration_us', float('nan')):.1f} us, issue {c.get('issue_slots_busy_pct')}% busy, "
                  f"{c.get('warp_cycles_per_issue')} cycles/issue: {c['stall_cycles_per_issue']}")
    else:
        main()
