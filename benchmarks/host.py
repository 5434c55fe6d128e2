"""Benchmark: host time of eager decoding (what ``model.generate`` pays without CUDA graphs).

A decode step's attention over a compressed cache is a few small kernels, so at batch 1 and
short contexts its cost is host time: Python in the cache and the launcher, and Triton's
per-launch argument binding. ``decode_attention.json`` reports GPU time (CUDA-graph replay);
this measures what an eager caller gets. Modes (``--mode``):

- ``run``: on a CUDA device,
  1. per call of ``decode_attention`` (one layer, 2-bit group 128, 128-token bf16 window) at
     batch 1 / 4k context of each shape: host microseconds per call (calls issued back to back,
     no sync), with :class:`kvcalib_kernels.launch.FastLauncher` on and (``fast_launch: false``)
     off, beside bf16 SDPA (``enable_gqa``) on the same context;
  2. eager decode steps of random-weight models at each shape's real depth (Mistral
     architecture at the Mistral-7B, Qwen2.5-1.5B and SmolLM2-135M shapes: layers, hidden, MLP,
     heads, kv heads, head_dim, vocab), batch 1, contexts ``--contexts``: transformers
     ``DynamicCache`` (bf16, SDPA) vs ``CompressedCache`` (2-bit, key group 128, value group
     ``min(128, head_dim)``, window 128) eager (each after a warm-up pass of the same steps on the
     same cache: a first pass ran up to 1.6x slower, the allocator and first launches in it),
     and the compressed cache replayed from CUDA graphs (``GraphDecoder``). Tokens/s over steps
     3.. (synchronised per step).
  Writes ``host.json`` (``--tag`` names the run: the same script run over an older checkout
  gives the before column).
- ``report``: ``host.md`` and ``host.png`` (this run's tokens/s) from ``host.json`` (and
  ``host_before.json``, the same script over an older checkout, when present).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch

from benchmarks.common import (WINDOW, _write_json, bf16_variants, device_info, host_us, kernel_call, log,
                               packed_inputs)
from benchmarks.e2e import build_model, decode_steps, fill_dynamic, kivi2_recipe, packed_cache

CALLS = 300  # calls per host-time measurement

SHAPES = {  # name: transformers config fields of a model of that shape (random weights)
    "mistral-7b": dict(layers=32, hidden=4096, inter=14336, heads=32, kv_heads=8, head_dim=128, vocab=32000),
    "qwen2.5-1.5b": dict(layers=28, hidden=1536, inter=8960, heads=12, kv_heads=2, head_dim=128, vocab=151936),
    "smollm2-135m": dict(layers=30, hidden=576, inter=1536, heads=9, kv_heads=3, head_dim=64, vocab=49152),
}


def _internals():
    """The decode launcher's pieces in the kernels tree imported (``scripts/gpu_bench.sh`` may link
    an older one): ``decode.plan`` / ``decode.combine``, or ``decode_attention`` itself in trees
    from before that split."""
    try:
        from kvcalib_kernels.decode import combine, plan
    except ImportError:
        import kvcalib_kernels.decode_attention as da

        return da
    return SimpleNamespace(_SPLIT=plan._SPLIT, _COMBINE=combine._COMBINE, DEFAULT_CONFIG=plan.DEFAULT_CONFIG,
                           _prepare=plan._prepare, _run=plan._run)


def _launchers():
    """The decode kernel's FastLaunchers (none in a checkout from before them)."""
    da = _internals()
    return [x for x in (getattr(da, "_SPLIT", None), getattr(da, "_COMBINE", None)) if x is not None]


# what _run launches, by the names it calls them by (stages() times each of those calls alone)
_RUN_STAGES = ("_partials", "_SPLIT", "_combine")


