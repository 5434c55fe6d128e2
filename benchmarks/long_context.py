"""Quality at long context: held-out perplexity (overall and by position) and passkey retrieval of
recipes beside full precision, on identical inputs, at the contexts where the cache is large.

    python benchmarks/long_context.py --model smollm2-135m --context 4096 --context 8192 \
        --recipe kivi-2 --recipe kivi-4 --recipe recipes/smollm2-135m/long-8k-3.0/recipe.safetensors \
        [--ppl-samples 4] [--passkey-depths 0.1,0.5,0.9] [--passkey-trials 2] [--metrics ppl,passkey]

Perplexity: ``--ppl-samples`` windows of exactly ``context`` tokens from the *evaluation* split of
``--data longtext`` (the Britannica article; calibration uses Milton, never this text); effective
bits are accounted at that same context. Passkey: prompts of exactly ``context`` tokens, the key at
each depth, the question asked after the context is compressed (``split`` mode).

Every row is merged into ``artifacts/results/long_context.json`` (a list of objects with keys
``model``, ``context``, ``recipe``, ``effective_bits``, ``metric`` ("ppl" | "passkey"), ``ppl``,
``ppl_fp``, ``delta_pct`` (ppl rows), ``accuracy``, ``accuracy_fp``, ``trials`` (passkey rows),
``by_position`` (ppl rows), ``machine`` and ``command``; a rerun replaces the rows with the same
model/context/recipe/metric), then ``long_context.md`` is rewritten from the JSON and a PNG of
perplexity by position is written per (model, context).
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "artifacts" / "results"


def machine() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    import os

    return f"CPU ({os.cpu_count()} cores, {platform.machine()})"


def recipe_label(spec: str) -> str:
    path = Path(spec)
    if path.suffix == ".safetensors":
        try:
            return str(path.resolve().relative_to(ROOT))
        except ValueError:
            return str(path)
    return spec


def run(args: argparse.Namespace) -> list[dict]:
    from kvcalib.eval.harness import EvalConfig, evaluate
    from kvcalib.models import load_model

    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    command = " ".join(shlex.quote(a) for a in ["python", "benchmarks/long_context.py", *sys.argv[1:]])
    rows: list[dict] = []
    for context in args.context:
        metrics = [m for m in args.metrics.split(",") if m]
        # the passkey prompt plus its answer must fit the model: at its full context (SmolLM2's 8192)
        # the prompt gives up the answer's tokens
        limit = loaded.info.max_positions or context + EvalConfig.passkey_new_tokens
        passkey_len = min(context, limit - EvalConfig.passkey_new_tokens)
        config = EvalConfig(model=args.model, recipes=list(args.recipe), data="longtext", metrics=tuple(metrics),
                            context_len=context, ppl_samples=args.ppl_samples, ppl_seq_len=context,
                            passkey_lengths=(passkey_len,), passkey_depths=tuple(args.passkey_depths),
                            passkey_trials=args.passkey_trials, batch_size=1, seed=args.seed)
        results = evaluate(config, loaded)
        for spec, r in zip(args.recipe, results):
            base = {"model": args.model, "context": context, "recipe": recipe_label(spec),
                    "effective_bits": r.effective_bits, "machine": machine(), "command": command}
            if r.ppl is not None:
                rows.append({**base, "metric": "ppl", "ppl": r.ppl, "ppl_fp": r.ppl_fp, "delta_pct": r.ppl_delta_pct,
                             "tokens": r.ppl_tokens, "by_position": r.ppl_by_position})
            if r.passkey is not None:
                rows.append({**base, "metric": "passkey", "accuracy": r.passkey, "accuracy_fp": r.passkey_fp,
                             "trials": len(args.passkey_depths) * args.passkey_trials, "by_depth": r.passkey_cells})
    return rows


def merge(rows: list[dict], path: Path) -> list[dict]:
    """The file's rows with ``rows`` replacing those of the same model/context/recipe/metric."""
    from kvcalib.io import write_json_atomic

    old = json.loads(path.read_text()) if path.is_file() else []
    key = lambda r: (r["model"], r["context"], r["recipe"], r["metric"])  # noqa: E731
    new_keys = {key(r) for r in rows}
    merged = [r for r in old if key(r) not in new_keys] + rows
    merged.sort(key=lambda r: (r["model"], r["context"], r["metric"], r["effective_bits"]))
    write_json_atomic(path, merged)
    return merged


