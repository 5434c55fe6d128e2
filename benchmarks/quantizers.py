"""Ablation of issue 34's quantizers at long context: rotation, non-uniform levels, pre-RoPE keys and
the error-bounded quantizer, each alone and combined, on top of K2V2 and K4V2 (group 32, window
128), with the Huffman tier measured on the min/max and the error-bounded codes.

    python benchmarks/quantizers.py --model smollm2-135m --context 4096 [--ppl-samples 2]
        [--run RUN_DIR] [--collect-samples 16 --collect-seq-len 2048] [--bits k2v2,k4v2]
        [--variants baseline,rotate,...] [--no-huffman] [--device cuda]

Statistics: ``RUN_DIR`` (``kvcalib collect`` output) or, when absent, collected here on the
*calibration* split of ``--data longtext`` (Milton). Every recipe is exported from them
(``kvcalib export RUN --bits B --group 32 --window 128 <flags>``) and scored on identical inputs:
held-out perplexity on windows of exactly ``--context`` tokens of the *evaluation* split
(the Britannica article, never seen in calibration), decode-faithful (the simulation uses each
recipe's codec), effective bits accounted at that same context (bf16 = 16). Huffman: codebooks
from the statistics' reservoir, coded bits measured on held-out K/V of one ``--context`` window
(:func:`benchmarks.huffman_bits.measure_recipe`); the coded row has the same perplexity (the code is
lossless) and ``huffman_saving_pct`` = coded against uncoded effective bits of the same recipe.

Rows are merged into ``artifacts/results/quantizers.json`` (a list of objects with keys ``model``,
``context``, ``recipe``, ``methods``, ``effective_bits``, ``ppl``, ``ppl_fp``, ``delta_pct``,
``huffman_saving_pct`` (coded rows), plus ``bits_per_symbol`` (coded rows), ``ppl_samples``,
``machine``, ``command``; a rerun replaces rows of the same model/context/recipe), and
``quantizers.md`` beside it is rewritten from the JSON.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from the repository root
    sys.path.insert(0, str(ROOT))

from benchmarks.long_context import machine  # noqa: E402

OUT = ROOT / "artifacts" / "results" / "quantizers.json"

# variant name -> kvcalib export flags (ExportConfig keywords); pipeline order is the registry's
VARIANTS: dict[str, dict] = {
    "baseline": {},
    "rotate": {"rotate": "hadamard"},
    "levels": {"levels": True},
    "prerope": {"prerope": True},
    "errbound": {"errbound": True},
    "rotate+levels": {"rotate": "hadamard", "levels": True},
    "rotate+errbound": {"rotate": "hadamard", "errbound": True},
    "prerope+rotate+levels": {"prerope": True, "rotate": "hadamard", "levels": True},
}
# the variants whose codes the Huffman tier is measured on: min/max groups and the fixed grid,
# without and with the rotation (pre-RoPE keys need positions the held-out capture does not keep)
HUFFMAN_VARIANTS = ("baseline", "rotate", "errbound", "rotate+errbound")


def export_variants(run: Path, out: Path, bits: list[str], variants: list[str], group: int,
                    window: int) -> list[tuple[str, str, Path, list[str]]]:
    """Export every (bits, variant) recipe into ``out``: [(label, bits, path, methods)]."""
    from kvcalib.export import ExportConfig, export_recipe

    out.mkdir(parents=True, exist_ok=True)
    made = []
    for b in bits:
        for name in variants:
            label = f"{b}-g{group}-{name}"
            path = out / f"{label}.safetensors"
            rec = export_recipe(run, path, ExportConfig(bits=b, group=group, window=window, name=label,
                                                        **VARIANTS[name]), force=True)
            made.append((label, b, path, list(rec.provenance["methods"])))
    return made


def huffman_rows(made, stats, loaded, context: int, seed: int) -> dict[str, dict]:
    """Coded effective bits of the :data:`HUFFMAN_VARIANTS` recipes on one held-out window."""
    from kvcalib.data import pack_samples
    from benchmarks.huffman_bits import EntropyConfig, capture_kv, measure_recipe
    from kvcalib.eval.harness import eval_texts
    from kvcalib.recipe import Recipe

    config = EntropyConfig(data="longtext", samples=1, seq_len=context, context=context, drift_new_tokens=0,
                           seed=seed)
    ids = pack_samples(eval_texts("longtext"), loaded.tokenizer, context, 1, seed)  # (1, context)
    kv = [capture_kv(loaded.model, ids)]
    out = {}
    for label, _, path, _ in made:
        if label.split("-", 2)[2] not in HUFFMAN_VARIANTS:
            continue
        _, res = measure_recipe(Recipe.load(path), stats, loaded.info, kv, None, 0, 0, config)
        eff = res["effective_bits"]
        out[label] = {"uncoded": eff["uncoded"], "coded": eff["coded_heldout"], "saving_pct": eff["reduction_pct"],
                      "coded_all_sides": eff["coded_heldout_all_sides"],
                      "bits_per_symbol": {side: s["heldout_bits_per_symbol"] for side, s in res["summary"].items()},
                      "entropy": {side: s["heldout_entropy"] for side, s in res["summary"].items()}}
    return out


def run(args: argparse.Namespace) -> list[dict]:
    from kvcalib.collection import CollectConfig, collect
    from kvcalib.eval.harness import EvalConfig, evaluate
    from kvcalib.models import load_model
    from kvcalib.stats import CollectedStats

    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = Path(args.run) if args.run else ROOT / "artifacts" / "runs" / f"quantizers-{args.model}-{stamp}"
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    if not (run_dir / "stats.safetensors").is_file():
        collect(CollectConfig(model=args.model, data="longtext", split="calib", samples=args.collect_samples,
                              seq_len=args.collect_seq_len, batch_size=args.collect_batch, reservoir_blocks=16,
                              block_len=128, seed=args.seed), run_dir, loaded=loaded)
    stats = CollectedStats.load(run_dir)
    made = export_variants(run_dir, run_dir / f"recipes-{stamp}", args.bits, args.variants, 32, 128)
    config = EvalConfig(model=args.model, recipes=[str(p) for _, _, p, _ in made], data="longtext", metrics=("ppl",),
                        context_len=args.context, ppl_samples=args.ppl_samples, ppl_seq_len=args.context,
                        batch_size=1, seed=args.seed)
    results = evaluate(config, loaded)
    coded = huffman_rows(made, stats, loaded, args.context, args.seed) if args.huffman else {}
    command = " ".join(shlex.quote(a) for a in ["python", "benchmarks/quantizers.py", *sys.argv[1:]])
    rows = []
    for (label, _, _, methods), r in zip(made, results):
        base = {"model": args.model, "context": args.context, "recipe": label, "methods": methods,
                "effective_bits": round(r.effective_bits, 4), "ppl": r.ppl, "ppl_fp": r.ppl_fp,
                "delta_pct": r.ppl_delta_pct, "ppl_samples": args.ppl_samples, "ppl_tokens": r.ppl_tokens,
                "statistics": str(run_dir), "machine": machine(), "command": command}
        rows.append(base)
        if label in coded:
            c = coded[label]
            rows.append({**base, "recipe": label + "+huffman", "methods": methods + ["huffman"],
                         "effective_bits": c["coded"], "huffman_saving_pct": c["saving_pct"],
                         "uncoded_effective_bits": c["uncoded"], "coded_all_sides_effective_bits": c["coded_all_sides"],
                         "bits_per_symbol": c["bits_per_symbol"], "entropy": c["entropy"]})
    return rows


def merge(rows: list[dict], path: Path) -> list[dict]:
    """The file's rows with ``rows`` replacing those of the same model/context/recipe."""
    from kvcalib.io import write_json_atomic

    old = json.loads(path.read_text()) if path.is_file() else []
    key = lambda r: (r["model"], r["context"], r["recipe"])  # noqa: E731
    new_keys = {key(r) for r in rows}
    merged = [r for r in old if key(r) not in new_keys] + rows
    merged.sort(key=lambda r: (r["model"], r["context"], r["recipe"]))
    write_json_atomic(path, merged)
    return merged


