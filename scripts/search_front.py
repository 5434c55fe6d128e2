#!/usr/bin/env python3
"""The whole front in one study against one search per budget, at the same total trials (issue 37).

    python scripts/search_front.py --model smollm2-135m --trials 39 --budgets 3.0,kivi-2,kivi-4

1. statistics collected once (``kvcalib collect``), copied into every search's run folder, so
   every search scores the same objective;
2. one ``kvcalib search --objective pareto --trials T`` (budget 3.0: the recipe it writes; its
   warm start covers [floor, 6] bits);
3. one ``kvcalib search --budget-bits B --trials T/len(budgets)`` per budget (the constrained
   search of ``scripts/search_curve.sh``), the same total trial count;
4. ``kvcalib export RUN --budget-bits B`` from the Pareto run and from each per-budget run, then
   one ``kvcalib eval --metrics ppl`` over every exported point and the presets on identical
   held-out sequences of the evaluation split;
5. ``RUN/front.json`` and a markdown table on stdout (``--md FILE`` writes it too): per budget,
   the held-out perplexity of the Pareto front's point and of the per-budget search's, and each
   search's wall time.

Budgets: numbers, or a preset name for that preset's effective bits on the model exactly
(``python -m benchmarks.search_curve plan`` computes them). Run from the repository root with the
project's environment (``kvcalib`` on PATH).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path


def sh(args: list[str], log: Path) -> float:
    """Run ``args`` (stdout and stderr into ``log``); its wall seconds. Exits on failure."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        done = subprocess.run(args, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode:
        sys.exit(f"{' '.join(args)} failed ({done.returncode}); see {log}")
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--trials", type=int, default=39, help="total trials: the Pareto study's, split evenly among the budgets")
    ap.add_argument("--budgets", default="3.0,kivi-2,kivi-4")
    ap.add_argument("--pareto-budget", type=float, default=3.0, help="--budget-bits of the Pareto run")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--score-samples", type=int, default=2)
    ap.add_argument("--ppl-samples", type=int, default=8)
    ap.add_argument("--ppl-seq-len", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--run", type=Path, default=None)
    ap.add_argument("--md", type=Path, default=None)
    args = ap.parse_args()
    run = args.run or Path(f"artifacts/runs/front-{args.model}-{time.strftime('%Y%m%d-%H%M%S')}")
    run.mkdir(parents=True, exist_ok=True)
    from benchmarks.search_curve import preset_effective_bits
    from kvcalib.recipe import Recipe

    preset_bits = preset_effective_bits(args.model)
    budgets = [(b, preset_bits[b] if b in preset_bits else float(b)) for b in args.budgets.split(",")]
    per = args.trials // len(budgets)
    common = ["--model", args.model, "--data", "embedded", "--samples", str(args.samples), "--seq-len", str(args.seq_len),
              "--score-samples", str(args.score_samples), "--seed", str(args.seed), "--no-eval"]
    stats = run / "stats"
    if not (stats / "stats.safetensors").is_file():
        sh(["kvcalib", "collect", "--model", args.model, "--data", "embedded", "--samples", str(args.samples),
            "--seq-len", str(args.seq_len), "--block-len", str(min(128, args.seq_len)), "--seed", str(args.seed),
            "--out", str(stats)], run / "collect.log")

    def search(name: str, extra: list[str]) -> float:
        folder = run / name
        if (folder / "search.json").is_file():
            return json.loads((folder / "search.json").read_text())["seconds"]
        folder.mkdir(exist_ok=True)
        for f in ("stats.safetensors", "run.json"):
            shutil.copy2(stats / f, folder / f)
        return sh(["kvcalib", "search", *common, "--out", str(folder), *extra], run / f"{name}.log")

    seconds = {"pareto": search("pareto", ["--objective", "pareto", "--trials", str(per * len(budgets)),
                                           "--budget-bits", str(args.pareto_budget)])}
    recipes = []
    for label, b in budgets:
        seconds[label] = search(f"budget-{label}", ["--budget-bits", repr(b), "--trials", str(per)])
        for src in ("pareto", f"budget-{label}"):
            out = run / "points" / f"{src}@{label}.safetensors"
            out.parent.mkdir(exist_ok=True)
            sh(["kvcalib", "export", str(run / src), "--budget-bits", repr(b), "-o", str(out), "--force"],
               run / "export.log")
            recipes += ["--recipe", str(out)]
    if not (run / "eval.json").is_file():
        sh(["kvcalib", "eval", "--model", args.model, *recipes, "--preset", "fp16", "--preset", "kivi-2",
            "--preset", "kivi-4", "--preset", "pertoken-4", "--metrics", "ppl", "--ppl-samples", str(args.ppl_samples),
            "--ppl-seq-len", str(args.ppl_seq_len), "--json", str(run / "eval.json")], run / "eval.log")
    results = {Path(r["recipe"]).stem if r["recipe"].endswith(".safetensors") else r["recipe"]: r
               for r in json.loads((run / "eval.json").read_text())}
    docs = {name: json.loads((run / name / "search.json").read_text())
            for name in ["pareto", *(f"budget-{label}" for label, _ in budgets)]}
    rows = []
    for label, b in budgets:
        row = {"budget": label, "budget_bits": b}
        for src, key in (("pareto", "pareto"), (f"budget-{label}", "per_budget")):
            r = results[f"{src}@{label}"]
            number = Recipe.load(run / "points" / f"{src}@{label}.safetensors").provenance.get("trial")
            trial = next((t for t in docs[src]["trials"] if t["number"] == number), None)
            row[key] = {"effective_bits": r["effective_bits"], "ppl": r["ppl"], "ppl_delta_pct": r["ppl_delta_pct"],
                        "search_kl": trial["kl"] if trial else None, "trial": trial["number"] if trial else None}
        if label in results:
            row["preset"] = {"effective_bits": results[label]["effective_bits"], "ppl": results[label]["ppl"],
                             "ppl_delta_pct": results[label]["ppl_delta_pct"]}
        rows.append(row)
    front = {"model": args.model, "trials_total": per * len(budgets), "trials_per_budget": per,
             "settings": vars(args) | {"run": str(run), "md": str(args.md) if args.md else None},
             "ppl_fp": next((r["ppl"] for r in results.values() if r["name"] == "fp16"), None),
             "seconds": seconds, "pareto_front_size": len(docs["pareto"]["pareto"]), "rows": rows,
             "command": " ".join(["python", "scripts/search_front.py", *sys.argv[1:]])}
    (run / "front.json").write_text(json.dumps(front, indent=2) + "\n")
    md = markdown(front)
    print(md)
    if args.md:
        args.md.write_text(md)
    return 0


def markdown(front: dict) -> str:
    def n(v, d=3):
        return "-" if v is None else f"{v:.{d}f}"

    lines = ["| budget | Pareto study: eff. bits | Δppl % | per-budget search: eff. bits | Δppl % | preset Δppl % | better |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in front["rows"]:
        p, q = r["pareto"], r["per_budget"]
        better = "tie" if p["ppl"] == q["ppl"] else ("Pareto" if p["ppl"] < q["ppl"] else "per-budget")
        lines.append(f"| {r['budget']} ({r['budget_bits']:.3f}) | {n(p['effective_bits'])} | {n(p['ppl_delta_pct'], 2)} | "
                     f"{n(q['effective_bits'])} | {n(q['ppl_delta_pct'], 2)} | "
                     f"{n(r.get('preset', {}).get('ppl_delta_pct'), 2)} | {better} |")
    s = front["seconds"]
    per = sum(v for k, v in s.items() if k != "pareto")
    lines += ["", f"{front['trials_total']} trials in the Pareto study ({s['pareto']:.0f} s, front of "
              f"{front['pareto_front_size']} trials) against {len(front['rows'])} searches of "
              f"{front['trials_per_budget']} trials ({per:.0f} s together); full-precision ppl {n(front['ppl_fp'])}."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