@contextmanager
def _recording(namespace: dict, names):
    """While inside: each callable ``namespace[name]`` of ``names`` records every call, as a
    zero-argument replay of it (``functools.partial``), into ``seen[name]``, and then runs it.
    ``namespace`` is a function's ``__globals__`` (the names it looks up at call time); a name it
    no longer has raises KeyError here rather than timing something else."""
    saved = {name: namespace[name] for name in names}
    seen = {name: [] for name in names}

    def recorder(name, fn):
        def call(*args, **kwargs):
            seen[name].append(partial(fn, *args, **kwargs))
            return fn(*args, **kwargs)
        return call

    namespace.update({name: recorder(name, fn) for name, fn in saved.items()})
    try:
        yield seen
    finally:
        namespace.update(saved)


def _us(fn, calls: int, dev: torch.device) -> float:
    """:func:`benchmarks.common.host_us` on CUDA; elsewhere (Triton's interpreter on CPU, the smoke
    test) the same loop without the device synchronisation there is no device for."""
    if dev.type == "cuda":
        return host_us(fn, calls)
    fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return 1e6 * (time.perf_counter() - t0) / calls


def stages(q, packed, window, n, d, calls: int = CALLS) -> dict:
    """Host microseconds of each stage of one call, each timed alone (a checkout without the
    stage functions: empty): ``_prepare``, then each call ``_run`` makes (the partial buffers, the
    split launch, its FastLauncher key, the combine), replayed with exactly the arguments ``_run``
    gave it: recorded from one real ``_run`` of the planned call, so the split kernel's argument
    tuple is the launcher's own and follows its signature (a copy of it built here went stale
    when the kernel gained ``qk_scale``/``softcap``/``H``). Shapes: q (B, Hq, D); ``packed`` the
    six packed tensors of :func:`benchmarks.common.packed_inputs` (2-bit, key group 128, value
    group ``min(128, d)``, ``n`` tokens); ``window`` (K, V) (B, H, W, D)."""
    da = _internals()
    if not hasattr(da, "_SPLIT"):
        return {}
    kw = dict(k_bits=2, v_bits=2, k_group=128, v_group=min(128, d), k_axis="channel", scaling=d ** -0.5,
              softcap=None, packed_start=None, packed_end=None, packed_position=0, fp_segments=[window],
              fp_positions=[n], mask=None, config=da.DEFAULT_CONFIG)
    call = da._prepare(q, *packed, **kw)
    with _recording(da._run.__globals__, _RUN_STAGES) as seen:
        da._run(q, [call], False)
    # one call of each: anything else (a rotation launch, a second split) is a path this does not time
    (partials,), (split,), (combine,) = (seen[name] for name in _RUN_STAGES)
    _grid, split_args, meta = split.args  # what _run passed the launcher: (grid, args, meta)
    dev = q.device
    return {
        "prepare": _us(lambda: da._prepare(q, *packed, **kw), calls, dev),
        "partials": _us(partials, calls, dev),
        "split_launch": _us(split, calls, dev),
        "split_key": _us(lambda: da._SPLIT.key(split_args, meta), calls, dev),
        "combine": _us(combine, calls, dev),
        "empty": _us(lambda: torch.empty(16, device=dev), calls, dev),
    }


