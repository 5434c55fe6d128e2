"""Recipes against each other at long context, fast: each recipe's fitted codecs (rotation, clipping,
its per-layer widths and layout) through ``experiments/head_sensitivity.py``'s hooked attention,
which is decode-faithful (proven there against :func:`kvcalib.simulate.simulated_logits`) and shares
one full-precision prefill per window between the recipes and scores only the continuation: two
recipes at 8k on 3 windows and 3 copy windows took 23 min on the 2-core CPU, where ``kvcalib eval``
had not finished the first recipe's perplexity after 40 min (both with the CPU shared).

    python -m experiments.recipe_kl --model smollm2-135m --context 8192 --windows 3 --data plays
        --recipe A.safetensors --recipe B.safetensors --out DIR

KL over the last ``--score-last`` positions of each window, the perplexity change and the copy
metric (``head_bits``' rows). Writes ``DIR/recipe_kl.json`` and ``DIR/recipe_kl.md``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Sequence

import torch

from experiments import head_bits as hb
from experiments import head_sensitivity as hs


def recipe_allocation(name: str, recipe, info) -> hs.Allocation:
    """Every kv head of every layer through the recipe's own codec for that layer."""
    heads = tuple(range(info.num_kv_heads))
    return hs.Allocation(name, {i: [(heads, hb.SIDES, codec)] for i, codec in enumerate(recipe.codecs(info))})


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m experiments.recipe_kl", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--data", default="plays", help="text whose evaluation split gives the windows")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--copy-windows", type=int, default=None, help="copy windows from the first N windows (default all)")
    ap.add_argument("--score-last", type=int, default=1024)
    ap.add_argument("--recipe", type=Path, action="append", required=True)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--device", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    return ap


def main(argv: Sequence[str] | None = None, loaded=None, texts: Sequence[str] | None = None) -> dict:
    """Run and write the outputs; ``loaded`` and ``texts`` replace ``--model`` and ``--data`` (tests)."""
    args = parser().parse_args(argv)
    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    from benchmarks.long_context import machine
    from kvcalib.models import load_model
    from kvcalib.recipe import Recipe

    if (args.out / "recipe_kl.json").exists():
        raise SystemExit(f"{args.out} holds a run already: pass a new --out")
    recipes = [Recipe.load(p) for p in args.recipe]
    loaded = loaded or load_model(args.model, device=args.device, dtype="fp32")
    model, tok, info = loaded.model, loaded.tokenizer, loaded.info
    for path, recipe in zip(args.recipe, recipes):
        recipe.check_model(info)
    names = [f"{i}:{p.parent.name if p.name == 'recipe.safetensors' else p.stem}" for i, p in enumerate(args.recipe)]
    targets = [hs.Target("fp"), *(recipe_allocation(n, r, info) for n, r in zip(names, recipes))]
    rows, win, n_copy = hb.score(model, tok, targets, args, texts, "recipe kl")
    bits = {n: r.memory(info, args.context).effective_bits for n, r in zip(names, recipes)}
    meta = {"command": " ".join(shlex.quote(a) for a in ["python", "-m", "experiments.recipe_kl",
                                                          *(sys.argv[1:] if argv is None else argv)]),
            "machine": machine(), "commit": hs.git_commit(), "torch": torch.__version__, "model": info.name,
            "data": f"{args.data} (eval split)" if texts is None else "given texts", "context": args.context,
            "windows": args.windows, "copy_windows": n_copy, "score_last": args.score_last,
            "recipes": [str(p) for p in args.recipe], "window_starts": win.starts, "wall_s": time.perf_counter() - t0}
    lines = [f"# Recipes at {args.context} tokens: {info.name}", "",
             f"- `{meta['command']}` on {meta['machine']}, commit {meta['commit']}, {meta['wall_s']:.0f} s",
             f"- {args.windows} window(s) of `{meta['data']}`, {n_copy} copy window(s), KL and NLL over the last "
             f"{args.score_last} positions (decode-faithful hooked attention)", "",
             "| recipe | eff. bits | KL | per window | Δppl % | copy KL | Δ copy NLL |", "|---|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        if r["kind"] == "fp":
            continue
        copy = f"{r['copy_kl_mean']:.4f} | {r['copy_dnll']:+.4f}" if r.get("copy_kl") else " | "
        lines.append(f"| {r['kind']} | {bits[r['kind']]:.3f} | {r['kl']:.4f} | "
                     f"{', '.join(f'{x:.4f}' for x in r['ppl_kl'])} | {r['dppl_pct']:.2f} | {copy} |")
    result = {"meta": meta, "effective_bits": bits, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "recipe_kl.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "recipe_kl.md").write_text("\n".join(lines) + "\n")
    return result


if __name__ == "__main__":
    main()