def markdown(rows: list[dict]) -> str:
    out = ["# Issue 34's quantizers at long context", "",
           "Generated from `quantizers.json` by `benchmarks/quantizers.py` (each row's command and machine are",
           "in the JSON). Held-out perplexity on windows of exactly `context` tokens of the Britannica article",
           "(`--data longtext` eval split), statistics from Milton (calib split); effective bits counted at the",
           "row's context (bf16 = 16). `+huffman` rows: the same recipe's codes Huffman-coded (lossless: same",
           "perplexity), coded bits measured on one held-out window.", "",
           "| model | context | recipe | methods | eff. bits | ppl | ppl fp | vs fp | Huffman saving | bits/symbol K, V |",
           "|---|---:|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        saving = f"{r['huffman_saving_pct']:.1f}%" if r.get("huffman_saving_pct") is not None else ""
        bps = r.get("bits_per_symbol") or {}
        sym = ", ".join(f"{bps[s]:.3f}" for s in ("k", "v") if s in bps)
        out.append(f"| {r['model']} | {r['context']} | {r['recipe']} | {'+'.join(r['methods']) or '-'} | "
                   f"{r['effective_bits']:.3f} | {r['ppl']:.3f} | {r['ppl_fp']:.3f} | {r['delta_pct']:+.2f}% | "
                   f"{saving} | {sym} |")
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--ppl-samples", type=int, default=2)
    parser.add_argument("--run", default=None, help="a kvcalib collect run folder (default: collect one)")
    parser.add_argument("--collect-samples", type=int, default=16)
    parser.add_argument("--collect-seq-len", type=int, default=2048)
    parser.add_argument("--collect-batch", type=int, default=2)
    parser.add_argument("--bits", type=lambda s: s.split(","), default=["k2v2", "k4v2"])
    parser.add_argument("--variants", type=lambda s: s.split(","), default=list(VARIANTS))
    parser.add_argument("--no-huffman", dest="huffman", action="store_false")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}: use a subset of {', '.join(VARIANTS)}")
    rows = merge(run(args), args.out)
    args.out.with_suffix(".md").write_text(markdown(rows))
    for r in rows:
        print(f"{r['model']} {r['context']:>6} {r['recipe']:<36} {r['effective_bits']:6.3f} bits  ppl {r['ppl']:.3f} "
              f"(fp {r['ppl_fp']:.3f}, {r['delta_pct']:+.2f}%)"
              + (f"  huffman -{r['huffman_saving_pct']:.1f}%" if r.get("huffman_saving_pct") is not None else ""))


if __name__ == "__main__":
    main()
