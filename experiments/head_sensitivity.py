"""Per-head KV sensitivity (issue 53, item 3, "bits where the heads need them"): how unequal is the
damage when ONE kv head's keys (or values) are quantized, the rest of the cache in full precision?
If a few heads carry most of it (above all of the copy metric), per-head bit widths would pay; if it
is spread evenly, per-layer widths (what the recipes have) already capture it.

    python -m experiments.head_sensitivity --model smollm2-135m --context 8192 --windows 8 --out DIR
        [--device cuda] [--bits 2] [--layers all|0,5,10-12] [--copy-windows N] [--score-last 1024]
    python -m experiments.head_sensitivity --replot DIR      (the PNG and table again from DIR's JSON)

What one row measures. A target is (layer, kv heads, sides): only those heads' K (or V) are
quantized, with the shipped recipes' layout (keys per channel over groups of ``--group`` tokens,
values per token over groups of ``--group`` channels, plain uniform quantizer of
:class:`kvcalib.codec.LayerCodec`, no rotation or fitted tensors; ``--window`` recent tokens and
``--sinks`` first tokens in full precision, flushes in blocks of ``--group`` tokens). Each window of
``--context`` tokens is a prompt of ``context - score_last`` tokens (attended in full precision by
itself, then compressed, as the search's ``--score-last`` and the runtime's prefill do) followed by
``score_last`` teacher-forced decode steps that see exactly what the runtime cache shows them
(:func:`kvcalib.simulate.quantized_mask`: key j is quantized for query i once j's block is flushed;
values as the codec's round trip, :func:`kvcalib.simulate._blockwise_tiers`). Per row:

- ``kl``: KL(full precision || quantized) of the next-token distribution, mean over the last
  ``score_last`` positions of each ordinary window (the search objective's ordinary part);
- ``dppl_pct``: the perplexity change of those positions' tokens, ``100 (exp(mean NLL) / exp(mean NLL fp) - 1)``;
- ``copy_kl`` / ``copy_nll`` / ``copy_dnll``: on copy windows (:func:`kvcalib.eval.copy.copy_windows`:
  the window's tail replaced by a copy of its start, so the scored decode steps can be predicted only
  by reading back through the compressed cache), the KL and the NLL of the copied tail, and the NLL
  minus full precision's.

Rows: ``fp`` (nothing quantized: KL 0 by construction), ``noise`` (layer 0's heads through this
script's attention with nothing quantized: the float floor of every KL here), ``layer`` (all kv heads
of one layer, per side, the reference a per-layer width sees) and ``head`` (one kv head, per side).

How it stays cheap (and exact). The prompt's positions never see a quantized key, so their hidden
states are full precision's in every layer: each batch of windows is prefilled once in full
precision (``DynamicCache``), and each target re-runs only the ``score_last`` decode positions
against that prefix (an 8x smaller forward at 8192 / 1024). The attention is hooked the way
:mod:`kvcalib.simulate` hooks it (an ``AttentionInterface`` function, ``sdpa_mask`` for its
masks): transformers' own SDPA for every head, then the target heads' query heads recomputed with the
quantized keys/values, so the other heads' outputs are SDPA's bit for bit. The unit test checks
the logits against :func:`kvcalib.simulate.simulated_logits` (the decode-faithful simulation, itself
proven against a real decode).

GPU time (estimate, H200, SmolLM2-135M in float32, 8 windows of 8192, 8 copy windows, batch 8):
2 + 2 x 30 x (1 + 3) = 242 targets x 2 batches (ordinary, copy) = 484 continuation forwards of
8 x 1024 tokens over 8192 keys. Each is ~2.3 TFLOP of weights and lm head plus ~4.6 TFLOP of
attention (30 layers x 8 x 9 heads x 1024 x 8192 x 64 x 4) at fp32 SDPA/GEMM rates (~25-40 TFLOP/s
effective) -> ~0.2-0.3 s, plus the target layer's float32 einsum attention and the float64 KL of
8 x 1024 x 49152 logits (~0.05 s): ~2-3 minutes of forwards, plus the two 8 x 8192 prefills (~5 s)
and model load: about 3-4 minutes in all, under the ~5-minute bar. If it runs long (the first
progress ticks show the rate; the JSON records ``wall_s``), cut it with ``--copy-windows 4`` and
``--windows 4`` (halves it; the per-window values are in the JSON to judge the spread) or
``--layers 0-14`` then ``--layers 15-29`` into two ``--out`` folders (two runs of half the time each;
each writes its own table). ``--dtype bf16`` would be ~2x faster, but the target heads are recomputed
in float32 beside bf16 SDPA, so its noise row would be far above fp32's (~1e-11) and near the smaller
heads' damage; keep fp32. Not measured on a GPU yet: the only timing is a CPU smoke run (512 tokens,
1 window, 2 layers, 36 forwards of 128 tokens: 185 s on 2 cores shared with another job), which says
nothing about H200 rates. Outputs are written at the end only: give the run a limit above the
estimate (600 s) or split it by ``--layers``.

Writes ``DIR/head_sensitivity.json`` (rows, the summary, the command, machine, git commit, wall time),
``DIR/head_sensitivity.md`` (per side: the share of the heads' total KL / copy KL carried by the top 5
and the top 10 % of heads, the Gini coefficient, how much of a layer's damage its worst head carries,
the top 10 heads) and ``DIR/head_sensitivity.png`` (layers x heads heatmaps, K and V).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch

ROOT = Path(__file__).resolve().parents[1]
ATTN = "kvcalib_head_sensitivity"
SIDES = ("k", "v")


@dataclass(frozen=True)
class Target:
    """Which kv ``heads`` of ``layer`` see their ``sides`` quantized (empty ``sides``: routed through
    the quantized path with nothing quantized: the noise floor); ``kind`` names the row."""

    kind: str  # "fp" | "noise" | "layer" | "head"
    layer: int | None = None
    heads: tuple[int, ...] = ()
    sides: tuple[str, ...] = ()

    def row_key(self) -> dict:
        side = self.sides[0] if len(self.sides) == 1 else None
        head = self.heads[0] if self.kind == "head" else None
        return {"kind": self.kind, "layer": self.layer, "head": head, "side": side}


@dataclass(frozen=True)
class Allocation:
    """A whole cache's per-head widths (``experiments/head_bits.py``): ``groups[layer]`` lists
    ``(kv heads, sides, codec)``, each codec quantizing those heads' sides at its own bits; heads
    not listed stay in full precision. ``kind`` names the row."""

    kind: str
    groups: dict  # layer -> list[tuple[tuple[int, ...], tuple[str, ...], LayerCodec]]

    def row_key(self) -> dict:
        return {"kind": self.kind, "layer": None, "head": None, "side": None}


@dataclass
class _State:
    groups: dict  # layer -> list[(heads, sides, codec)]: what the hooked attention quantizes there
    prompt_len: int


_STATE: _State | None = None


def quantized_heads_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, codec, heads: Sequence[int],
                              sides: Sequence[str], prompt_len: int, scale: float) -> torch.Tensor:
    """Attention of the query heads of kv ``heads`` with their ``sides`` quantized as decoding sees
    them. ``query`` (B, Hq, C, D) holds the queries of positions ``T - C .. T - 1``, ``key``/``value``
    (B, H, T, D) every position (causal, no padding). Returns (B, len(heads) * rep, C, D) in the
    order of the query heads (kv head h has query heads ``h * rep .. h * rep + rep - 1``)."""
    from kvcalib.layout import quantized_token_count
    from kvcalib.runtime.reference import compute_dtype
    from kvcalib.simulate import SCORE_BUDGET, _blockwise_tiers, quantized_mask

    cfg = codec.cfg
    b, hq, c, d = query.shape
    h, t = key.shape[1], key.shape[2]
    rep, idx = hq // h, list(heads)
    acc = compute_dtype(query.dtype)
    q = query.reshape(b, h, rep, c, d)[:, idx].to(acc)  # (B, n, rep, C, D)
    k, v = key[:, idx].to(acc), value[:, idx].to(acc)  # (B, n, T, D)
    nq = quantized_token_count(cfg, t)
    hats = {}  # side -> (B, n, T, D) as the packed storage gives it back
    for side, x in (("k", k), ("v", v)):
        if side in sides and nq:
            span = slice(cfg.sinks, cfg.sinks + nq)
            hat = x.clone()
            hat[:, :, span] = _blockwise_tiers(codec, side, x[:, :, span], None, cfg.flush_block)[0].to(acc)
            hats[side] = hat
    out = torch.empty(b, len(idx), rep, c, d, dtype=acc, device=query.device)
    chunk = max(1, SCORE_BUDGET // max(1, b * len(idx) * rep * t))
    first = t - c
    for r0 in range(0, c, chunk):
        r1 = min(c, r0 + chunk)
        rows = slice(first + r0, first + r1)
        qc = q[:, :, :, r0:r1]  # (B, n, rep, C', D)
        quant = quantized_mask(cfg, t, prompt_len, query.device, rows, t)  # (C', T)
        pos = torch.arange(rows.start, rows.stop, device=query.device)[:, None]  # (C', 1)
        vis = torch.arange(t, device=query.device)[None, :] <= pos  # (C', T) causal
        scores = torch.einsum("bhrcd,bhtd->bhrct", qc, k) * scale  # (B, n, rep, C', T)
        if "k" in hats:
            scores = torch.where(quant, torch.einsum("bhrcd,bhtd->bhrct", qc, hats["k"]) * scale, scores)
        probs = torch.softmax(scores.masked_fill(~vis, float("-inf")), dim=-1)
        del scores
        if "v" in hats:
            p_q = probs * quant
            out[:, :, :, r0:r1] = (torch.einsum("bhrct,bhtd->bhrcd", probs - p_q, v)
                                   + torch.einsum("bhrct,bhtd->bhrcd", p_q, hats["v"]))
        else:
            out[:, :, :, r0:r1] = torch.einsum("bhrct,bhtd->bhrcd", probs, v)
    return out.reshape(b, len(idx) * rep, c, d)


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """AttentionInterface function: transformers' SDPA, then the target layer's target heads
    recomputed by :func:`quantized_heads_attention` (decode positions only: the prompt's own
    attention sees nothing quantized)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, **kwargs)  # (B, C, Hq, D)
    state = _STATE
    groups = None if state is None else state.groups.get(int(module.layer_idx))
    if not groups or query.shape[2] == key.shape[2]:
        return out, weights
    if kwargs.get("softcap") or getattr(module, "sliding_window", None):
        raise ValueError("head_sensitivity covers full-attention layers without softcapping")
    rep = query.shape[1] // key.shape[1]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = out.clone()
    for heads, sides, codec in groups:
        got = quantized_heads_attention(query, key, value, codec, heads, sides, state.prompt_len,
                                        scale)  # (B, n * rep, C, D)
        qheads = [h * rep + r for h in heads for r in range(rep)]
        out[:, :, qheads] = got.transpose(1, 2).to(out.dtype)
    return out, weights


