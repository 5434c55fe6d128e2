"""Quality at long context: held-out perplexity (overall, by position, with a bootstrap interval),
copying and passkey retrieval of recipes beside full precision, on identical inputs, at the contexts
where the cache is large.

    python benchmarks/long_context.py --model smollm2-135m --context 8192 \
        --recipe kivi-2 --recipe kivi-4 --recipe recipes/smollm2-135m/long-8192-3.0b-3bit/recipe.safetensors \
        [--text longtext --text plays] [--ppl-samples 8] [--passkey-depths 0.1,0.3,0.5,0.7,0.9]
        [--passkey-trials 4] [--metrics ppl,passkey,copy] [--decode] [--device cuda]

Texts (``--text``, repeatable; never used for calibration): ``longtext``, the Britannica article
(encyclopaedia prose; calibration uses Milton), and ``plays``, eight Shakespeare tragedies
(dialogue and verse; no calibration split at all).

Perplexity: ``--ppl-samples`` windows of exactly ``context`` tokens of each text, side by side;
where the text holds fewer, evenly spaced windows that share at most ``--ppl-overlap`` of their
tokens with a neighbour (the row records the overlap: overlapping windows make the interval
narrower than independent ones would). ``ci_low``/``ci_high``: the 95% paired bootstrap interval
over windows of ``delta_pct`` (the perplexity change against full precision, in %). Effective
bits are accounted at the context.

Copy (:mod:`kvcalib.eval.copy`): ``--copy-samples`` passages of ``--copy-len`` tokens of each
text, each repeated; ``nll`` is the mean NLL (nats/token) of the last ``--copy-tail`` tokens of
the second copy, decode steps after a compressed prompt, through the decode-faithful simulation,
``nll_decode`` the same through a real token-by-token decode with CompressedCache (``--decode``),
``nll_fp`` full precision, ``nll_reference`` full precision on the same tokens of the first copy.

Passkey: prompts of exactly ``context`` tokens (the Britannica filler), the key at each depth, the
question asked after the context is compressed (``split`` mode); once per context, with the first
``--text``. ``--passkey-trials`` per depth (default 4 x 5 depths = 20 trials).

Every row is merged into ``artifacts/results/long_context.json`` (a list of objects with keys
``model``, ``context``, ``recipe``, ``effective_bits``, ``metric`` ("ppl" | "copy" | "passkey"),
``text``; ppl rows ``ppl``, ``ppl_fp``, ``delta_pct``, ``ci_low``, ``ci_high``, ``windows``,
``overlap``, ``tokens``, ``by_position``; copy rows ``nll``, ``nll_fp``, ``nll_decode``,
``nll_reference``, ``passages``, ``tail``; passkey rows ``accuracy``, ``accuracy_fp``, ``trials``,
``by_depth``; and ``machine`` and ``command``; rows written before ``text`` existed are Britannica
rows; a rerun replaces the rows with the same model/context/recipe/metric/text) as each recipe
finishes (a run stopped by a time limit keeps what finished), then
``long_context.md`` is rewritten from the JSON and a PNG of perplexity by position is written per
(model, context, text).
``--merge FILE`` (repeatable) merges the rows of another run's ``--out`` (e.g. a GPU machine's)
instead of running.
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


TEXTS = {"longtext": "Britannica article", "plays": "Shakespeare tragedies"}


def text_of(row: dict) -> str:
    return row.get("text", "longtext")  # rows written before --text existed are Britannica rows


def run(args: argparse.Namespace, save=None) -> list[dict]:
    """Every context and text of ``args``: the rows, also handed to ``save`` recipe by recipe (so a
    run stopped by a time limit keeps what finished)."""
    from kvcalib.eval.harness import EvalConfig, evaluate
    from kvcalib.models import load_model

    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    command = " ".join(shlex.quote(a) for a in ["python", "benchmarks/long_context.py", *sys.argv[1:]])
    metrics = [m for m in args.metrics.split(",") if m]
    rows: list[dict] = []
    for context in args.context:
        # the passkey prompt plus its answer must fit the model: at its full context (SmolLM2's 8192)
        # the prompt gives up the answer's tokens
        limit = loaded.info.max_positions or context + EvalConfig.passkey_new_tokens
        passkey_len = min(context, limit - EvalConfig.passkey_new_tokens)
        for i, text in enumerate(args.text):
            chosen = tuple(m for m in metrics if m != "passkey" or i == 0)  # passkey: one filler, once
            if not chosen:
                continue
            config = EvalConfig(model=args.model, recipes=list(args.recipe), data=text, metrics=chosen,
                                context_len=context, ppl_samples=args.ppl_samples, ppl_seq_len=context,
                                ppl_overlap=args.ppl_overlap, passkey_lengths=(passkey_len,),
                                passkey_depths=tuple(args.passkey_depths), passkey_trials=args.passkey_trials,
                                copy_len=args.copy_len, copy_tail=args.copy_tail, copy_samples=args.copy_samples,
                                copy_decode=args.decode, batch_size=1, seed=args.seed)
            def on_result(r, context=context, text=text) -> None:
                new = rows_of(r, args, context, text, command)
                rows.extend(new)
                if save is not None:
                    save(new)

            evaluate(config, loaded, on_result=on_result)
    return rows


def rows_of(r, args: argparse.Namespace, context: int, text: str, command: str) -> list[dict]:
    """The JSON rows of one recipe's :class:`~kvcalib.eval.harness.EvalResult`."""
    rows: list[dict] = []
    base = {"model": args.model, "context": context, "recipe": recipe_label(r.recipe), "text": text,
            "effective_bits": r.effective_bits, "machine": machine(), "command": command}
    if r.ppl is not None:
        rows.append({**base, "metric": "ppl", "ppl": r.ppl, "ppl_fp": r.ppl_fp,
                     "delta_pct": r.ppl_delta_pct, "ci_low": r.ppl_ci_low, "ci_high": r.ppl_ci_high,
                     "windows": r.ppl_windows, "overlap": r.ppl_overlap, "tokens": r.ppl_tokens,
                     "by_position": r.ppl_by_position})
    if r.copy_nll is not None:
        rows.append({**base, "metric": "copy", "nll": r.copy_nll, "nll_fp": r.copy_nll_fp,
                     "nll_decode": r.copy_nll_decode, "nll_reference": r.copy_nll_reference,
                     "passages": r.copy_passages, "tail": r.copy_tail, "copy_len": args.copy_len})
    if r.passkey is not None:
        rows.append({**base, "metric": "passkey", "text": "longtext", "accuracy": r.passkey,
                     "accuracy_fp": r.passkey_fp,
                     "trials": len(args.passkey_depths) * args.passkey_trials, "by_depth": r.passkey_cells})
    return rows