def per_call(dev) -> list[dict]:
    rows = []
    for model, shp in SHAPES.items():
        hq, h, d = shp["heads"], shp["kv_heads"], shp["head_dim"]
        ctx, n = 4096, 4096 - WINDOW
        packed = packed_inputs(1, h, n, d, 2, 128, min(128, d), dev)
        window = (torch.randn(1, h, WINDOW, d, device=dev, dtype=torch.bfloat16),
                  torch.randn(1, h, WINDOW, d, device=dev, dtype=torch.bfloat16))
        q = torch.randn(1, hq, d, device=dev, dtype=torch.bfloat16)
        fn = kernel_call(q, packed, window, 2, 128, min(128, d), n, d ** -0.5, None)
        row = {"model": model, "batch": 1, "context": ctx, "bits": 2, "group": 128}
        launchers = _launchers()
        enabled = [lf.enabled for lf in launchers]
        row["fast_launch_available"] = bool(launchers) and all(lf.enabled for lf in launchers)
        row["kvcalib_us"] = host_us(fn, CALLS)
        if launchers:
            for lf in launchers:
                lf.enabled = False
            row["kvcalib_us_without_fast_launch"] = host_us(fn, CALLS)
            for lf, on in zip(launchers, enabled):
                lf.enabled = on
        row["stages_us"] = stages(q, packed, window, n, d)
        k = torch.randn(1, h, ctx, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        q4 = q[:, :, None, :]
        row["bf16_sdpa_us"] = host_us(bf16_variants(q4, k, v, d ** -0.5)["sdpa_enable_gqa"], CALLS)
        row.update(layer_steps(q4, k, v, d, shp["layers"]))
        rows.append(row)
        log(f"  {model:13s} per call: kvcalib {row['kvcalib_us']:.1f} us {row['stages_us']}"
            + (f" ({row['kvcalib_us_without_fast_launch']:.1f} without the fast launch)" if launchers else "")
            + f", bf16 SDPA {row['bf16_sdpa_us']:.1f} us; a layer step: kvcalib with layer graphs "
            + f"{row['layer_step_us']:.1f} us ({row['layer_step_no_graphs_us']:.1f} without), "
            + f"per layer of a {shp['layers']}-layer step {row['layer_step_in_model_us']:.1f} us")
    return rows


def layer_steps(q4, k, v, d, layers: int) -> dict:
    """Host microseconds of one layer's decode step as ``model.generate`` runs it (the cache's
    ``update`` and the attention function), at the context of ``k``/``v`` (1, H, T, D): a
    CompressedCache layer (2-bit, groups 128 / ``min(128, D)``, window 128, so a flush every 128
    steps) with per-layer CUDA graphs (``layer_step_us``: flushes and their captures amortised
    over the calls) and without (``layer_step_no_graphs_us``); and (``layer_step_in_model_us``)
    a whole step of a ``layers``-layer cache, every layer in turn, divided by ``layers``: what one
    layer costs inside a model's step, where the work a step does once for all layers (the
    position and the visibility mask on the device, at the step's first layer) is shared as
    ``model.generate`` shares it. The one-layer number pays that work every call (on an H100
    host, 2026-11-27: ~15 us of a 36-59 us layer step). Not measured beside it: a bf16
    DynamicCache layer's update + SDPA over the growing cache, which took ~40 ms a call here
    (H100, torch 2.11, cuDNN 9.19): default SDPA picks cuDNN attention, which plans anew for every
    new key length (``docs/gpu.md``); compare with ``bf16_sdpa_us`` (a fixed length)."""
    from kvcalib.layout import LayerConfig
    from kvcalib.runtime.attention import kvcalib_attention
    from kvcalib.runtime.cache import CompressedCache

    cfg = LayerConfig(k_bits=2, v_bits=2, k_group=128, v_group=min(128, d), window=WINDOW)
    one_k, one_v = k[:, :, :1].clone(), v[:, :, :1].clone()  # (1, H, 1, D): the step's K/V
    out = {}
    for name, mode, n_layers in (("layer_step_us", "auto", 1), ("layer_step_no_graphs_us", "off", 1),
                                 ("layer_step_in_model_us", "auto", layers)):
        cache = CompressedCache([cfg] * n_layers, layer_graphs=mode)
        for layer in cache.layers:
            layer.update(k, v)
            layer.flush()  # the prompt taken in and packed, as after a prefill

        def step(cache=cache):
            for layer in cache.layers:
                kk, vv = layer.update(one_k, one_v)
                kvcalib_attention(None, q4, kk, vv, None, scaling=d ** -0.5)

        # one layer: 900 steps, 7 flushes and captures in them; a whole step: at least one flush
        # per layer in the timed steps
        steps = 3 * CALLS if n_layers == 1 else max(1, 3 * CALLS // n_layers) + 128
        out[name] = host_us(step, steps) / n_layers
    return out


def eager_steps(dev, contexts, steps: int, graphs: bool = True, done=lambda rows: None) -> list[dict]:
    """Rows of tokens/s (module docstring); ``done(rows)`` after each (to write them)."""
    from transformers import DynamicCache

    from kvcalib.runtime.graphs import GraphDecoder

    rows = []
    for model_name, shp in SHAPES.items():
        rec = kivi2_recipe(shp["head_dim"])
        model = build_model(dev, **shp, max_pos=max(contexts) + steps + 64)
        n_layers, kv, d, vocab = shp["layers"], shp["kv_heads"], shp["head_dim"], shp["vocab"]
        for ctx in contexts:
            res = {"model": model_name, "batch": 1, "context": ctx, "steps": steps, "layers": n_layers}

            def tps(times):
                return len(times[2:]) / sum(times[2:])

            model.set_attn_implementation("sdpa")
            cache = DynamicCache(config=model.config)
            fill_dynamic(cache, n_layers, 1, kv, ctx, d, dev)
            decode_steps(model, cache, 1, steps, vocab, dev)  # warm-up pass (allocator, first launches)
            res["bf16_eager_tok_s"] = tps(decode_steps(model, cache, 1, steps, vocab, dev))
            del cache

            def packed():
                return packed_cache(model, rec, 1, ctx, dev)

            warm = packed()
            decode_steps(model, warm, 1, steps, vocab, dev)  # warm-up pass, as for bf16
            res["kvcalib_eager_tok_s"] = tps(decode_steps(model, warm, 1, steps, vocab, dev))
            del warm
            if graphs:
                times = []
                tok = torch.randint(0, vocab, (1, 1), device=dev)
                pos = torch.full((1, 1), ctx, dtype=torch.long, device=dev)
                GraphDecoder(model, packed(), capture=True).decode(tok, ctx, pos, steps, step_times=times)
                res["kvcalib_graph_tok_s"] = tps(times)
            torch.cuda.empty_cache()
            rows.append(res)
            done(rows)
            log(f"  {model_name:13s} b=1 ctx={ctx:6d}: bf16 eager {res['bf16_eager_tok_s']:.1f} tok/s, kvcalib eager "
                f"{res['kvcalib_eager_tok_s']:.1f}, kvcalib graph {res.get('kvcalib_graph_tok_s', float('nan')):.1f}")
        model = None  # free the weights before the next shape's
        torch.cuda.empty_cache()
    return rows


def main_run(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    res = {"tag": args.tag, "device": device_info(), "command": " ".join(["python -m benchmarks.host", *sys.argv[1:]])}
    path = out / f"host{'_' + args.tag if args.tag else ''}.json"
    res["per_call"] = per_call(dev)
    _write_json(path, res)
    def done(rows):
        res["eager"] = rows
        _write_json(path, res)

    if args.contexts:  # `--contexts` with no value: the per-call rows only (no whole-model steps)
        eager_steps(dev, args.contexts, args.steps, args.graphs, done)


def main_report(args) -> None:
    out = Path(args.out)
    now = json.loads((out / "host.json").read_text())
    before_path = out / "host_before.json"
    before = json.loads(before_path.read_text()) if before_path.exists() else None
    dev = now["device"]
    lines = ["# Host time of eager decoding", "",
             f"GPU: **{dev['gpu']}**, torch {dev['torch']}, triton {dev['triton']}. Command: `{now['command']}`"
             + (f"; before (`host_before.json`): the same script over {before.get('code', 'an older checkout')}"
                if before else "") + ". The host of these machines is shared and its speed moves between runs "
             "(bf16 SDPA's own host time per call: "
             + ", ".join(f"{r['bf16_sdpa_us']:.0f}" for r in now["per_call"])
             + (" us here, " + ", ".join(f"{r['bf16_sdpa_us']:.0f}" for r in before["per_call"]) + " us in the "
                "before run" if before else " us") + "): compare columns of one run.", "",
             "## One attention call (one layer, batch 1, 4k context, 2-bit group 128, 128-token bf16 window)", "",
             "Host microseconds per call, calls issued back to back (the GPU work of each is shorter, so this is the "
             "rate an eager caller can issue them).", "",
             "| shape | kvcalib us | without fast launch us | bf16 SDPA us |"
             + (" before run: kvcalib us | before run: bf16 SDPA us |" if before else ""),
             "|---|---:|---:|---:|" + ("---:|---:|" if before else "")]
    old = {r["model"]: r for r in (before or {}).get("per_call", [])}
    for r in now["per_call"]:
        cells = [r["model"], f"{r['kvcalib_us']:.1f}", f"{r.get('kvcalib_us_without_fast_launch', float('nan')):.1f}",
                 f"{r['bf16_sdpa_us']:.1f}"]
        if before:
            o = old.get(r["model"])
            cells += [f"{o['kvcalib_us']:.1f}", f"{o['bf16_sdpa_us']:.1f}"] if o else ["-", "-"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Whole decode steps, batch 1 (random-weight models of each shape, real depth)", "",
              "Tokens/s over steps 3.., each step synchronised. `bf16 eager`: transformers `DynamicCache`, SDPA. "
              "`kvcalib eager`: `CompressedCache` 2-bit, every kernel launched from Python as `model.generate` does. "
              "`kvcalib graph`: the same cache, steps replayed from CUDA graphs (`GraphDecoder`, "
              "`kvcalib run --cuda-graph`). Each run's own ratio is the comparison that holds across runs.", "",
              "| shape | context | bf16 eager | kvcalib eager | eager vs bf16 |"
              + (" before run: bf16 eager | before run: kvcalib eager | before run: eager vs bf16 |" if before else "")
              + " kvcalib graph |",
              "|---|---:|---:|---:|---:|" + ("---:|---:|---:|" if before else "") + "---:|"]
    old_e = {(r["model"], r["context"]): r for r in (before or {}).get("eager", [])}
    for r in now.get("eager", []):
        cells = [r["model"], str(r["context"]), f"{r['bf16_eager_tok_s']:.1f}", f"{r['kvcalib_eager_tok_s']:.1f}",
                 f"{r['kvcalib_eager_tok_s'] / r['bf16_eager_tok_s']:.2f}x"]
        if before:
            o = old_e.get((r["model"], r["context"]))
            cells += ([f"{o['bf16_eager_tok_s']:.1f}", f"{o['kvcalib_eager_tok_s']:.1f}",
                       f"{o['kvcalib_eager_tok_s'] / o['bf16_eager_tok_s']:.2f}x"] if o else ["-"] * 3)
        cells.append(f"{r.get('kvcalib_graph_tok_s', float('nan')):.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    (out / "host.md").write_text("\n".join(lines))
    plot(now, out / "host.png")


def plot(now: dict, path: Path) -> None:
    """Tokens/s bars of one run (runs on different hosts do not compare: see host.md)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = now.get("eager", [])
    if not rows:
        return
    labels = [f"{r['model']}\n{r['context'] // 1024}k" for r in rows]
    series = [("bf16 eager", [r["bf16_eager_tok_s"] for r in rows]),
              ("kvcalib eager", [r["kvcalib_eager_tok_s"] for r in rows]),
              ("kvcalib graph", [r.get("kvcalib_graph_tok_s", 0) for r in rows])]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(series)
    for i, (name, vals) in enumerate(series):
        ax.bar([x + i * width for x in range(len(rows))], vals, width, label=name)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))])
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("tokens/s (batch 1, log scale)")
    ax.set_title(f"Decode steps at batch 1, {now['device']['gpu']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("run", "report"), default="run")
    ap.add_argument("--out", default="artifacts/bench")
    ap.add_argument("--tag", default="", help="run: writes host_TAG.json (e.g. before)")
    ap.add_argument("--contexts", type=int, nargs="*", default=[4096, 32768])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--no-graphs", dest="graphs", action="store_false", help="run: eager steps only")
    args = ap.parse_args(argv)
    {"run": main_run, "report": main_report}[args.mode](args)


if __name__ == "__main__":
    main()