@contextlib.contextmanager
def hooked(model) -> Iterator[None]:
    """Within the block the model's attention is :func:`_attention` (set the target with :func:`target`)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTN, _attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN, sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTN)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


@contextlib.contextmanager
def target(t: Target | Allocation | None, codec, prompt_len: int) -> Iterator[None]:
    """Within the block the hooked attention quantizes ``t``'s heads (an :class:`Allocation`: its
    own codecs; a :class:`Target`: ``codec``)."""
    global _STATE
    if isinstance(t, Allocation):
        _STATE = _State(t.groups, prompt_len)
    else:
        _STATE = None if t is None or t.layer is None else _State({t.layer: [(t.heads, t.sides, codec)]}, prompt_len)
    try:
        yield
    finally:
        _STATE = None


@torch.no_grad()
def prefill(model, ids: torch.Tensor, prompt_len: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """Full-precision prefill of ``ids[:, :prompt_len]`` (B, P): the per-layer (K, V) prefix and the
    NLL (B,) of token ``prompt_len`` (the first scored token; its logit is the prompt's last)."""
    from transformers import DynamicCache

    from kvcalib.models import cache_kwarg

    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids[:, :prompt_len], **{cache_kwarg(model): cache}, use_cache=True, logits_to_keep=1)
    nll0 = torch.nn.functional.cross_entropy(out.logits[:, -1].float(), ids[:, prompt_len], reduction="none")
    return [(k, v) for k, v, *_ in cache], nll0.double()