def read_rows(paths: list[Path]) -> list[dict]:
    """The rows of other runs' ``--out`` files, for ``--merge``; ValueError naming the file that is
    missing or not a JSON list of rows."""
    rows: list[dict] = []
    for path in paths:
        try:
            doc = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"--merge {path}: cannot read it as JSON ({err.__class__.__name__}); "
                             "pass a results file another run wrote with --out") from None
        if not isinstance(doc, list) or not all(isinstance(r, dict) for r in doc):
            raise ValueError(f"--merge {path}: not a list of rows; pass a results file another run wrote with --out")
        rows += doc
    return rows


def merge(rows: list[dict], path: Path, key=None, order=None) -> list[dict]:
    """The file's rows with ``rows`` replacing those of the same ``key`` (default: model, context,
    recipe, metric and text), sorted by ``order``; written atomically."""
    from kvcalib.io import write_json_atomic

    key = key or (lambda r: (r["model"], r["context"], r["recipe"], r["metric"], text_of(r)))
    order = order or (lambda r: (r["model"], r["context"], r["metric"], text_of(r), r["effective_bits"]))
    old = json.loads(path.read_text()) if path.is_file() else []
    new_keys = {key(r) for r in rows}
    merged = [r for r in old if key(r) not in new_keys] + rows
    merged.sort(key=order)
    write_json_atomic(path, merged)
    return merged


def plot(rows: list[dict], folder: Path) -> list[Path]:
    """One PNG per model, context and text: perplexity vs full precision by position, a line for
    every recipe in ``rows`` (the merged file's, so a run that adds one recipe redraws the whole plot)."""
    from types import SimpleNamespace

    from kvcalib.eval.harness import plot_positions

    paths = []
    for model, context, text in sorted({(r["model"], r["context"], text_of(r)) for r in rows if r.get("by_position")}):
        lines = [SimpleNamespace(name=r["recipe"].removeprefix(f"recipes/{model}/").removesuffix("/recipe.safetensors"),
                                 effective_bits=r["effective_bits"], ppl_by_position=r["by_position"])
                 for r in rows if r["metric"] == "ppl" and (r["model"], r["context"], text_of(r)) == (model, context, text)
                 and r.get("by_position")]
        suffix = "" if text == "longtext" else f"_{text}"  # the Britannica plots keep their names
        path = folder / f"long_context_{model}_{context}{suffix}.png"
        plot_positions(lines, path, f"{model}: perplexity by position, {context}-token windows, {TEXTS.get(text, text)}")
        paths.append(path)
    return paths


def nats(x: float) -> str:
    """A copy NLL: three decimals, or two significant digits below 0.01 (a model that copies almost
    perfectly, e.g. Qwen2.5-Coder at ~0.002 nats, would otherwise print 0.002 for every recipe)."""
    return f"{x:.3f}" if abs(x) >= 0.01 else f"{x:.2g}"


def _ci(r: dict) -> str:
    if r.get("ci_low") is None:
        return ""
    return f"[{r['ci_low']:+.2f}, {r['ci_high']:+.2f}]"


