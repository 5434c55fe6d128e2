"""Per-head widths against per-layer widths at an equal number of code bits (issue 53, item 3): is
the concentration that ``experiments/head_sensitivity.py`` measured worth a per-head recipe format?

    python -m experiments.head_bits --model smollm2-135m --context 8192 --windows 3 --out DIR
        --sensitivity artifacts/results/head_sensitivity-smollm2-135m-8192.json
        --recipe recipes/smollm2-135m/long-8192-3.0b-3bit/recipe.safetensors [--device cuda]

Every allocation quantizes every kv head of every layer, keys and values, with the same layout
(``--group``, ``--window``, ``--sinks``: the plain uniform quantizer of
:class:`kvcalib.codec.LayerCodec`, no rotation or fitted tensors), so their bytes differ only by
their code bits, and every allocation but ``all-2`` spends the same total code bits (the sum over
layers, kv heads and sides of the width):

- ``all-2``: every head at 2 bits (the floor, for scale);
- ``recipe-layers``: the widths the ``--recipe``'s search chose per layer, every head of a layer alike
  (its rotation and clipping are not applied: only its bit allocation is compared);
- ``layer-greedy``: the same budget spent by a greedy rule on whole layers (per side);
- ``head-greedy``: the same budget spent by the same rule on single kv heads (per side).

``--rotate``: every allocation's codecs also rotate each kv head's keys and values by a random-sign
Walsh-Hadamard (the rotate method's Hadamard kind, one seed per layer and side, the same in every
allocation), as every shipped recipe does: is the per-head gain still there once rotation has
spread the outlier channels? The greedy order still comes from ``--sensitivity`` (measured without
rotation), so the allocations are those of the plain run; only their codes change.

The greedy rule upgrades, one step at a time, the unit (layer side or head side) with the largest
estimated KL saved per extra bit, from the 2-bit KL that ``--sensitivity`` measured for that head
alone (a layer's: the sum of its heads', which the measurement found additive) and a KL that drops
4x per extra bit (half the step, a quarter of the squared error). The estimate only orders the
upgrades; each allocation is then measured (``head_sensitivity``'s hooked attention: decode-faithful,
proven there against :func:`kvcalib.simulate.simulated_logits`): KL over the last ``--score-last``
positions of each window, the perplexity change and the copy metric, per window, so the pair
``head-greedy`` - ``layer-greedy`` can be read window by window.

Writes ``DIR/head_bits.json`` (allocations, per-window rows, command, machine, commit) and
``DIR/head_bits.md``.
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

from experiments import head_sensitivity as hs

WIDTHS = (2, 3, 4, 8)
SIDES = ("k", "v")


def est_kl(kl2: float, bits: int) -> float:
    """Estimated KL of a unit at ``bits`` from its 2-bit KL: 4x less per extra bit."""
    return kl2 * 4.0 ** -(bits - 2)


def greedy(kl2: dict, units: dict, extra_bits: int) -> dict:
    """Spend ``extra_bits`` (code bits above 2 everywhere) on ``units``: name -> list of the
    (layer, head, side) it widens together; ``kl2``: (layer, head, side) -> 2-bit KL. Returns
    name -> width. Each step takes the upgrade to the next width with the largest estimated KL saved
    per bit that still fits; stops when none fits."""
    width = {u: 2 for u in units}
    unit_kl = {u: sum(kl2[m] for m in members) for u, members in units.items()}
    left = extra_bits
    while True:
        best, best_rate = None, 0.0
        for u, b in width.items():
            nxt = next((w for w in WIDTHS if w > b), None)
            if nxt is None:
                continue
            cost = (nxt - b) * len(units[u])
            if cost > left:
                continue
            rate = (est_kl(unit_kl[u], b) - est_kl(unit_kl[u], nxt)) / cost
            if rate > best_rate:
                best, best_rate = u, rate
        if best is None:
            return width
        nxt = next(w for w in WIDTHS if w > width[best])
        left -= (nxt - width[best]) * len(units[best])
        width[best] = nxt


def per_head(width: dict, units: dict) -> dict:
    """(layer, head, side) -> bits from unit widths."""
    return {m: width[u] for u, members in units.items() for m in members}


def code_bits(bits: dict) -> int:
    return sum(bits.values())


def allocation(kind: str, bits: dict, layout: dict, make_codec=None):
    """A :class:`head_sensitivity.Allocation`: each layer's heads grouped by their (K, V) widths.
    ``make_codec(layer, heads, config)``: the codec quantizing a group (default: the plain
    :class:`kvcalib.codec.LayerCodec` of ``config``; ``experiments/scale8_e2e.py`` swaps the
    scale/zero format)."""
    from kvcalib.codec import LayerCodec
    from kvcalib.layout import LayerConfig

    make_codec = make_codec or (lambda layer, heads, cfg: LayerCodec(cfg))

    layers = sorted({m[0] for m in bits})
    groups = {}
    for layer in layers:
        heads = sorted({m[1] for m in bits if m[0] == layer})
        by_pair: dict[tuple[int, int], list[int]] = {}
        for h in heads:
            by_pair.setdefault((bits[(layer, h, "k")], bits[(layer, h, "v")]), []).append(h)
        groups[layer] = [(tuple(hs_), SIDES, make_codec(layer, tuple(hs_), LayerConfig(k_bits=kb, v_bits=vb, k_axis="channel", **layout)))
                         for (kb, vb), hs_ in sorted(by_pair.items())]
    return hs.Allocation(kind, groups)


def rotating_codec(head_dim: int):
    """``make_codec`` for :func:`allocation`: a group of kv heads rotated by the random-sign
    Walsh-Hadamard of the rotate method (seed: the layer, per side as the method derives it)."""
    from kvcalib.codec import LayerCodec
    from kvcalib.methods.rotate import side_seed

    def make(layer: int, heads: tuple, cfg):
        tensors = {f"{side}.rotate": torch.tensor([side_seed(layer, side), len(heads), head_dim]) for side in SIDES}
        return LayerCodec.from_tensors(cfg, tensors, len(heads), head_dim)

    return make


def allocations(sens: dict, recipe_layers: list[tuple[int, int]], kv_heads: int) -> dict[str, dict]:
    """name -> (layer, head, side) -> bits, for the four allocations of the module doc."""
    kl2 = {(r["layer"], r["head"], r["side"]): r["kl"] for r in sens["rows"] if r["kind"] == "head"}
    n_layers = len(recipe_layers)
    missing = [(l, h, s) for l in range(n_layers) for h in range(kv_heads) for s in SIDES if (l, h, s) not in kl2]
    if missing:
        raise SystemExit(f"--sensitivity lacks {len(missing)} (layer, head, side) rows, e.g. {missing[0]}: "
                         "run head_sensitivity over every layer and both sides")
    recipe = {(l, h, s): (kb if s == "k" else vb) for l, (kb, vb) in enumerate(recipe_layers)
              for h in range(kv_heads) for s in SIDES}
    if any(b not in WIDTHS for b in recipe.values()):
        raise SystemExit(f"the recipe's widths {sorted(set(recipe.values()))} are not all in {WIDTHS}")
    floor = 2 * len(recipe)
    extra = code_bits(recipe) - floor
    layer_units = {(l, s): [(l, h, s) for h in range(kv_heads)] for l in range(n_layers) for s in SIDES}
    head_units = {m: [m] for m in recipe}
    out = {"all-2": {m: 2 for m in recipe}, "recipe-layers": recipe,
           "layer-greedy": per_head(greedy(kl2, layer_units, extra), layer_units),
           "head-greedy": per_head(greedy(kl2, head_units, extra), head_units)}
    return out


def markdown(meta: dict, rows: list[dict], allocs: dict) -> str:
    lines = [f"# Per-head against per-layer widths: {meta['model']}, {meta['context']} tokens", "",
             f"- `{meta['command']}` on {meta['machine']}, commit {meta['commit']}, {meta['wall_s']:.0f} s",
             f"- every head and side quantized (group {meta['k_group']}, window {meta['window']}, sinks {meta['sinks']}, "
             f"plain uniform codes{', Hadamard-rotated' if meta.get('rotate') else ''}); {meta['windows']} window(s) of `{meta['data']}`, {meta['copy_windows']} copy "
             f"window(s), KL and NLL over the last {meta['score_last']} positions; widths of `{meta['recipe']}`", "",
             "| allocation | mean code bits | KL | per window | Δppl % | copy KL | Δ copy NLL | widths used (K / V, heads) |",
             "|---|---:|---:|---|---:|---:|---:|---|"]
    for r in rows:
        if r["kind"] == "fp":
            continue
        bits = allocs[r["kind"]]
        mean_bits = code_bits(bits) / len(bits)
        used = " / ".join(", ".join(f"{w}: {sum(1 for m, b in bits.items() if m[2] == s and b == w)}"
                                    for w in WIDTHS if any(m[2] == s and b == w for m, b in bits.items())) for s in SIDES)
        per_w = ", ".join(f"{x:.4f}" for x in r["ppl_kl"])
        copy = f"{r['copy_kl_mean']:.4f} | {r['copy_dnll']:+.4f}" if r.get("copy_kl") else " | "
        lines.append(f"| {r['kind']} | {mean_bits:.3f} | {r['kl']:.4f} | {per_w} | {r['dppl_pct']:.2f} | {copy} | {used} |")
    hg = next(r for r in rows if r["kind"] == "head-greedy")
    for other in ("layer-greedy", "recipe-layers"):
        o = next(r for r in rows if r["kind"] == other)
        wins = sum(a < b for a, b in zip(hg["ppl_kl"], o["ppl_kl"]))
        lines.append("")
        lines.append(f"head-greedy against {other}: KL ratio {hg['kl'] / o['kl']:.3f}, lower in {wins} of "
                     f"{len(hg['ppl_kl'])} windows" + (f"; copy KL ratio {hg['copy_kl_mean'] / o['copy_kl_mean']:.3f}"
                                                        if hg.get("copy_kl") else ""))
    lines.append("")
    lines.append("Widths per head (layer: kv heads' K, then V) of head-greedy: " + "; ".join(
        f"{l}: " + "".join(str(allocs['head-greedy'][(l, h, 'k')]) for h in range(meta["kv_heads"])) + "/"
        + "".join(str(allocs['head-greedy'][(l, h, 'v')]) for h in range(meta["kv_heads"]))
        for l in range(meta["layers"]) if any(allocs['head-greedy'][(l, h, s)] > 2
                                               for h in range(meta["kv_heads"]) for s in SIDES)))
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m experiments.head_bits", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--data", default="longtext", help="text whose evaluation split gives the windows")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--copy-windows", type=int, default=None, help="copy windows from the first N windows (default all)")
    ap.add_argument("--score-last", type=int, default=1024)
    ap.add_argument("--sensitivity", type=Path, required=True, help="a head_sensitivity.json at 2 bits")
    ap.add_argument("--recipe", type=Path, required=True, help="the recipe whose per-layer widths set the budget")
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--rotate", action="store_true", help="rotate every head (Hadamard) in every allocation")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--device", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    return ap


def load_inputs(args, loaded, result: str):
    """What a run reads: (sensitivity rows, the recipe's per-layer (K, V) widths, the loaded model,
    the layout); refuses an ``--out`` that holds ``result`` already and a recipe of another depth."""
    from kvcalib.models import load_model
    from kvcalib.recipe import Recipe

    if (args.out / result).exists():
        raise SystemExit(f"{args.out} holds a run already: pass a new --out")
    sens = json.loads(args.sensitivity.read_text())
    recipe = Recipe.load(args.recipe)
    loaded = loaded or load_model(args.model, device=args.device, dtype="fp32")
    if len(recipe.layers) != loaded.info.num_layers:
        raise SystemExit(f"{args.recipe} has {len(recipe.layers)} layers, {loaded.info.name} {loaded.info.num_layers}")
    layout = dict(k_group=args.group, v_group=args.group, sinks=args.sinks, window=args.window)
    return sens, [(c.k_bits, c.v_bits) for c in recipe.layers], loaded, layout


def score(model, tok, targets: list, args, texts: Sequence[str] | None, label: str):
    """Every target over ``args``' windows (and their copy windows): (rows, windows, copy windows)."""
    import math

    from kvcalib.progress import ProgressBar

    prompt_len = args.context - args.score_last
    win, sets, n_copy = hs.window_sets(args, tok, texts)
    batches = sum(math.ceil(ids.shape[0] / args.batch) for ids in sets.values())
    with ProgressBar(batches * len(targets), label, "forwards") as bar:
        rows = hs.finish_rows(hs.measure(model, sets, targets, None, prompt_len, args.batch, bar))
    return rows, win, n_copy