@torch.no_grad()
def continuation_logits(model, ids: torch.Tensor, prefix, prompt_len: int, tgt: Target | None, codec) -> torch.Tensor:
    """Logits (B, T - P, V) float32 of positions ``P .. T - 1`` of ``ids`` (B, T), decode-faithful
    with ``tgt``'s heads quantized (None: full precision), over the full-precision ``prefix``."""
    from transformers import DynamicCache

    from kvcalib.models import cache_kwarg

    cache = DynamicCache(ddp_cache_data=prefix, config=model.config)  # a copy: update() concatenates
    with target(tgt, codec, prompt_len):
        logits = model(input_ids=ids[:, prompt_len:], **{cache_kwarg(model): cache}, use_cache=True).logits
    return logits.float()


def targets_for(layers: Sequence[int], kv_heads: int, sides: Sequence[str]) -> list[Target]:
    out = [Target("fp"), Target("noise", layers[0], tuple(range(kv_heads)), ())]
    for layer in layers:
        for side in sides:
            out.append(Target("layer", layer, tuple(range(kv_heads)), (side,)))
            out.extend(Target("head", layer, (h,), (side,)) for h in range(kv_heads))
    return out


def parse_layers(spec: str, n: int) -> list[int]:
    if spec == "all":
        return list(range(n))
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    if not out or any(not 0 <= i < n for i in out):
        raise SystemExit(f"--layers {spec!r}: layers lie in 0..{n - 1}")
    return sorted(set(out))


