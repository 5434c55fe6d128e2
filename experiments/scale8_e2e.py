"""8-bit scale and zero end to end at long context (issue 53, item 4): what ``experiments/scale8.py``
measured on one layer's attention at 2k, measured through the whole model at 8k, and what the bits
it saves buy when they are spent on wider codes.

    python -m experiments.scale8_e2e --model smollm2-135m --context 8192 --windows 3 --out DIR
        --sensitivity artifacts/results/head_sensitivity-smollm2-135m-8192.json
        --recipe recipes/smollm2-135m/long-8192-3.0b-3bit/recipe.safetensors [--device cuda]

Every allocation quantizes every kv head of every layer, keys per channel over ``--group`` tokens and
values per token over ``--group`` channels, with ``--sinks`` and ``--window`` in full precision, min/max
groups and no rotation or clipping (``experiments/head_bits.py``'s setting). Only the stored pair
(scale, zero) of a group differs, through :func:`experiments.scale8.quantize`:

- ``fp16``: the float16 pair the quantizer stores today (scale8's group code reproduces
  :mod:`kvcalib.quant.uniform` bit for bit);
- ``log8c``: scale8's 8-bit pair, an 8-bit exponent on a 2^(1/32) grid over a float32 base per
  column and an int8 zero around a float32 column centre, rounded to nearest; the tables come from
  one window of the calibration split (``--calib-data``, never the evaluation text), per layer, side
  and width (:func:`experiments.scale8.calibrate`).

Allocations (``(layer, kv head, side) -> bits``), the greedy rule and its order from ``head_bits``:

- ``fp16 layer-greedy``: the recipe's total code bits spent on whole layers (per side);
- ``log8c layer-greedy``: the same widths with the 8-bit pair: what the format costs;
- ``log8c layer-greedy +saved``: the 8-bit pair, and the bits it saves spent on whole layers too, so
  its bytes match the first row's: what the format buys;
- ``log8c head-greedy +saved``: the same budget spent on single kv heads.

The saving per quantized element and side is the pair's 16 bits over the group, less the log8c
tables counted as cache (two float32 per key channel and per value channel group, per layer and kv
head, over the quantized tokens at ``--context``); it is spent in whole code bits of (layer, kv
head, side) units, rounded down. Scored as ``head_bits`` scores (decode-faithful hooked attention,
KL over the last ``--score-last`` positions, perplexity change, copy windows). Writes
``DIR/scale8_e2e.json`` and ``DIR/scale8_e2e.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from typing import Sequence

import torch

from experiments import head_bits as hb
from experiments import head_sensitivity as hs
from experiments import scale8 as s8

PAIR_BITS = 16  # a float16 scale/zero pair is 2 x 16 bits, the 8-bit pair 2 x 8: 16 saved a group
TABLE_BITS = 2 * 32  # log8c's float32 base and centre per column


class PairCodec:
    """A codec for :func:`head_sensitivity.quantized_heads_attention`: ``cfg`` the layer's layout,
    :meth:`roundtrip_tiers` one flush block at a time through :func:`scale8.quantize` with ``fmt``'s
    pair (keys per channel over the block, values per token over ``v_group`` channels); ``calib``
    (side, bits) -> scale8's tables of this layer's kv heads, of which this codec quantizes
    ``heads`` (the tables' first dim)."""

    def __init__(self, cfg, fmt: str, calib: dict | None, heads: Sequence[int] | None = None):
        self.cfg, self.fmt = cfg, fmt
        idx = None if heads is None else list(heads)
        self.calib = None if calib is None else {
            key: {f: {name: t if idx is None else t[idx] for name, t in parts.items()} for f, parts in tables.items()}
            for key, tables in calib.items()}

    def roundtrip_tiers(self, side: str, x: torch.Tensor, keep=None, positions=None) -> list[torch.Tensor]:
        """x (B, H, N, D), N one flush block (``simulate._blockwise_tiers`` folds blocks into B)."""
        if keep is not None:
            raise ValueError("PairCodec quantizes plain layouts (no outlier mask)")
        bits = self.cfg.k_bits if side == "k" else self.cfg.v_bits
        group = x.shape[2] if side == "k" else self.cfg.v_group
        tables = None if self.calib is None else self.calib[(side, bits)]
        out = torch.stack([s8.quantize(xb, side, bits, group, self.fmt, tables)[0] for xb in x.float()])
        return [out]  # (B, H, N, D) float32


def saved_bits_per_unit(cfg, head_dim: int, context: int) -> float:
    """Bits per quantized element of one (layer, kv head, side) the 8-bit pair saves, net of the
    log8c tables: keys have one pair a channel per ``k_group`` tokens, values one a token per
    ``v_group`` channels, so both save 16 / group; the tables (key channels, value channel groups)
    are spread over the quantized tokens."""
    from kvcalib.layout import quantized_token_count

    nq = quantized_token_count(cfg, context)
    saved = PAIR_BITS / cfg.k_group  # keys and values alike at equal groups (module doc)
    k_tables = TABLE_BITS * head_dim / (nq * head_dim)
    v_tables = TABLE_BITS * (head_dim // cfg.v_group) / (nq * head_dim)
    return saved - max(k_tables, v_tables)


def calibrate_layers(model, ids: torch.Tensor, cfg, widths: Sequence[int]) -> dict:
    """layer -> (side, bits) -> scale8's tables, from one full-precision prefill of ``ids`` (1, T):
    the tokens a cache quantizes (after the sinks, before the window)."""
    from kvcalib.layout import quantized_token_count

    held = ids.shape[1] - 1  # prefill scores the token after its prompt: one is kept for it
    prefix, _ = hs.prefill(model, ids, held)
    nq = quantized_token_count(cfg, held)
    nq -= nq % cfg.k_group  # whole key groups
    out = {}
    for layer, (k, v) in enumerate(prefix):
        span = slice(cfg.sinks, cfg.sinks + nq)
        out[layer] = {(side, bits): s8.calibrate(x[0, :, span].float(), side, bits,
                                                 cfg.k_group if side == "k" else cfg.v_group)
                      for side, x in (("k", k), ("v", v)) for bits in widths}
    return out


def plan(sens: dict, recipe_layers: list[tuple[int, int]], kv_heads: int, saved: float) -> dict[str, tuple[str, dict]]:
    """name -> (pair format, (layer, head, side) -> bits), the allocations of the module doc."""
    base = hb.allocations(sens, recipe_layers, kv_heads)
    kl2 = {(r["layer"], r["head"], r["side"]): r["kl"] for r in sens["rows"] if r["kind"] == "head"}
    recipe = base["recipe-layers"]
    extra = hb.code_bits(recipe) - 2 * len(recipe) + int(math.floor(saved * len(recipe)))
    n_layers = len(recipe_layers)
    layer_units = {(l, s): [(l, h, s) for h in range(kv_heads)] for l in range(n_layers) for s in hb.SIDES}
    head_units = {m: [m] for m in recipe}
    return {"fp16 layer-greedy": ("fp16", base["layer-greedy"]),
            "log8c layer-greedy": ("log8c", base["layer-greedy"]),
            "log8c layer-greedy +saved": ("log8c", hb.per_head(hb.greedy(kl2, layer_units, extra), layer_units)),
            "log8c head-greedy +saved": ("log8c", hb.per_head(hb.greedy(kl2, head_units, extra), head_units))}


def markdown(meta: dict, rows: list[dict], plans: dict) -> str:
    lines = [f"# 8-bit scale and zero end to end: {meta['model']}, {meta['context']} tokens", "",
             f"- `{meta['command']}` on {meta['machine']}, commit {meta['commit']}, {meta['wall_s']:.0f} s",
             f"- every head and side quantized (group {meta['k_group']}, window {meta['window']}, sinks {meta['sinks']}, "
             f"min/max, no rotation or clipping); {meta['windows']} window(s) of `{meta['data']}`, {meta['copy_windows']} "
             f"copy window(s), KL and NLL over the last {meta['score_last']} positions; log8c tables from one window of "
             f"`{meta['calib_data']}`; budget: the code bits of `{meta['recipe']}`'s widths, plus "
             f"{meta['saved_bits']:.4f} bits per unit where the pair is 8-bit", "",
             "| allocation | pair | mean code bits | pair + table bits | KL | per window | Δppl % | copy KL | Δ copy NLL |",
             "|---|---|---:|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        if r["kind"] == "fp":
            continue
        fmt, bits = plans[r["kind"]]
        mean_bits = hb.code_bits(bits) / len(bits)
        side = meta["pair_bits_fp16"] if fmt == "fp16" else meta["pair_bits_fp16"] - meta["saved_bits"]
        per_w = ", ".join(f"{x:.4f}" for x in r["ppl_kl"])
        copy = f"{r['copy_kl_mean']:.4f} | {r['copy_dnll']:+.4f}" if r.get("copy_kl") else " | "
        lines.append(f"| {r['kind']} | {fmt} | {mean_bits:.3f} | {side:.3f} | {r['kl']:.4f} | {per_w} | "
                     f"{r['dppl_pct']:.2f} | {copy} |")
    lines.append("")
    lines.append("Mean code bits + pair bits is what a quantized element costs (the full-precision sinks and window "
                 "are the same in every row).")
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    ap = hb.parser()
    ap.prog = "python -m experiments.scale8_e2e"
    ap.description = __doc__.split("\n\n")[0]
    ap.add_argument("--calib-data", default="longtext", help="text whose calibration split gives the log8c tables")
    return ap


def main(argv: Sequence[str] | None = None, loaded=None, texts: Sequence[str] | None = None,
         calib_text: str | None = None) -> dict:
    """Run and write the outputs; ``loaded``, ``texts`` and ``calib_text`` replace ``--model``,
    ``--data`` and ``--calib-data`` (tests)."""
    args = parser().parse_args(argv)
    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    from benchmarks.long_context import machine
    from kvcalib.layout import LayerConfig

    sens, widths, loaded, layout = hb.load_inputs(args, loaded, "scale8_e2e.json")
    model, tok, info = loaded.model, loaded.tokenizer, loaded.info
    probe = LayerConfig(k_bits=2, v_bits=2, k_axis="channel", **layout)
    saved = saved_bits_per_unit(probe, info.head_dim, args.context)
    plans = plan(sens, widths, info.num_kv_heads, saved)

    device = next(model.parameters()).device
    if calib_text is None:
        from kvcalib.data import load_texts

        calib_text = "\n\n".join(load_texts(args.calib_data, "calib"))
    calib_ids = tok(calib_text, return_tensors="pt").input_ids[:, :args.context]  # (1, <= T)
    if calib_ids.shape[1] < args.context:
        raise SystemExit(f"the calibration split of {args.calib_data} has {calib_ids.shape[1]} tokens, "
                         f"fewer than --context {args.context}")
    calib = calibrate_layers(model, calib_ids.to(device), probe, hb.WIDTHS)

    def codec_for(fmt: str):
        return lambda layer, heads, cfg: PairCodec(cfg, fmt, calib[layer] if fmt != "fp16" else None, heads)

    targets = [hs.Target("fp"), *(hb.allocation(name, bits, layout, codec_for(fmt)) for name, (fmt, bits) in plans.items())]
    rows, win, n_copy = hb.score(model, tok, targets, args, texts, "scale8 e2e")
    meta = {"command": " ".join(shlex.quote(a) for a in ["python", "-m", "experiments.scale8_e2e",
                                                          *(sys.argv[1:] if argv is None else argv)]),
            "machine": machine(), "commit": hs.git_commit(), "torch": torch.__version__, "model": info.name,
            "data": f"{args.data} (eval split)" if texts is None else "given texts",
            "calib_data": f"{args.calib_data} (calib split)" if texts is None else "given text",
            "context": args.context, "windows": args.windows, "copy_windows": n_copy, "score_last": args.score_last,
            "recipe": str(args.recipe), "sensitivity": str(args.sensitivity), **layout,
            "saved_bits": saved, "pair_bits_fp16": PAIR_BITS * 2 / args.group,
            "layers": info.num_layers, "kv_heads": info.num_kv_heads, "window_starts": win.starts,
            "wall_s": time.perf_counter() - t0}
    flat = {name: {"pair": fmt, "bits": [[l, h, s, b] for (l, h, s), b in sorted(bits.items())]}
            for name, (fmt, bits) in plans.items()}
    result = {"meta": meta, "allocations": flat, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scale8_e2e.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "scale8_e2e.md").write_text(markdown(meta, rows, plans))
    return result


if __name__ == "__main__":
    main()