def main(argv: Sequence[str] | None = None, loaded=None, texts: Sequence[str] | None = None) -> dict:
    """Run and write the outputs; ``loaded`` and ``texts`` replace ``--model`` and ``--data`` (tests)."""
    args = parser().parse_args(argv)
    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    from benchmarks.long_context import machine

    sens, widths, loaded, layout = load_inputs(args, loaded, "head_bits.json")
    model, tok, info = loaded.model, loaded.tokenizer, loaded.info
    allocs = allocations(sens, widths, info.num_kv_heads)
    make_codec = rotating_codec(info.head_dim) if args.rotate else None
    targets = [hs.Target("fp"), *(allocation(name, bits, layout, make_codec) for name, bits in allocs.items())]
    rows, win, n_copy = score(model, tok, targets, args, texts, "head bits")
    meta = {"command": " ".join(shlex.quote(a) for a in ["python", "-m", "experiments.head_bits",
                                                          *(sys.argv[1:] if argv is None else argv)]),
            "machine": machine(), "commit": hs.git_commit(), "torch": torch.__version__, "model": info.name,
            "data": f"{args.data} (eval split)" if texts is None else "given texts", "context": args.context,
            "windows": args.windows, "copy_windows": n_copy, "score_last": args.score_last, "recipe": str(args.recipe),
            "sensitivity": str(args.sensitivity), "rotate": "hadamard" if args.rotate else None, **layout, "layers": info.num_layers, "kv_heads": info.num_kv_heads,
            "window_starts": win.starts, "wall_s": time.perf_counter() - t0}
    flat = {name: [[l, h, s, b] for (l, h, s), b in sorted(bits.items())] for name, bits in allocs.items()}
    result = {"meta": meta, "allocations": flat, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "head_bits.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "head_bits.md").write_text(markdown(meta, rows, allocs))
    return result


if __name__ == "__main__":
    main()