@torch.no_grad()
def measure(model, sets: dict[str, torch.Tensor], targets: Sequence[Target], codec, prompt_len: int,
            batch: int, bar=None) -> list[dict]:
    """Per target and window set (``ppl``, ``copy``): per-window mean KL over the scored positions and
    mean NLL of the scored tokens. Returns one row per target with ``{set}_kl`` / ``{set}_nll`` lists."""
    from kvcalib.optimize.objective import kl_to_reference

    device = next(model.parameters()).device
    rows = [{**t.row_key(), **{f"{s}_{m}": [] for s in sets for m in ("kl", "nll")}} for t in targets]
    with hooked(model):
        for name, ids_all in sets.items():
            for b0 in range(0, ids_all.shape[0], batch):
                ids = ids_all[b0:b0 + batch].to(device)  # (B, T)
                prefix, nll0 = prefill(model, ids, prompt_len)
                ref = continuation_logits(model, ids, prefix, prompt_len, None, codec)  # (B, S, V)
                for row, tgt in zip(rows, targets):
                    logits = ref if tgt.kind == "fp" else continuation_logits(model, ids, prefix, prompt_len, tgt, codec)
                    nll = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, prompt_len + 1:],
                                                            reduction="none").double()  # (B, S - 1)
                    row[f"{name}_nll"] += ((nll.sum(1) + nll0) / (nll.shape[1] + 1)).tolist()
                    # the reference's log-probs in float64 as kl_to_reference takes the other side's: fp reads 0
                    row[f"{name}_kl"] += [kl_to_reference(torch.log_softmax(ref[i].double(), -1), logits[i], 0)
                                          for i in range(ids.shape[0])]
                    if bar is not None:
                        bar.advance(1, info=f"{name} {tgt.kind} L{row['layer']} h{row['head']} {row['side']}")
                del prefix, ref
    return rows


def finish_rows(rows: list[dict]) -> list[dict]:
    """Means and deltas against the ``fp`` row."""
    fp = next(r for r in rows if r["kind"] == "fp")
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    for r in rows:
        r["kl"], r["nll"] = mean(r["ppl_kl"]), mean(r["ppl_nll"])
        r["dppl_pct"] = 100.0 * math.expm1(r["nll"] - mean(fp["ppl_nll"]))
        if r["copy_kl"]:
            r["copy_kl_mean"], r["copy_nll_mean"] = mean(r["copy_kl"]), mean(r["copy_nll"])
            r["copy_dnll"] = r["copy_nll_mean"] - mean(fp["copy_nll"])
    return rows


