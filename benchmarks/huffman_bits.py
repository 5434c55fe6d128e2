"""Huffman coding of the quantized cache, measured on real K/V: held-out bits and drift.

Two measurements, both on K/V that the model really produces and quantized exactly as the
recipe's cache stores them:

- Held-out. The model runs over windows of the *evaluation* split
  (:func:`kvcalib.eval.harness.eval_texts`, never the calibration split). Post-RoPE keys and values
  are recorded per layer by :func:`kvcalib.collection.recording`, the recording attention that
  collection uses. Each window is ``seq_len`` tokens. Of those, the tokens a cache of that length
  would hold packed (after the sinks; all whole flush blocks that have left the window) are
  quantized one flush block at a time by the recipe's codec. They are coded with the recipe's
  codebooks in the cache stream layout (:mod:`kvcalib.methods.huffman`) and decoded again
  (bit-exact, checked). Reported per layer and side: stream bits per symbol, actual against the
  calibration estimate (expected code length under the calibration histogram); the held-out
  order-0 entropy; the fraction of streams stored raw; the exact index bytes. Then the effective
  bits at ``context`` (4096 by default), uncoded against coded, all else counted as
  ``Recipe.memory`` counts it (:func:`kvcalib.methods.huffman.entropy_memory`).
- Drift during generation (KVComp's open question: do codebooks built once stay good?). From an
  evaluation-split prompt, the full-precision model greedily generates ``drift_new_tokens``
  tokens. Prompt plus generation go through one teacher-forced forward, which gives the K/V of
  every generated token. Decoding would give the same values up to float rounding; a code flip
  changes the bit count by a code length at most. Each window of ``drift_window`` generated tokens
  is quantized and coded as above, and its bits per symbol are set against the calibration
  estimate of the same layers and sides.

:func:`huffman_report` runs both for several recipes of one collected run and writes JSON and a
markdown table (``scripts/huffman_bits.sh``).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch

from kvcalib.methods.huffman import (SIDES, Key, StreamLayout, add_codebooks,
                                         decode_cache_streams, encode_cache_streams, entropy_memory,
                                         flush_codes, layer_histograms, load_codebooks, strip_codebooks,
                                         symbol_entropy)
from kvcalib.errors import KvcalibError
from kvcalib.quant.huffman import build_codebook, symbol_histogram
from kvcalib.layout import LayerConfig, held_tokens, quantized_token_count
from kvcalib.recipe import Recipe

if TYPE_CHECKING:  # pragma: no cover
    from kvcalib.models import LoadedModel, ModelInfo
    from kvcalib.stats import CollectedStats

__all__ = ["EntropyConfig", "KVCapture", "SideTally", "capture_kv", "drift_check", "heldout_bits",
           "huffman_report", "markdown_report", "measure_recipe"]


@dataclass
class EntropyConfig:
    """What the measurement runs; lengths in tokens."""

    data: str = "embedded"  # --data source; only its evaluation split is read
    samples: int = 4  # held-out windows
    seq_len: int = 1024
    context: int = 4096  # T of the effective-bits accounting
    drift_prompt_len: int = 256
    drift_new_tokens: int = 256
    drift_window: int = 64
    tokens_per_stream: int = 1
    chunk_tokens: int = 32
    seed: int = 0
    verify: bool = True  # decode every coded side and require the codes back bit for bit
    sweep_tokens_per_stream: tuple[int, ...] = ()  # other stream lengths to account (held-out only)

    def __post_init__(self) -> None:
        for name in ("samples", "seq_len", "context", "drift_prompt_len", "drift_window"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise KvcalibError(f"{name} must be a positive integer, got {v!r}")
        if isinstance(self.drift_new_tokens, bool) or not isinstance(self.drift_new_tokens, int) \
                or self.drift_new_tokens < 0:
            raise KvcalibError(f"drift_new_tokens must be an integer >= 0, got {self.drift_new_tokens!r}")
        if self.drift_new_tokens % self.drift_window:
            raise KvcalibError(f"drift_new_tokens ({self.drift_new_tokens}) must be a multiple of "
                               f"drift_window ({self.drift_window})")
        self.sweep_tokens_per_stream = tuple(self.sweep_tokens_per_stream)
        try:
            for tps in (self.tokens_per_stream, *self.sweep_tokens_per_stream):
                StreamLayout(tps, self.chunk_tokens)
        except ValueError as err:
            raise KvcalibError(str(err)) from None

    @property
    def layout(self) -> StreamLayout:
        return StreamLayout(self.tokens_per_stream, self.chunk_tokens)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["sweep_tokens_per_stream"] = list(self.sweep_tokens_per_stream)
        return out


# ----------------------------------------------------------------------------------------------
# recording K/V


class KVCapture:
    """Keeps the post-RoPE K/V of every layer from one forward (an observer for
    :func:`kvcalib.collection.recording`)."""

    def __init__(self, num_layers: int) -> None:
        self.k: list[torch.Tensor | None] = [None] * num_layers  # (B, H, T, D) float32
        self.v: list[torch.Tensor | None] = [None] * num_layers

    def observe(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                scaling: float) -> None:
        self.k[layer] = key.detach().float().cpu()
        self.v[layer] = value.detach().float().cpu()


@torch.no_grad()
def capture_kv(model, ids: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Post-RoPE keys and values of every layer for ``ids`` ``(B, T)`` (no padding), as the cache
    would receive them: two lists of ``(B, H, T, D)`` float32 on the CPU."""
    from kvcalib.collection import recording

    n_layers = model.config.get_text_config().num_hidden_layers
    cap = KVCapture(n_layers)
    device = next(model.parameters()).device
    body = getattr(model, "model", model)  # the LM head is not needed
    with recording(model, cap):  # type: ignore[arg-type]  (any object with observe())
        body(input_ids=ids.to(device), attention_mask=torch.ones_like(ids).to(device), use_cache=False)
    missing = [i for i, k in enumerate(cap.k) if k is None]
    if missing:
        raise KvcalibError(f"layers {missing} never went through the recording attention: this model's "
                           "attention does not use transformers' AttentionInterface")
    return cap.k, cap.v  # type: ignore[return-value]


