"""RULER through lm-evaluation-harness: full precision, KIVI-2, KIVI-4 and given recipes at one context.

    python benchmarks/ruler.py --model smollm2-135m --context 8192 --device cuda \
        --recipe kivi-2 --recipe kivi-4 --recipe recipes/smollm2-135m/long-8192-3.0b-3bit/recipe.safetensors \
        [--tasks niah_single_1,niah_multikey_2,niah_multikey_3,ruler_vt,ruler_cwe,ruler_fwe] [--limit 50]

lm-eval builds each task's samples (RULER generates its haystacks locally, sized with the model's
tokenizer to ``--context`` tokens including the answer budget), formats the prompts, scores the
answers and writes its own files (``--output-path``, default ``artifacts/runs/ruler/<model>-<context>``:
results JSON and every sample with its generation). kvcalib runs generation through each recipe's
``CompressedCache`` (:mod:`kvcalib.eval.lm_eval_model`), full precision first, on the same samples
(checked through lm-eval's task hashes). ``--baselines`` (``kivi-2,kivi-4``) run beside the recipes;
full precision always runs, so a long list of recipes can be split over several commands with
``--baselines ''`` after the first (rows are merged). ``--batch-size 8`` batches generation (padded
rows: the compressed cache anchors each row at its first real token) and ``--max-gen-toks 32`` caps
the answers (RULER's answers are a few numbers or words; its default budget is 128).

Rows are merged into ``artifacts/results/ruler.json`` (a list of objects with ``model``,
``context``, ``recipe``, ``effective_bits`` (at ``context``), ``task``, ``metric``, ``score``,
``score_fp`` (full precision on the same samples), ``n`` (samples), ``prompts_sha256`` (lm-eval's
task hash, as in its results file), ``machine``, ``command``, ``lm_eval``, ``seconds``; the
full-precision row has ``recipe`` "full precision" and 16 bits; a rerun replaces the rows of the
same model/context/recipe/task) as soon as each recipe finishes, full precision first, and
``ruler.md`` is rewritten from it: a run killed by a time limit keeps the recipes it finished.

``--from-output DIR`` runs nothing: it reads the rows back from the results files lm-eval wrote
under DIR (an earlier run's ``--output-path``, perhaps killed part-way; lm-eval need not be
installed), with the same ``--model``/``--context``/``--recipe``/``--baselines``/``--tasks`` as that
run; recipes without a results file are skipped, and a recipe scored on other samples than full
precision (another task hash) is refused. ``--command`` and ``--machine`` record that run's command
and machine (default: this command and this machine)::

    python benchmarks/ruler.py --from-output /tmp/w/lm_a --model smollm2-135m --context 8192 \
        --tasks niah_single_1,niah_multikey_2 --recipe ... --machine "NVIDIA H200" --command "python ..."

``--merge FILE`` (repeatable) runs nothing either: it merges the rows of other runs' ``--out``
files (e.g. the GPU machine's, ``scripts/gpu_quality.sh``) into ``--out``.

``--no-fp`` skips the full-precision run: the rows carry ``score_fp`` null until a merge pairs each
with the full-precision row of the same model, context, task and samples (``prompts_sha256``; the
samples depend on ``--seed`` alone). Processes that share a GPU then score full precision once per
task, in a process of its own (``--baselines ''`` and no ``--recipe``), instead of once each.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python benchmarks/ruler.py` from the root

from benchmarks.long_context import OUT, ROOT, machine, recipe_label  # noqa: E402

BASELINES = ("kivi-2", "kivi-4")


def run(args: argparse.Namespace) -> list[dict]:
    """Runs lm-eval (or with ``--from-output`` reads an earlier run's files), saving each recipe's
    rows as soon as they exist; the rows of ``args.out`` afterwards."""
    from kvcalib.errors import KvcalibError
    from kvcalib.eval.tasks import TaskConfig, require_lm_eval, results_from_output, run_tasks

    baselines = [b.strip() for b in args.baselines.split(",") if b.strip()]
    recipes = list(dict.fromkeys([*baselines, *args.recipe]))
    output = (args.from_output or args.output_path
              or ROOT / "artifacts" / "runs" / "ruler" / f"{args.model}-{args.context}")
    config = TaskConfig(model=args.model, recipes=recipes, tasks=tuple(args.tasks.split(",")), context=args.context,
                        limit=args.limit, batch_size=args.batch_size, seed=args.seed, output_path=output,
                        max_gen_toks=args.max_gen_toks, device=args.device, dtype=args.dtype,
                        full_precision=not args.no_fp)
    command = args.command or " ".join(shlex.quote(a) for a in ["python", "benchmarks/ruler.py", *sys.argv[1:]])
    if args.no_fp and not recipes:
        raise KvcalibError("--no-fp with no recipe and --baselines '' would run nothing. Fix: name a --recipe, or "
                           "drop --no-fp to score full precision alone.")
    labels = {"full precision": "full precision", **{r: recipe_label(r) for r in recipes}}
    where = args.machine or machine()
    version = require_lm_eval() if args.from_output is None else ""  # --from-output: each file's own
    saved: list[dict] = []

    def save(results: list) -> None:
        rows = [{"model": args.model, "context": args.context, "recipe": labels.get(r.recipe, r.recipe),
                 "effective_bits": r.effective_bits, "task": r.task, "metric": r.metric, "score": r.score,
                 "score_fp": r.score_fp, "n": r.n, "prompts_sha256": r.prompts_sha256, "machine": where,
                 "command": command, "lm_eval": r.lm_eval or version, "seconds": r.seconds} for r in results]
        saved[:] = write(rows, args.out)

    if args.from_output is None:
        run_tasks(config, on_rows=save)
        return saved
    from kvcalib.models import load_model, model_info_offline

    info = model_info_offline(args.model) or load_model(args.model, device="cpu").info
    results, missing = results_from_output(config, info)
    if missing:
        print(f"ruler.py: no lm-eval results in {args.from_output} for {', '.join(missing)} (skipped: the run "
              "did not reach them)", file=sys.stderr)
    save(results)
    return saved


def write(rows: list[dict], path: Path) -> list[dict]:
    """``rows`` merged into ``path`` (see :func:`merge`) and ``ruler.md`` beside it rewritten; the
    merged rows."""
    from kvcalib.io import atomic_path

    merged = merge(rows, path)
    with atomic_path(path.with_suffix(".md")) as tmp:
        tmp.write_text(markdown(merged) + "\n")
    return merged


def merge(rows: list[dict], path: Path) -> list[dict]:
    """The file's rows with ``rows`` replacing those of the same model/context/recipe/task, each row
    without ``score_fp`` (a ``--no-fp`` run) paired with full precision's (:func:`pair_with_fp`)."""
    from benchmarks.long_context import merge as merge_rows

    merged = merge_rows(rows, path, key=lambda r: (r["model"], r["context"], r["recipe"], r["task"]),
                        order=lambda r: (r["model"], r["context"], r["task"], -r["effective_bits"], r["recipe"]))
    if pair_with_fp(merged):
        from kvcalib.io import write_json_atomic

        write_json_atomic(path, merged)
    return merged


def pair_with_fp(rows: list[dict]) -> int:
    """Fills, in place, the ``score_fp`` of rows that have none with the score of the full-precision
    row of the same model, context, task and samples (``prompts_sha256``); how many it filled. A row
    whose samples no full-precision row scored keeps None (its vs fp is left blank)."""
    fp = {(r["model"], r["context"], r["task"], r.get("prompts_sha256")): r["score"]
          for r in rows if r["recipe"] == "full precision" and r.get("prompts_sha256")}
    filled = 0
    for r in rows:
        key = (r["model"], r["context"], r["task"], r.get("prompts_sha256"))  # a row without a digest never pairs
        if r.get("score_fp") is None and key in fp:
            r["score_fp"] = fp[key]
            filled += 1
    return filled


def markdown(rows: list[dict]) -> str:
    """One table per model and context: a row per recipe, a column per task, and the mean. Where
    some recipe lacks a task (a run cut short), two means: over the tasks every recipe has (the
    comparable one) and over all tasks (for the recipes that have them all)."""
    out = ["# RULER through lm-evaluation-harness", "",
           "Generated from `ruler.json` by `benchmarks/ruler.py` (each row's command, machine and lm-eval version",
           "are in the JSON). Scores are lm-eval's RULER metric at the context (string match, 0-1); effective bits",
           "are counted at that context (bf16 = 16). Every row is paired with a full-precision run on its own",
           "samples (`score_fp`, same `prompts_sha256`); vs fp is the mean of score - score_fp over the mean's",
           "tasks. The full-precision row shown is one such run: rows made by other processes before",
           "2026-11-29 were scored on other samples (RULER's generation was not seeded per task then), so",
           "compare a recipe with full precision through vs fp, not across rows.", ""]
    for model, context in sorted({(r["model"], r["context"]) for r in rows}):
        part = [r for r in rows if (r["model"], r["context"]) == (model, context)]
        tasks = sorted({r["task"] for r in part})
        recipes = sorted({(r["effective_bits"], r["recipe"]) for r in part}, reverse=True)
        cells = {recipe: {r["task"]: r["score"] for r in part if r["recipe"] == recipe} for _, recipe in recipes}
        gaps = {recipe: {r["task"]: r["score"] - r["score_fp"] for r in part
                         if r["recipe"] == recipe and r.get("score_fp") is not None}
                for _, recipe in recipes}
        common = [t for t in tasks if all(t in c for c in cells.values())]
        means = [("mean", tasks)] if common == tasks else [(f"mean ({len(common)} common)", common),
                                                             (f"mean (all {len(tasks)})", tasks)]
        means = [(head, over) for head, over in means if over]
        n = sorted({r["n"] for r in part})
        out += [f"## {model}, {context} tokens ({'/'.join(map(str, n))} samples per task)", "",
                "| recipe | eff. bits | " + " | ".join([*tasks, *(head for head, _ in means),
                                                     *(head.replace("mean", "vs fp") for head, _ in means)]) + " |",
                "|---|---:|" + "---:|" * (len(tasks) + 2 * len(means))]
        for bits, recipe in recipes:
            got = cells[recipe]
            shown = [f"{got[t]:.3f}" if t in got else "" for t in tasks]
            shown += [f"{sum(got[t] for t in over) / len(over):.3f}" if all(t in got for t in over) else ""
                      for _, over in means]
            # vs fp beside each mean, over the same tasks (a run cut short keeps the common one)
            shown += [f"{sum(gaps[recipe][t] for t in over) / len(over):+.3f}"
                      if all(t in gaps[recipe] for t in over) else "" for _, over in means]
            out.append(f"| {recipe} | {bits:.3f} | " + " | ".join(shown) + " |")
        if common != tasks:
            note = f"{means[0][0]} averages {', '.join(common)}, the tasks every recipe ran; " if common else ""
            out += ["", "An empty cell: that recipe's run did not reach the task. " + note
                    + f"mean (all {len(tasks)}) averages every task, for the recipes that ran them all."]
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    from kvcalib.eval.tasks import DEFAULT_LIMIT, RULER_TASKS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--context", type=int, default=None, help="RULER sequence length (tokens; required unless --merge)")
    parser.add_argument("--recipe", action="append", default=[], help="preset or recipe file (repeatable)")
    parser.add_argument("--baselines", default=",".join(BASELINES),
                        help="presets run beside the recipes (comma-separated; '' for none: full precision always runs)")
    parser.add_argument("--tasks", default=",".join(RULER_TASKS))
    parser.add_argument("--limit", type=int, default=DEFAULT_LIMIT, help="samples per task")
    parser.add_argument("--max-gen-toks", type=int, default=None, help="cap on generated tokens (default: the task's)")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--no-fp", action="store_true",
                        help="skip full precision: rows are paired with a full-precision row of the same samples "
                             "when merged (processes sharing a GPU score it once, in a process of its own)")
    parser.add_argument("--output-path", type=Path, default=None, help="lm-eval's own files")
    parser.add_argument("--out", type=Path, default=OUT / "ruler.json")
    parser.add_argument("--from-output", type=Path, default=None, metavar="DIR",
                        help="read the rows from lm-eval's results files of an earlier run (its --output-path) "
                             "instead of running lm-eval")
    parser.add_argument("--command", default=None, help="with --from-output: the command of the run that wrote DIR")
    parser.add_argument("--machine", default=None,
                        help="with --from-output: the machine that ran it (default: this one)")
    parser.add_argument("--merge", type=Path, action="append", default=[], metavar="FILE",
                        help="merge the rows of these JSON files (another run's --out, e.g. a GPU machine's) "
                             "into --out instead of running")
    args = parser.parse_args(argv)
    if args.merge:
        from benchmarks.long_context import read_rows

        try:
            rows = read_rows(args.merge)
        except ValueError as err:
            parser.error(str(err))
        merged = write(rows, args.out)
        print(f"ruler.py: {len(merged)} rows in {args.out}")
        return
    if args.context is None:
        parser.error("--context is required (or --merge FILE)")
    if args.from_output is None and (args.command or args.machine):
        parser.error("--command and --machine describe the run whose files --from-output reads")
    from kvcalib.errors import KvcalibError

    try:
        rows = run(args)
    except KvcalibError as err:
        print(f"ruler.py: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    for r in rows:
        print(f"{r['model']} {r['context']:>6} {r['task']:<16} {r['recipe']:<50} {r['effective_bits']:6.3f} bits  "
              f"{r['score']:.3f} (fp {'-' if r['score_fp'] is None else format(r['score_fp'], '.3f')}, n={r['n']})")


if __name__ == "__main__":
    main()