def gini(xs: Sequence[float]) -> float:
    """Gini coefficient of non-negative values (0: all equal; 1 - 1/n: one carries everything)."""
    x = sorted(max(0.0, v) for v in xs)
    n, total = len(x), sum(x)
    if not n or total <= 0:
        return 0.0
    return 2.0 * sum((i + 1) * v for i, v in enumerate(x)) / (n * total) - (n + 1) / n


def concentration(heads: list[dict], metric: str) -> dict:
    """How unequal ``metric`` is over the single-head rows of one side."""
    vals = [max(0.0, r[metric]) for r in heads]
    total = sum(vals)
    order = sorted(vals, reverse=True)
    n10 = max(1, math.ceil(0.1 * len(vals)))
    by_layer: dict[int, list[float]] = {}
    for r, v in zip(heads, vals):
        by_layer.setdefault(r["layer"], []).append(v)
    # per-layer widths already buy what differs between layers; per-head widths only what differs
    # within one: the damage-weighted share of a layer's heads' damage its worst head carries
    within = sum(max(v) for v in by_layer.values()) / total if total else float("nan")
    return {"heads": len(vals), "total": total, "top5_share": sum(order[:5]) / total if total else float("nan"),
            "top10pct_heads": n10, "top10pct_share": sum(order[:n10]) / total if total else float("nan"),
            "gini": gini(vals), "worst_head_share_within_layer": within,
            "even_top5_share": min(5, len(vals)) / len(vals), "even_within_layer": 1.0 / max(len(v) for v in by_layer.values())}


def summarise(rows: list[dict], sides: Sequence[str]) -> dict:
    out = {}
    for side in sides:
        heads = [r for r in rows if r["kind"] == "head" and r["side"] == side]
        layer_rows = [r for r in rows if r["kind"] == "layer" and r["side"] == side]
        metrics = ["kl"] + (["copy_kl_mean"] if heads and "copy_kl_mean" in heads[0] else [])
        out[side] = {m: concentration(heads, m) for m in metrics}
        out[side]["sum_heads_over_layer_rows_kl"] = (sum(r["kl"] for r in heads) / sum(r["kl"] for r in layer_rows)
                                                     if layer_rows and sum(r["kl"] for r in layer_rows) > 0 else None)
    return out


def markdown(meta: dict, rows: list[dict], summary: dict) -> str:
    noise = next(r for r in rows if r["kind"] == "noise")
    lines = [f"# Per-head KV sensitivity: {meta['model']}, {meta['context']} tokens", "",
             f"- one kv head's K or V at {meta['bits']} bits (group {meta['group']}, window {meta['window']}, "
             f"sinks {meta['sinks']}), the rest in full precision; KL and NLL over the last {meta['score_last']} "
             f"positions of {meta['windows']} window(s) of `{meta['data']}` and {meta['copy_windows']} "
             f"copy window(s); dtype {meta['dtype']}",
             f"- noise floor (layer {noise['layer']} through the hooked attention, nothing quantized): KL {noise['kl']:.2e}",
             f"- `{meta['command']}` on {meta['machine']}, commit {meta['commit'][:12]}, {meta['wall_s']:.0f} s", "",
             "## How concentrated is the damage", "",
             "| side | metric | heads | total | top 5 share (even) | top 10 % share | Gini | worst head of a layer "
             "(even) | sum of heads / layer rows |", "|---|---|---|---|---|---|---|---|---|"]
    for side, per in summary.items():
        for metric, c in per.items():
            if not isinstance(c, dict):
                continue
            ratio = per.get("sum_heads_over_layer_rows_kl")
            lines.append(f"| {side.upper()} | {metric.replace('_mean', '')} | {c['heads']} | {c['total']:.4g} | "
                         f"{c['top5_share']:.2f} ({c['even_top5_share']:.2f}) | {c['top10pct_share']:.2f} "
                         f"({c['top10pct_heads']} heads) | {c['gini']:.2f} | {c['worst_head_share_within_layer']:.2f} "
                         f"({c['even_within_layer']:.2f}) | {'' if ratio is None or metric != 'kl' else f'{ratio:.2f}'} |")
    for side in summary:
        heads = sorted((r for r in rows if r["kind"] == "head" and r["side"] == side), key=lambda r: -r["kl"])
        total = sum(max(0.0, r["kl"]) for r in heads) or float("nan")
        lines += ["", f"## Top 10 heads, {side.upper()} (by KL)", "",
                  "| layer | kv head | KL | share | Δppl % | copy KL | Δ copy NLL |", "|---|---|---|---|---|---|---|"]
        for r in heads[:10]:
            lines.append(f"| {r['layer']} | {r['head']} | {r['kl']:.4g} | {max(0.0, r['kl']) / total:.3f} | "
                         f"{r['dppl_pct']:.3f} | {r.get('copy_kl_mean', float('nan')):.4g} | "
                         f"{r.get('copy_dnll', float('nan')):+.4f} |")
    lines += ["", "![heatmap](head_sensitivity.png)", ""]
    return "\n".join(lines)