# ----------------------------------------------------------------------------------------------
# coding one span


@dataclass
class SideTally:
    """Running totals of one (layer, side) over the spans coded so far."""

    symbols: int = 0
    stream_bits: int = 0
    streams: int = 0
    raw_streams: int = 0
    payload_bytes: int = 0
    index_bytes: int = 0
    hist: torch.Tensor | None = None  # (2**bits,) int64 held-out symbol counts

    def add(self, other: "SideTally") -> None:
        for name in ("symbols", "stream_bits", "streams", "raw_streams", "payload_bytes", "index_bytes"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.hist = other.hist.clone() if self.hist is None else self.hist + other.hist

    @property
    def bits_per_symbol(self) -> float:
        return self.stream_bits / max(self.symbols, 1)


def _code_span(codes: torch.Tensor, codebook, bits: int, layout: StreamLayout, verify: bool) -> SideTally:
    """Code ``codes`` ``uint8 (B, H, N, D)`` in the cache stream layout; optionally check the
    decode."""
    streams = encode_cache_streams(codes, codebook, layout)
    if verify and not torch.equal(decode_cache_streams(streams, codebook), codes):
        raise RuntimeError("kvcalib bug: Huffman round trip of the cache stream layout is not bit-exact")
    nb = streams.nbytes()
    return SideTally(symbols=codes.numel(), stream_bits=streams.stream_bits(),
                     streams=int(streams.stream_excess.numel()), raw_streams=int(streams.raw_fallback().sum()),
                     payload_bytes=nb["payload"], index_bytes=nb["chunk_index"] + nb["stream_index"],
                     hist=symbol_histogram(codes, bits))


def _span_tallies(codecs: list[Any], configs: list[LayerConfig], books: dict[Key, Any], ks: list[torch.Tensor],
                  vs: list[torch.Tensor], span: Any, layout: StreamLayout, verify: bool) -> dict[Key, SideTally]:
    """Tallies of every coded side for tokens ``span(cfg, T) -> (start, n)`` of each layer."""
    out: dict[Key, SideTally] = {}
    for (i, side), cb in sorted(books.items()):
        x = (ks if side == "k" else vs)[i]  # (B, H, T, D)
        start, n = span(configs[i], x.shape[2])
        if n <= 0:
            continue
        codes = flush_codes(codecs[i], side, x[:, :, start:start + n])  # (B, H, n, D)
        out[(i, side)] = _code_span(codes, cb, cb.bits, layout, verify)
    return out


def _packed_span(cfg: LayerConfig, t: int) -> tuple[int, int]:
    """Tokens a cache holding ``t`` tokens keeps packed: after the sinks, whole flush blocks that
    have left the window."""
    return min(cfg.sinks, t), quantized_token_count(cfg, t)


# ----------------------------------------------------------------------------------------------
# held-out measurement


def heldout_bits(recipe: Recipe, info: "ModelInfo", calib_hists: dict[Key, torch.Tensor],
                 kv_samples: Sequence[tuple[list[torch.Tensor], list[torch.Tensor]]],
                 config: EntropyConfig) -> dict[str, Any]:
    """Per layer/side held-out bits per symbol vs the calibration estimate, and effective bits.

    Args:
        recipe: the recipe with codebooks (:func:`~kvcalib.methods.huffman.add_codebooks`).
        info: the model's geometry.
        calib_hists: calibration histograms of every quantized side
            (:func:`~kvcalib.methods.huffman.layer_histograms`).
        kv_samples: ``(keys, values)`` per held-out window, from :func:`capture_kv`.
        config: lengths, layout, accounting context.
    """
    from kvcalib.recipe import build_codecs

    configs = recipe.layer_configs(info.num_layers)
    codecs = build_codecs(strip_codebooks(recipe), configs, info.head_dim)
    coded = load_codebooks(recipe, configs)
    books = {k: coded.get(k) or build_codebook(h) for k, h in calib_hists.items()}  # measure every side
    tallies: dict[Key, SideTally] = {}
    for ks, vs in kv_samples:
        for key, tally in _span_tallies(codecs, configs, books, ks, vs, _packed_span, config.layout,
                                        config.verify).items():
            tallies.setdefault(key, SideTally()).add(tally)
    rows = []
    for (i, side), t in sorted(tallies.items()):
        cb, h = books[(i, side)], calib_hists[(i, side)]
        rows.append({
            "layer": i, "side": side, "bits": cb.bits, "coded": (i, side) in coded,
            "calib_bits_per_symbol": round(cb.expected_bits(h), 4),
            "heldout_bits_per_symbol": round(t.bits_per_symbol, 4),
            "calib_entropy": round(symbol_entropy(h), 4),
            "heldout_entropy": round(symbol_entropy(t.hist), 4),
            "heldout_estimate_bits": round(cb.expected_bits(t.hist), 4),  # no raw fallback applied
            "raw_stream_fraction": round(t.raw_streams / max(t.streams, 1), 4),
            "index_bits_per_symbol": round(8 * t.index_bytes / max(t.symbols, 1), 4),
            "padding_bits_per_symbol": round((8 * t.payload_bytes - t.stream_bits) / max(t.symbols, 1), 4),
            "symbols": t.symbols,
        })
    measured = {k: t.bits_per_symbol for k, t in tallies.items()}
    entropies = {k: symbol_entropy(t.hist) for k, t in tallies.items()}
    calib_est = {k: books[k].expected_bits(calib_hists[k]) for k in tallies}
    # the recipe as add_codebooks made it (sides that pay), and every side coded
    gated = entropy_memory(recipe, info, {k: measured[k] for k in coded}, config.context, config.layout)
    every = _with_books(recipe, books)
    all_sides = entropy_memory(every, info, measured, config.context, config.layout)
    estimate = entropy_memory(recipe, info, {k: calib_est[k] for k in coded}, config.context, config.layout)
    bound = _entropy_bound(gated.uncoded, info, configs, entropies, config.context)
    summary: dict[str, Any] = {}
    for side in SIDES:
        keys = [k for k in tallies if k[1] == side]
        if not keys:
            continue
        sym = sum(tallies[k].symbols for k in keys)
        summary[side] = {
            "bits": sorted({books[k].bits for k in keys}),
            "calib_bits_per_symbol": round(sum(calib_est[k] * tallies[k].symbols for k in keys) / sym, 4),
            "heldout_bits_per_symbol": round(sum(tallies[k].stream_bits for k in keys) / sym, 4),
            "heldout_entropy": round(sum(entropies[k] * tallies[k].symbols for k in keys) / sym, 4),
            "raw_stream_fraction": round(sum(tallies[k].raw_streams for k in keys)
                                         / max(sum(tallies[k].streams for k in keys), 1), 4),
            "coded_sides": sum(1 for k in keys if k in coded), "sides": len(keys),
        }
    return {
        "layers": rows,
        "summary": summary,
        "effective_bits": {
            "context": config.context,
            "uncoded": round(gated.uncoded.effective_bits, 4),
            "coded_calib_estimate": round(estimate.coded.effective_bits, 4),
            "coded_heldout": round(gated.coded.effective_bits, 4),
            "coded_heldout_all_sides": round(all_sides.coded.effective_bits, 4),
            "entropy_bound": round(bound, 4),
            "reduction_pct": round(100 * gated.reduction, 2),
            "reduction_all_sides_pct": round(100 * all_sides.reduction, 2),
            "reduction_bound_pct": round(100 * (1 - bound / gated.uncoded.effective_bits), 2),
        },
        "components_uncoded": {k: round(v) for k, v in gated.uncoded.components.items()},
        "components_coded": {k: round(v) for k, v in gated.coded.components.items()},
    }


def _with_books(recipe: Recipe, books: dict[Key, Any]) -> Recipe:
    """``recipe`` with a codebook on every side in ``books``."""
    from kvcalib.methods.huffman import tensor_name

    tensors = dict(recipe.tensors)
    for (i, side), cb in books.items():
        tensors[tensor_name(i, side)] = cb.lengths.clone()
    return Recipe(name=recipe.name, layers=recipe.layers, default_layer=recipe.default_layer, model=recipe.model,
                  tensors=tensors, provenance=recipe.provenance, accounting=recipe.accounting)


def _entropy_bound(uncoded, info: "ModelInfo", configs: list[LayerConfig], entropies: dict[Key, float],
                   context: int) -> float:
    """Effective bits if every quantized side's codes cost exactly their held-out order-0 entropy,
    with no index, padding or tables. By Gibbs' inequality no prefix code with one codebook per layer
    and side goes below it on this data (the per-stream raw switch aside)."""
    saved = 0.0
    for (i, side), ent in entropies.items():
        cfg = configs[i]
        nq = quantized_token_count(cfg, held_tokens(context, info.sliding_window[i]))
        bits = cfg.k_bits if side == "k" else cfg.v_bits
        saved += nq * info.num_kv_heads * info.head_dim * max(bits - ent, 0.0) / 8
    return 8.0 * (uncoded.total_bytes - saved) / uncoded.elements


# ----------------------------------------------------------------------------------------------
# drift during generation


def drift_check(recipe: Recipe, info: "ModelInfo", calib_hists: dict[Key, torch.Tensor],
                kv: tuple[list[torch.Tensor], list[torch.Tensor]], prompt_len: int, new_tokens: int,
                config: EntropyConfig) -> list[dict[str, Any]]:
    """Bits per symbol of each window of ``config.drift_window`` generated tokens.

    Args:
        kv: keys/values of prompt + generation (``T = prompt_len + new_tokens``) from
            :func:`capture_kv`.

    Returns:
        One row per window, plus a first row ``"prompt"`` for the prompt's own packed tokens. Each row
        has the per-side held-out and calibration means (symbol-weighted over layers) and the
        largest per-(layer, side) excess over the calibration estimate.
    """
    from kvcalib.recipe import build_codecs

    configs = recipe.layer_configs(info.num_layers)
    codecs = build_codecs(strip_codebooks(recipe), configs, info.head_dim)
    coded = load_codebooks(recipe, configs)
    books = {k: coded.get(k) or build_codebook(h) for k, h in calib_hists.items()}
    calib = {k: books[k].expected_bits(h) for k, h in calib_hists.items()}
    w = config.drift_window
    for i, cfg in enumerate(configs):
        if cfg.compressed and (prompt_len % cfg.flush_block or w % cfg.flush_block):
            raise KvcalibError(f"drift windows must be whole flush blocks: prompt length {prompt_len} and "
                               f"window {w} must be multiples of layer {i}'s flush block ({cfg.flush_block})")
    ks, vs = kv
    spans: list[tuple[str, int, int]] = [("prompt", 0, prompt_len)]
    spans += [(f"{a - prompt_len + 1}-{a - prompt_len + w}", a, w) for a in range(prompt_len, prompt_len + new_tokens, w)]
    rows = []
    for label, a, n in spans:
        def span(cfg: LayerConfig, t: int, a: int = a, n: int = n) -> tuple[int, int]:
            if a == 0:  # the prompt: after the sinks, whole flush blocks
                s = min(cfg.sinks, n)
                return s, (n - s) // cfg.flush_block * cfg.flush_block
            return a, n
        tallies = _span_tallies(codecs, configs, books, ks, vs, span, config.layout, config.verify)
        row: dict[str, Any] = {"window": label, "tokens": [a, a + n]}
        worst = (-math.inf, None)
        for side in SIDES:
            keys = [k for k in tallies if k[1] == side]
            if not keys:
                continue
            sym = sum(tallies[k].symbols for k in keys)
            act = sum(tallies[k].stream_bits for k in keys) / sym
            cal = sum(calib[k] * tallies[k].symbols for k in keys) / sym
            row[side] = {"heldout_bits_per_symbol": round(act, 4), "calib_bits_per_symbol": round(cal, 4),
                         "ratio": round(act / cal, 4)}
            for k in keys:
                gap = tallies[k].bits_per_symbol - calib[k]
                if gap > worst[0]:
                    worst = (gap, f"{k[0]}.{k[1]}")
        row["worst_excess_bits"] = round(worst[0], 4) if worst[1] else None
        row["worst_side"] = worst[1]
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------------------------
# the report


def measure_recipe(recipe: Recipe, stats: "CollectedStats", info: "ModelInfo",
                   kv_samples: Sequence[tuple[list[torch.Tensor], list[torch.Tensor]]],
                   drift_kv: tuple[list[torch.Tensor], list[torch.Tensor]] | None, prompt_len: int,
                   new_tokens: int, config: EntropyConfig) -> tuple[Recipe, dict[str, Any]]:
    """Codebooks for ``recipe`` from ``stats``, then the held-out and drift measurements.

    Returns the recipe with codebooks and the JSON-ready result."""
    calib_hists = layer_histograms(recipe, stats)
    coded = add_codebooks(recipe, stats, layout=config.layout)
    result: dict[str, Any] = {"name": recipe.name, "uncoded_sides": coded.provenance["huffman"]["uncoded"]}
    result.update(heldout_bits(coded, info, calib_hists, kv_samples, config))
    if drift_kv is not None and new_tokens:
        result["drift"] = drift_check(coded, info, calib_hists, drift_kv, prompt_len, new_tokens, config)
    sweep = []
    for tps in config.sweep_tokens_per_stream:  # the same measurement with longer/shorter streams
        alt = replace(config, tokens_per_stream=tps, sweep_tokens_per_stream=())
        alt_coded = add_codebooks(recipe, stats, layout=alt.layout)
        res = heldout_bits(alt_coded, info, calib_hists, kv_samples, alt)
        sweep.append({"tokens_per_stream": tps, "uncoded_sides": alt_coded.provenance["huffman"]["uncoded"],
                      "summary": res["summary"], "effective_bits": res["effective_bits"]})
    if sweep:
        result["layout_sweep"] = sweep
    return coded, result


def huffman_report(model: str, run_dir: Path | str, recipes: Sequence[Path | str], out_json: Path | str,
                   out_md: Path | str | None = None, config: EntropyConfig | None = None,
                   loaded: "LoadedModel | None" = None, recipes_out: Path | str | None = None) -> dict[str, Any]:
    """Measure Huffman coding for ``recipes`` (files fitted on ``run_dir``'s statistics) on
    ``model``'s held-out K/V and during generation; write JSON (and markdown).

    ``recipes_out``: a folder to write each recipe with its codebooks to, as
    ``<stem>-huffman.safetensors`` (an existing file there is refused, never replaced).
    """
    from kvcalib import __version__
    from kvcalib.collection import library_versions
    from kvcalib.data import pack_samples
    from kvcalib.eval.agreement import greedy_generate
    from kvcalib.eval.harness import eval_texts
    from kvcalib.io import write_json_atomic
    from kvcalib.models import load_model
    from kvcalib.stats import CollectedStats

    config = config or EntropyConfig()
    t0 = time.perf_counter()
    stats = CollectedStats.load(Path(run_dir))
    loaded = loaded or load_model(model, dtype="fp32")
    info = loaded.info
    loaded_recipes = [Recipe.load(str(p)) for p in recipes]
    for r in loaded_recipes:
        r.check_model(info)
    if recipes_out is not None:  # refuse before any compute, never replace a file
        taken = [t for p in recipes for t in [Path(recipes_out) / f"{Path(p).stem}-huffman.safetensors"] if t.exists()]
        if taken:
            raise KvcalibError(f"{taken[0]} already exists: pass another recipes_out folder")
    torch.manual_seed(config.seed)
    texts = eval_texts(config.data)
    ids = pack_samples(texts, loaded.tokenizer, config.seq_len, config.samples, config.seed)  # (n, seq_len)
    kv_samples = [capture_kv(loaded.model, ids[j:j + 1]) for j in range(ids.shape[0])]
    drift_kv, gen_text, new = None, "", config.drift_new_tokens
    if new:
        prompt = pack_samples(texts, loaded.tokenizer, config.drift_prompt_len, 1, config.seed + 1)  # (1, P)
        gen = greedy_generate(loaded.model, prompt, new, None, batch_size=1)  # (1, N), full precision
        drift_kv = capture_kv(loaded.model, torch.cat([prompt, gen], dim=1))
        gen_text = loaded.tokenizer.decode(gen[0].tolist())
    results = []
    for path, recipe in zip(recipes, loaded_recipes):
        coded, res = measure_recipe(recipe, stats, info, kv_samples, drift_kv, config.drift_prompt_len, new, config)
        res["recipe"] = str(path)
        if recipes_out is not None:
            target = Path(recipes_out) / f"{Path(path).stem}-huffman.safetensors"
            if target.exists():
                raise KvcalibError(f"{target} already exists: pass another recipes_out folder")
            coded.save(target)
            res["recipe_with_codebooks"] = str(target)
        results.append(res)
    report = {
        "model": info.to_dict(),
        "statistics": str(run_dir),
        "config": config.to_dict(),
        "heldout_tokens": int(ids.numel()),
        "drift_generated_text": gen_text[:400],
        "kvcalib_version": __version__,
        "versions": library_versions(),
        "threads": torch.get_num_threads(),
        "wall_seconds": round(time.perf_counter() - t0, 1),
        "recipes": results,
    }
    write_json_atomic(Path(out_json), report)
    if out_md is not None:
        from kvcalib.io import atomic_path

        with atomic_path(Path(out_md)) as tmp:
            tmp.write_text(markdown_report(report))
    return report


def markdown_report(report: dict[str, Any]) -> str:
    """A short markdown summary of :func:`huffman_report`'s result."""
    cfg = report["config"]
    lines = [
        f"# Huffman coding of the quantized cache: {report['model']['name']}",
        "",
        f"Held-out: {cfg['samples']} windows of {cfg['seq_len']} tokens from the `{cfg['data']}` evaluation split; "
        f"codebooks from the reservoir of `{report['statistics']}`. Effective bits at context {cfg['context']} "
        f"(bf16 = 16), with every byte counted: payload, word padding, stream index "
        f"({cfg['tokens_per_stream']} token(s) per stream, {cfg['chunk_tokens']}-token chunks), decode tables, "
        "scales, zeros, the full-precision window and sinks.",
        "",
        "| recipe | K bits/sym calib -> held-out (entropy) | V bits/sym calib -> held-out (entropy) | "
        "uncoded eff. bits | coded (calib est.) | coded (held-out) | saved | all sides coded (saved) | entropy floor (saved) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def side(r: dict[str, Any], s: str) -> str:
        x = r["summary"].get(s)
        if not x:
            return "16-bit"
        return (f"{'/'.join(map(str, x['bits']))}-bit: {x['calib_bits_per_symbol']:.3f} -> "
                f"{x['heldout_bits_per_symbol']:.3f} ({x['heldout_entropy']:.3f}); coded {x['coded_sides']}/{x['sides']}")

    for r in report["recipes"]:
        e = r["effective_bits"]
        lines.append(f"| {r['name']} | {side(r, 'k')} | {side(r, 'v')} | {e['uncoded']:.3f} | "
                     f"{e['coded_calib_estimate']:.3f} | {e['coded_heldout']:.3f} | {e['reduction_pct']:.1f}% | "
                     f"{e['coded_heldout_all_sides']:.3f} ({e['reduction_all_sides_pct']:.1f}%) | "
                     f"{e['entropy_bound']:.3f} ({e['reduction_bound_pct']:.1f}%) |")
    lines += ["", "Entropy floor: every quantized side's codes at their held-out order-0 entropy, with no index, "
              "padding or tables. A prefix code with one codebook per layer and side cannot go below it (the per-stream "
              "raw switch aside). "
              "\"All sides coded\" codes also the sides that `add_codebooks` leaves uncoded because coding would "
              "not make them smaller."]
    sweeps = [r for r in report["recipes"] if r.get("layout_sweep")]
    if sweeps:
        lines += ["", "Stream length (held-out, same data): tokens per stream -> coded effective bits (saved). "
                  "Longer streams need fewer length fields but give a GPU tile fewer independent lanes.", "",
                  "| recipe | " + " | ".join(f"{s['tokens_per_stream']} token(s)/stream" for s in
                                              [{"tokens_per_stream": cfg["tokens_per_stream"]}]
                                              + sweeps[0]["layout_sweep"]) + " |",
                  "|---|" + "---|" * (1 + len(sweeps[0]["layout_sweep"]))]
        for r in sweeps:
            cells = [r["effective_bits"]] + [s["effective_bits"] for s in r["layout_sweep"]]
            lines.append(f"| {r['name']} | " + " | ".join(
                f"{e['coded_heldout']:.3f} ({e['reduction_pct']:.1f}%)" for e in cells) + " |")
    drifts = [r for r in report["recipes"] if r.get("drift")]
    if drifts:
        lines += ["", f"Drift: {cfg['drift_new_tokens']} tokens greedily generated by the full-precision model "
                  f"after a {cfg['drift_prompt_len']}-token prompt; bits/symbol of each window of "
                  f"{cfg['drift_window']} generated tokens against the calibration estimate (held-out / calib).", "",
                  "| recipe | window | K | V | worst layer.side (excess bits) |", "|---|---|---|---|---|"]
        for r in drifts:
            for row in r["drift"]:
                cells = []
                for s in SIDES:
                    x = row.get(s)
                    cells.append("-" if not x else f"{x['heldout_bits_per_symbol']:.3f} / {x['calib_bits_per_symbol']:.3f}")
                worst = f"{row['worst_side']} ({row['worst_excess_bits']:+.3f})" if row["worst_side"] else "-"
                lines.append(f"| {r['name']} | {row['window']} | {cells[0]} | {cells[1]} | {worst} |")
    lines += ["", f"Made by `benchmarks.huffman_bits.huffman_report` (kvcalib {report['kvcalib_version']}, "
              f"{report['threads']} thread(s), {report['wall_seconds']} s)."]
    return "\n".join(lines) + "\n"