def markdown(rows: list[dict]) -> str:
    """The results as tables: perplexity, copy, then passkey rows, by model, context and text."""
    out = ["# Quality at long context", "",
           "Generated from `long_context.json` by `benchmarks/long_context.py` (each row's command and",
           "machine are in the JSON). Effective bits are counted at the row's context (bf16 = 16). Texts: the",
           "Britannica article (longtext) and eight Shakespeare tragedies (plays), neither calibrated on.", ""]
    ppl = [r for r in rows if r["metric"] == "ppl"]
    if ppl:
        out += ["## Held-out perplexity (windows of exactly `context` tokens)", "",
                "95% CI: paired bootstrap over windows of the change against full precision; windows: how many, and",
                "the fraction of a window shared with its neighbour where the text is too short for disjoint ones.", "",
                "| model | context | text | recipe | eff. bits | ppl | ppl fp | vs fp | 95% CI | windows | machine |",
                "|---|---:|---|---|---:|---:|---:|---:|---|---:|---|"]
        for r in ppl:
            win = "" if r.get("windows") is None else f"{r['windows']}" + (f" ({r['overlap']:.2f} shared)" if r.get("overlap") else "")
            out.append(f"| {r['model']} | {r['context']} | {text_of(r)} | {r['recipe']} | {r['effective_bits']:.3f} | "
                       f"{r['ppl']:.3f} | {r['ppl_fp']:.3f} | {r['delta_pct']:+.2f}% | {_ci(r)} | {win} | {r['machine']} |")
        out.append("")
    copy = [r for r in rows if r["metric"] == "copy"]
    if copy:
        out += ["## Copy (a passage repeated: NLL of the second copy's last tokens, nats/token)", "",
                "reference: full precision on the same tokens of the first copy, where there is nothing to copy.", "",
                "| model | context | text | recipe | eff. bits | NLL (simulated) | NLL (decode) | NLL fp | reference | passages x tail | machine |",
                "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---|"]
        for r in copy:
            dec = "" if r.get("nll_decode") is None else nats(r["nll_decode"])
            out.append(f"| {r['model']} | {r['context']} | {text_of(r)} | {r['recipe']} | {r['effective_bits']:.3f} | "
                       f"{nats(r['nll'])} | {dec} | {nats(r['nll_fp'])} | {r['nll_reference']:.3f} | "
                       f"{r['passages']} x {r['tail']} | {r['machine']} |")
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--context", type=int, action="append", default=[], help="required unless --merge")
    parser.add_argument("--recipe", action="append", default=[], help="preset name or recipe file (repeatable; required unless --merge)")
    parser.add_argument("--text", action="append", choices=sorted(TEXTS), default=None,
                        help="held-out text (repeatable; default: longtext and plays)")
    parser.add_argument("--metrics", default="ppl,passkey,copy")
    parser.add_argument("--ppl-samples", type=int, default=8)
    parser.add_argument("--ppl-overlap", type=float, default=0.75,
                        help="the most a window may share with its neighbour where the text is short")
    parser.add_argument("--copy-len", type=int, default=3000)
    parser.add_argument("--copy-tail", type=int, default=256)
    parser.add_argument("--copy-samples", type=int, default=4)
    parser.add_argument("--decode", action="store_true", help="copy: also through a real CompressedCache decode")
    parser.add_argument("--passkey-depths", type=lambda s: [float(x) for x in s.split(",")],
                        default=[0.1, 0.3, 0.5, 0.7, 0.9])
    parser.add_argument("--passkey-trials", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--out", type=Path, default=OUT / "long_context.json")
    parser.add_argument("--merge", type=Path, action="append", default=[],
                        help="merge the rows of these JSON files (another run's --out) instead of running")
    args = parser.parse_args(argv)
    if not args.merge and not (args.context and args.recipe):
        parser.error("--context and --recipe are required (or --merge FILE)")
    args.text = args.text or ["longtext", "plays"]
    from kvcalib.errors import KvcalibError

    def save(new: list[dict]) -> list[dict]:
        """Merge ``new`` into --out, then its table and plots: after every recipe."""
        from kvcalib.io import atomic_path

        merged = merge(new, args.out)
        with atomic_path(args.out.with_suffix(".md")) as tmp:
            tmp.write_text(markdown(merged) + "\n")
        plot(merged, args.out.parent)
        return merged

    try:
        if args.merge:  # rows of runs made elsewhere (a GPU machine's --out), into this --out
            try:
                new = read_rows(args.merge)
            except ValueError as err:
                parser.error(str(err))
        else:
            new = run(args, save)
    except KvcalibError as err:
        print(f"long_context.py: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    rows = save(new)
    for r in new:
        head = f"{r['model']} {r['context']:>6} {text_of(r):<8} {r['recipe']:<50} {r['effective_bits']:6.3f} bits"
        if r["metric"] == "ppl":
            print(f"{head}  ppl {r['ppl']:.3f} (fp {r['ppl_fp']:.3f}, {r['delta_pct']:+.2f}% {_ci(r)})")
        elif r["metric"] == "copy":
            print(f"{head}  copy NLL {nats(r['nll'])} (fp {nats(r['nll_fp'])}, reference {r['nll_reference']:.3f})")
        else:
            print(f"{head}  passkey {r['accuracy']:.2f} (fp {r['accuracy_fp']:.2f}, {r['trials']} trials)")


if __name__ == "__main__":
    main()