def heatmap(rows: list[dict], sides: Sequence[str], kv_heads: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    metrics = [m for m in ("kl", "copy_kl_mean") if any(m in r for r in rows if r["kind"] == "head")]
    layers = sorted({r["layer"] for r in rows if r["kind"] == "head"})
    fig, axes = plt.subplots(len(metrics), len(sides), squeeze=False, layout="constrained",
                             figsize=(2.2 * len(sides) + 1.5, (0.18 * len(layers) + 1.2) * len(metrics)))
    for i, metric in enumerate(metrics):
        vals = [max(r[metric], 1e-12) for r in rows if r["kind"] == "head"]
        norm = LogNorm(vmin=max(min(vals), max(vals) * 1e-4), vmax=max(vals))
        for j, side in enumerate(sides):
            grid = torch.full((len(layers), kv_heads), float("nan"))
            for r in rows:
                if r["kind"] == "head" and r["side"] == side:
                    grid[layers.index(r["layer"]), r["head"]] = max(r[metric], 1e-12)
            ax = axes[i][j]
            im = ax.imshow(grid.numpy(), aspect="auto", norm=norm, cmap="magma")
            ax.set_title(f"{side.upper()}: {metric.replace('_mean', '')}", fontsize=9)
            ax.set_xticks(range(kv_heads), [str(h) for h in range(kv_heads)], fontsize=7)
            ax.set_yticks(range(len(layers)), [str(x) for x in layers], fontsize=6)
            ax.set_xlabel("kv head", fontsize=8)
            if j == 0:
                ax.set_ylabel("layer", fontsize=8)
        fig.colorbar(im, ax=list(axes[i]), shrink=0.8)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):  # a copy of the tree without .git (a device machine)
        import os

        return os.environ.get("GIT_COMMIT", "unknown")


def window_sets(args, tok, texts: Sequence[str] | None):
    """The evaluation windows of ``args.data`` (or ``texts``) and the window sets to score: ``ppl``
    (B, context) and, from the first ``--copy-windows``, ``copy``. Returns (windows, sets, copies)."""
    from kvcalib.eval.copy import copy_windows
    from kvcalib.eval.harness import eval_texts
    from kvcalib.eval.windows import eval_windows, leading_bos

    win = eval_windows(list(texts) if texts is not None else eval_texts(args.data), tok, args.context, args.windows,
                       args.seed, what=f"the evaluation split of {args.data}")
    n_copy = args.windows if args.copy_windows is None else min(args.copy_windows, args.windows)
    sets = {"ppl": win.ids}
    if n_copy:
        offset = 1 if leading_bos(tok) is not None else 0
        sets["copy"] = copy_windows(win.ids[:n_copy], args.score_last, offset).ids
    return win, sets, n_copy


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m experiments.head_sensitivity", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--data", default="longtext", help="text whose evaluation split gives the windows")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--copy-windows", type=int, default=None, help="copy windows, made from the first N windows "
                    "(default: all of them; 0: none)")
    ap.add_argument("--score-last", type=int, default=1024, help="decode steps scored per window (the rest is the prompt)")
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--layers", default="all", help="all, or e.g. 0,5,10-12")
    ap.add_argument("--sides", default="k,v")
    ap.add_argument("--batch", type=int, default=8, help="windows per forward")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="a new folder for the outputs (required unless --replot)")
    ap.add_argument("--replot", type=Path, default=None,
                    help="draw DIR/head_sensitivity.png (and the table) again from DIR's JSON, run nothing "
                         "(where the run's machine had no matplotlib)")
    return ap


