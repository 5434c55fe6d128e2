"""The search curve benchmark (issue 5's targets): searched recipes at several memory budgets
against the presets, on held-out perplexity. ``scripts/search_curve.sh MODEL`` drives it:

1. ``python -m benchmarks.search_curve plan --model M --run RUN`` writes ``RUN/curve-plan.json``
   and prints one ``LABEL BUDGET`` line per budget (:func:`curve_budgets`): KIVI-2's and KIVI-4's
   effective bits exactly (``Recipe.memory`` on the model's geometry), per-token-4's, 3.0 (the
   issue's "within 1% at <= 3.0 bits"), 4.0, and just above the floor of the search space;
2. the script collects statistics once (``RUN/stats``), runs ``kvcalib search --budget-bits B``
   for each budget in ``RUN/budget-LABEL`` (a constrained search spends its trials at its
   budget; ``scripts/search_front.py`` compares it with one ``--objective pareto`` study),
   exports each chosen point with ``kvcalib export RUN/budget-LABEL --budget-bits B -o
   RUN/points/LABEL.safetensors`` and evaluates all of them with the presets in one
   ``kvcalib eval`` call (identical held-out inputs) into ``RUN/eval.json``;
3. ``python -m benchmarks.search_curve report --run RUN`` (:func:`write_curve`) writes
   ``search-curve-<model>.json``, ``.png`` (held-out ppl delta vs effective bits: the searched
   points as a line, presets as marked points) and ``.md`` (the table, every searched point
   against every preset at equal memory, and the issue's targets, met or not) into
   ``artifacts/results``.

Effective bits are in ``kvcalib.layout.ACCOUNTING`` (bf16 = 16 on every model); the plan and the
curve document record it. A searched point is compared with a preset only where the preset holds
the same or more bits (:func:`kvcalib.optimize.report.at_equal_memory`); a cheaper preset is
"not comparable (fewer bits)" and a target judged on one is not met or missed but not comparable.

Paths in the outputs are relative (:mod:`.provenance`). Matplotlib is imported inside the plot.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Sequence

from kvcalib.errors import KvcalibError
from kvcalib.layout import ACCOUNTING

PLAN = "curve-plan.json"
CURVE_PRESETS = ("fp16", "kivi-2", "kivi-4", "pertoken-4")
TARGET_FP_BITS = 3.0  # issue 5: a recipe at <= 3.0 effective bits within 1% of full precision
TARGET_FP_PCT = 1.0


# ------------------------------------------------------------------ budgets
def curve_budgets(preset_bits: dict[str, float], floor: float, extra: Sequence[float] = ()) -> list[tuple[str, float]]:
    """``(label, budget)`` pairs by increasing budget: every preset's effective bits (label = the
    preset, the budget exactly its bits), 3.0 and 4.0, just above ``floor`` (the cheapest point
    of the search space; the search refuses budgets below it), and ``extra``. Budgets under the
    floor and 16-bit presets are left out; equal budgets keep the first label (a preset's)."""
    cands: list[tuple[str, float]] = [(name, float(b)) for name, b in preset_bits.items() if b < 16.0]
    cands += [(_label(b), float(b)) for b in (math.ceil((floor + 0.1) * 100) / 100, 3.0, 4.0, *extra)]
    out: dict[float, str] = {}
    for label, b in cands:
        if b >= floor - 1e-9 and not any(abs(b - o) < 1e-9 for o in out):
            out[b] = label
    return sorted(((label, b) for b, label in out.items()), key=lambda p: p[1])


def _label(b: float) -> str:
    return f"{b:.2f}b"


def preset_effective_bits(model: str, presets: Sequence[str] = CURVE_PRESETS, context: int = 4096) -> dict[str, float]:
    """Each preset's effective bits on ``model``'s geometry (config only, no weights)."""
    from kvcalib.inspect import inspect_recipe

    return {p: float(inspect_recipe(p, model=model, context=context)["memory"]["effective_bits"]) for p in presets}


def space_floor_bits(model: str, space_file: str | None = None, context: int = 4096) -> float:
    """Effective bits of the cheapest point of the search space (default space, or ``space_file``)."""
    from kvcalib.inspect import inspect_recipe
    from kvcalib.models import ModelInfo
    from kvcalib.optimize.space import SearchSpace
    from kvcalib.recipe import Recipe

    info = ModelInfo.from_dict(inspect_recipe("fp16", model=model, context=context)["model"])
    space = SearchSpace.from_file(space_file) if space_file else SearchSpace()
    point = space.floor_point(info.num_layers)
    return Recipe(name="floor", layers=point.layer_configs(), model=info).memory(info, context).effective_bits


def write_plan(run: Path, model: str, budgets: list[tuple[str, float]], preset_bits: dict[str, float],
               settings: dict[str, Any], context: int = 4096) -> dict[str, Any]:
    from kvcalib.io import write_json_atomic

    plan = {"format": "kvcalib-search-curve-plan", "accounting": ACCOUNTING, "model": model, "context": context,
            "budgets": [{"label": label, "budget": b} for label, b in budgets],
            "preset_bits": preset_bits, "settings": settings}
    Path(run).mkdir(parents=True, exist_ok=True)
    write_json_atomic(Path(run) / PLAN, plan)
    return plan


# ------------------------------------------------------------------ report
def collect_curve(run: Path) -> dict[str, Any]:
    """The curve document from a finished ``RUN`` (plan, each budget's ``search.json``, ``eval.json``)."""
    from kvcalib.optimize.provenance import display_path

    run = Path(run)
    try:
        plan = json.loads((run / PLAN).read_text())
        results = json.loads((run / "eval.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise KvcalibError(f"{run} is not a finished search-curve run ({err}): run scripts/search_curve.sh") from None
    check_accounting(plan, run)
    by_recipe = {Path(r["recipe"]).name if r["recipe"].endswith(".safetensors") else r["recipe"]: r for r in results}
    fp = next((r for r in results if r["name"] == "fp16"), None)
    points = []
    for item in plan["budgets"]:
        label, budget = item["label"], float(item["budget"])
        res = by_recipe.get(f"{label}.safetensors")
        search_path = run / f"budget-{label}" / "search.json"
        search = json.loads(search_path.read_text()) if search_path.is_file() else {}
        chosen = next((t for t in search.get("trials", []) if t["number"] == search.get("chosen")), None)
        points.append({
            "label": label, "budget": budget, "matches": label if label in plan["preset_bits"] else None,
            "effective_bits": res["effective_bits"] if res else (chosen or {}).get("effective_bits"),
            "search_kl": (chosen or {}).get("kl"), "trial": search.get("chosen"),
            "trials": len(search.get("trials", [])), "search_seconds": search.get("seconds"),
            "ppl": res.get("ppl") if res else None, "ppl_delta_pct": res.get("ppl_delta_pct") if res else None,
            "recipe": f"points/{label}.safetensors", "search_run": f"budget-{label}",  # in the run folder
            "point": (chosen or {}).get("point"),
        })
    presets = [{"name": r["name"], "effective_bits": r["effective_bits"], "ppl": r.get("ppl"),
                "ppl_delta_pct": r.get("ppl_delta_pct")}
               for r in results if r["recipe"] in CURVE_PRESETS or r["name"] in CURVE_PRESETS]
    doc = {"format": "kvcalib-search-curve", "version": 2, "accounting": ACCOUNTING, "model": plan["model"],
           "context": plan["context"],
           "settings": plan.get("settings", {}), "run": display_path(run),  # recipe/search_run paths are in it
           "ppl_fp": fp.get("ppl") if fp else next((r.get("ppl_fp") for r in results if r.get("ppl_fp")), None),
           "points": points, "presets": presets}
    doc["targets"] = targets(doc)
    doc["comparisons"] = comparisons(doc)
    return doc


def check_accounting(plan: dict[str, Any], run: Path) -> None:
    """Refuse a run planned with another accounting whose numbers differ from today's. A plan
    without the field was made with the first accounting (every layer at the full context); its
    numbers are today's exactly when the fp16 preset was 16.0 bits there (no sliding-window layer
    holds fewer tokens than the context)."""
    from kvcalib.layout import LEGACY_ACCOUNTING

    accounting = plan.get("accounting", LEGACY_ACCOUNTING)
    if accounting == ACCOUNTING:
        return
    fp16 = (plan.get("preset_bits") or {}).get("fp16")
    if accounting == LEGACY_ACCOUNTING and fp16 is not None and float(fp16) == 16.0:
        return
    raise KvcalibError(f"{run} was planned with the {accounting!r} accounting (fp16 at {fp16} bits), whose budgets "
                       f"and bits differ from today's {ACCOUNTING!r} on this model: run scripts/search_curve.sh again "
                       "in a new run folder.")


def comparisons(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Every searched point against every preset, at equal memory: the verdict of
    :func:`kvcalib.optimize.report.at_equal_memory` on held-out Δppl (``not comparable (fewer
    bits)`` where the preset holds fewer bits than the point)."""
    from kvcalib.optimize.report import at_equal_memory

    out = []
    for p in doc["points"]:
        if p.get("effective_bits") is None:
            continue
        for q in doc["presets"]:
            out.append({"point": p["label"], "preset": q["name"], "point_bits": p["effective_bits"],
                        "preset_bits": q["effective_bits"], "point_ppl_delta_pct": p.get("ppl_delta_pct"),
                        "preset_ppl_delta_pct": q.get("ppl_delta_pct"),
                        "verdict": at_equal_memory(p["effective_bits"], p.get("ppl_delta_pct"), q["effective_bits"],
                                                   q.get("ppl_delta_pct"))})
    return out


def targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 5's three held-out targets, each with the numbers it was judged on and ``met``
    (None where a number is missing)."""
    from kvcalib.optimize.report import NOT_COMPARABLE, at_equal_memory

    pts = {p["label"]: p for p in doc["points"]}
    pre = {p["name"]: p for p in doc["presets"]}
    out = []
    for name, rule in (("kivi-2", "lower"), ("kivi-4", "lower or equal")):
        p, q = pts.get(name), pre.get(name)
        ok, comparable = None, None
        if p and q and p.get("effective_bits") is not None and q.get("effective_bits") is not None:
            comparable = at_equal_memory(p["effective_bits"], None, q["effective_bits"], None) != NOT_COMPARABLE
        if comparable and p.get("ppl") is not None and q.get("ppl") is not None:
            ok = p["ppl"] < q["ppl"] if rule == "lower" else p["ppl"] <= q["ppl"]
        out.append({"target": f"searched at {name}'s effective bits has {rule} held-out ppl than {name}",
                    "searched_ppl": p.get("ppl") if p else None, "preset_ppl": q.get("ppl") if q else None,
                    "effective_bits": p.get("effective_bits") if p else None,
                    "preset_bits": q.get("effective_bits") if q else None, "comparable": comparable, "met": ok})
    under = [p for p in doc["points"] if p.get("effective_bits") is not None and p["effective_bits"] <= TARGET_FP_BITS + 1e-9
             and p.get("ppl_delta_pct") is not None]
    best = min(under, key=lambda p: p["ppl_delta_pct"], default=None)
    out.append({"target": f"a searched recipe at <= {TARGET_FP_BITS:g} effective bits within {TARGET_FP_PCT:g}% of full-precision ppl",
                "best_label": best["label"] if best else None,
                "ppl_delta_pct": best["ppl_delta_pct"] if best else None,
                "effective_bits": best["effective_bits"] if best else None,
                "met": (best["ppl_delta_pct"] <= TARGET_FP_PCT) if best else None})
    return out


def markdown(doc: dict[str, Any]) -> str:
    """The curve table (searched points and presets by effective bits) and the targets."""
    from kvcalib.optimize.report import markdown_table

    def num(v, nd=3):
        return "-" if v is None else round(float(v), nd)

    rows = [[f"searched @ {p['label']}", num(p["budget"], 5), num(p["effective_bits"]), num(p["search_kl"], 5),
             num(p["ppl"]), num(p["ppl_delta_pct"]), f"{p['trial']} of {p['trials']}" if p["trial"] is not None else "-"]
            for p in doc["points"]]
    rows += [[p["name"], "-", num(p["effective_bits"]), "-", num(p["ppl"]), num(p["ppl_delta_pct"]), "-"]
             for p in doc["presets"]]
    rows.sort(key=lambda r: (r[2] if isinstance(r[2], float) else math.inf, r[0]))
    s = doc.get("settings", {})
    lines = [f"# Search curve: {doc['model']}", "",
             f"Held-out decode-faithful perplexity ({s.get('ppl_samples', '?')} x {s.get('ppl_seq_len', '?')} tokens of the "
             f"evaluation split) of the recipe each `kvcalib search --budget-bits B` chose ({s.get('trials', '?')} trials, "
             f"KL on {s.get('score_samples', '?')} x {s.get('seq_len', '?')} held calibration tokens, statistics from "
             f"{s.get('samples', '?')} x {s.get('seq_len', '?')}), and the presets; effective bits at context "
             f"{doc['context']}, everything counted. Full-precision ppl: {num(doc.get('ppl_fp'))}.", "",
             markdown_table(["recipe", "budget", "eff. bits", "search KL", "held-out ppl", "Δppl %", "trial"], rows), ""]
    names = [q["name"] for q in doc["presets"]]
    cells = {(c["point"], c["preset"]): c["verdict"] for c in doc.get("comparisons", [])}
    labelled = [p for p in doc["points"] if any((p["label"], n) in cells for n in names)]
    if labelled:
        lines += ["## At equal memory", "",
                  "Each searched point against each preset on held-out Δppl, from the searched point's side: a preset "
                  "is compared only where it holds the same or more effective bits.", "",
                  markdown_table(["searched", *names], [[f"@ {p['label']} ({num(p['effective_bits'])} bits)",
                                                         *[cells.get((p["label"], n), "-") for n in names]]
                                                        for p in labelled]), ""]
    lines += ["## Issue 5 targets", ""]
    for t in doc["targets"]:
        mark = "not comparable (the preset holds fewer bits)" if t.get("comparable") is False else \
            {True: "met", False: "not met", None: "not measured"}[t["met"]]
        detail = ", ".join(f"{k} {num(v, 4) if isinstance(v, float) else v}" for k, v in t.items()
                           if k not in ("target", "met", "comparable") and v is not None)
        lines.append(f"- {t['target']}: **{mark}** ({detail})")
    lines += ["", f"Made by `scripts/search_curve.sh {doc['model']}`; run folder `{doc['run']}`.", ""]
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: Path) -> None:
    """Held-out ppl delta (%) vs effective bits: searched points as a line, presets as squares."""
    from kvcalib.io import atomic_path
    from kvcalib.optimize.report import _plt

    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    pts = sorted((p for p in doc["points"] if p.get("ppl_delta_pct") is not None and p.get("effective_bits") is not None),
                 key=lambda p: p["effective_bits"])
    if pts:
        ax.plot([p["effective_bits"] for p in pts], [p["ppl_delta_pct"] for p in pts], marker="o", c="tab:blue",
                label="searched (one search per budget)")
    for p in doc["presets"]:
        if p.get("ppl_delta_pct") is None or p["effective_bits"] >= 16.0:
            continue
        ax.scatter([p["effective_bits"]], [p["ppl_delta_pct"]], marker="s", s=50, c="tab:red", zorder=5)
        ax.annotate(p["name"], (p["effective_bits"], p["ppl_delta_pct"]), textcoords="offset points", xytext=(5, 4),
                    fontsize=8)
    ax.axhline(TARGET_FP_PCT, ls=":", c="0.5", lw=1, label=f"{TARGET_FP_PCT:g}% of full precision")
    ax.axvline(TARGET_FP_BITS, ls="--", c="0.7", lw=1)
    ax.set_yscale("symlog", linthresh=0.1)  # deltas span 0.1% to tens of %, and can be slightly negative
    ys = [p["ppl_delta_pct"] for p in pts] + [p["ppl_delta_pct"] for p in doc["presets"]
                                              if p.get("ppl_delta_pct") is not None and p["effective_bits"] < 16.0]
    if ys:
        ax.set_ylim(min(0.0, 1.5 * min(ys)), 2.0 * max(max(ys), TARGET_FP_PCT))
    ax.set_xlabel(f"effective bits per element (context {doc['context']}, everything counted; bf16 = 16)")
    ax.set_ylabel("held-out perplexity vs full precision (%)")
    ax.set_title(f"{doc['model']}: searched recipes vs presets (held-out)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(Path(path)) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def write_curve(run: Path, out_dir: Path = Path("artifacts/results")) -> dict[str, Path]:
    """``search-curve-<model>.json``, ``.png`` and ``.md`` in ``out_dir`` from a finished run."""
    from kvcalib.io import atomic_path, write_json_atomic

    doc = collect_curve(run)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"search-curve-{doc['model']}"  # not Path.with_suffix: "qwen2.5-coder-0.5b" has a dot
    paths = {ext: out_dir / f"{stem}.{ext}" for ext in ("json", "png", "md")}
    write_json_atomic(paths["json"], doc)
    plot(doc, paths["png"])
    text = markdown(doc).replace("## Issue 5 targets", f"![curve]({paths['png'].name})\n\n## Issue 5 targets", 1)
    with atomic_path(paths["md"]) as tmp:
        tmp.write_text(text)
    return paths


# ------------------------------------------------------------------ command line (for the script)
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.search_curve", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan", help="write RUN/curve-plan.json and print 'LABEL BUDGET' lines")
    p.add_argument("--model", required=True)
    p.add_argument("--run", required=True, type=Path)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--space", default=None, help="search space file the searches use (for the floor)")
    p.add_argument("--extra-budgets", default="", help="more budgets, space-separated")
    p.add_argument("--setting", action="append", default=[], metavar="KEY=VALUE", help="recorded in the plan")
    r = sub.add_parser("report", help="write the curve JSON, PNG and markdown from a finished run")
    r.add_argument("--run", required=True, type=Path)
    r.add_argument("--out-dir", type=Path, default=Path("artifacts/results"))
    args = parser.parse_args(argv)
    try:
        if args.cmd == "plan":
            bits = preset_effective_bits(args.model, context=args.context)
            floor = space_floor_bits(args.model, args.space, args.context)
            extra = [float(x) for x in args.extra_budgets.split()]
            budgets = curve_budgets(bits, floor, extra)
            settings = dict(kv.split("=", 1) for kv in args.setting)
            settings = {k: int(v) if v.isdigit() else v for k, v in settings.items()}
            write_plan(args.run, args.model, budgets, bits, {**settings, "floor_bits": floor}, args.context)
            for label, b in budgets:
                print(label, repr(b))
        else:
            paths = write_curve(args.run, args.out_dir)
            print(paths["md"].read_text())
            print("\n".join(f"{k}: {v}" for k, v in paths.items()), file=sys.stderr)
    except (KvcalibError, ValueError) as err:
        print(f"kvcalib: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