def plot(rows: list[dict], folder: Path) -> list[Path]:
    """One PNG per model and context: perplexity vs full precision by position, a line for every
    recipe in ``rows`` (the merged file's, so a run that adds one recipe redraws the whole plot)."""
    from types import SimpleNamespace

    from kvcalib.eval.harness import plot_positions

    paths = []
    for model, context in sorted({(r["model"], r["context"]) for r in rows if r.get("by_position")}):
        lines = [SimpleNamespace(name=r["recipe"].removeprefix(f"recipes/{model}/").removesuffix("/recipe.safetensors"),
                                 effective_bits=r["effective_bits"], ppl_by_position=r["by_position"])
                 for r in rows if r["metric"] == "ppl" and (r["model"], r["context"]) == (model, context)
                 and r.get("by_position")]
        path = folder / f"long_context_{model}_{context}.png"
        plot_positions(lines, path, f"{model}: perplexity by position, {context}-token windows")
        paths.append(path)
    return paths


def markdown(rows: list[dict]) -> str:
    """The results as tables: perplexity rows, then passkey rows, by model and context."""
    out = ["# Quality at long context", "",
           "Generated from `long_context.json` by `benchmarks/long_context.py` (each row's command and",
           "machine are in the JSON). Effective bits are counted at the row's context (bf16 = 16).", ""]
    ppl = [r for r in rows if r["metric"] == "ppl"]
    if ppl:
        out += ["## Held-out perplexity (Britannica article, windows of exactly `context` tokens)", "",
                "| model | context | recipe | eff. bits | ppl | ppl fp | vs fp | machine |",
                "|---|---:|---|---:|---:|---:|---:|---|"]
        out += [f"| {r['model']} | {r['context']} | {r['recipe']} | {r['effective_bits']:.3f} | {r['ppl']:.3f} | "
                f"{r['ppl_fp']:.3f} | {r['delta_pct']:+.2f}% | {r['machine']} |" for r in ppl]
        out.append("")
    pk = [r for r in rows if r["metric"] == "passkey"]
    if pk:
        out += ["## Passkey retrieval (question asked after the context is compressed)", "",
                "| model | context | recipe | eff. bits | accuracy | fp | trials | machine |",
                "|---|---:|---|---:|---:|---:|---:|---|"]
        out += [f"| {r['model']} | {r['context']} | {r['recipe']} | {r['effective_bits']:.3f} | {r['accuracy']:.2f} | "
                f"{r['accuracy_fp']:.2f} | {r['trials']} | {r['machine']} |" for r in pk]
        out.append("")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--context", type=int, action="append", required=True)
    parser.add_argument("--recipe", action="append", required=True, help="preset name or recipe file (repeatable)")
    parser.add_argument("--metrics", default="ppl,passkey")
    parser.add_argument("--ppl-samples", type=int, default=4)
    parser.add_argument("--passkey-depths", type=lambda s: [float(x) for x in s.split(",")], default=[0.1, 0.5, 0.9])
    parser.add_argument("--passkey-trials", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--out", type=Path, default=OUT / "long_context.json")
    args = parser.parse_args()
    rows = merge(run(args), args.out)
    args.out.with_suffix(".md").write_text(markdown(rows) + "\n")
    plot(rows, args.out.parent)
    for r in rows:
        if r["metric"] == "ppl":
            print(f"{r['model']} {r['context']:>6} {r['recipe']:<40} {r['effective_bits']:6.3f} bits  ppl "
                  f"{r['ppl']:.3f} (fp {r['ppl_fp']:.3f}, {r['delta_pct']:+.2f}%)")
        else:
            print(f"{r['model']} {r['context']:>6} {r['recipe']:<40} {r['effective_bits']:6.3f} bits  passkey "
                  f"{r['accuracy']:.2f} (fp {r['accuracy_fp']:.2f}, {r['trials']} trials)")


if __name__ == "__main__":
    main()