def replot(folder: Path) -> None:
    data = json.loads((folder / "head_sensitivity.json").read_text())
    meta, rows = data["meta"], data["rows"]
    (folder / "head_sensitivity.md").write_text(markdown(meta, rows, data["summary"]))
    heatmap(rows, meta["sides"], 1 + max(r["head"] for r in rows if r["kind"] == "head"),
            folder / "head_sensitivity.png")


def main(argv: Sequence[str] | None = None, loaded=None, texts: Sequence[str] | None = None) -> dict:
    """Run and write the outputs; ``loaded`` (a LoadedModel) and ``texts`` replace ``--model`` and
    ``--data`` (tests). Returns ``{"meta", "rows", "summary"}``."""
    ap = parser()
    args = ap.parse_args(argv)
    if args.replot is not None:
        replot(args.replot)
        return json.loads((args.replot / "head_sensitivity.json").read_text())
    if args.out is None:
        ap.error("--out is required")
    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    from benchmarks.long_context import machine
    from kvcalib.codec import LayerCodec
    from kvcalib.layout import LayerConfig
    from kvcalib.models import load_model
    from kvcalib.progress import ProgressBar

    if (args.out / "head_sensitivity.json").exists():  # a run folder records one run: never overwritten
        raise SystemExit(f"{args.out} holds a run already: pass a new --out")
    loaded = loaded or load_model(args.model, device=args.device, dtype=args.dtype)
    model, tok, info = loaded.model, loaded.tokenizer, loaded.info
    if any(w is not None for w in info.sliding_window):
        raise SystemExit(f"{info.name} has sliding-window layers: this experiment covers full-attention models")
    cfg = LayerConfig(k_bits=args.bits, v_bits=args.bits, k_axis="channel", k_group=args.group, v_group=args.group,
                      sinks=args.sinks, window=args.window)
    cfg.check_head_dim(info.head_dim)
    codec = LayerCodec(cfg)
    prompt_len = args.context - args.score_last
    win, sets, n_copy = window_sets(args, tok, texts)
    layers = parse_layers(args.layers, info.num_layers)
    sides = tuple(s for s in args.sides.split(",") if s)
    targets = targets_for(layers, info.num_kv_heads, sides)
    batches = sum(math.ceil(ids.shape[0] / args.batch) for ids in sets.values())
    with ProgressBar(batches * len(targets), "head sensitivity", "forwards") as bar:
        rows = finish_rows(measure(model, sets, targets, codec, prompt_len, args.batch, bar))
    meta = {"command": " ".join(shlex.quote(a) for a in ["python", "-m", "experiments.head_sensitivity",
                                                          *(sys.argv[1:] if argv is None else argv)]),
            "machine": machine(), "commit": git_commit(), "torch": torch.__version__, "model": info.name,
            "data": f"{args.data} (eval split)" if texts is None else "given texts", "context": args.context, "windows": args.windows,
            "copy_windows": n_copy, "score_last": args.score_last, "bits": args.bits, "group": args.group,
            "window": args.window, "sinks": args.sinks, "layers": layers, "sides": list(sides), "seed": args.seed,
            "dtype": str(next(model.parameters()).dtype), "window_starts": win.starts,
            "wall_s": time.perf_counter() - t0}
    summary = summarise(rows, sides)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"meta": meta, "summary": summary, "rows": rows}
    (args.out / "head_sensitivity.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "head_sensitivity.md").write_text(markdown(meta, rows, summary))
    try:
        heatmap(rows, sides, info.num_kv_heads, args.out / "head_sensitivity.png")
    except ImportError as err:  # the GPU machine's image may lack matplotlib: the JSON holds everything
        print(f"no heatmap ({err}); draw it elsewhere: python -m experiments.head_sensitivity --replot {args.out}",
              file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
