"""Benchmark end to end: a random-weight Mistral-7B-shaped model (bf16, no download) decoding at
32k context: HF ``DynamicCache`` (and a CUDA-graph ``StaticCache``) vs ``CompressedCache`` with
a 2-bit recipe, tokens/s and peak memory, the largest batch estimated from the measured
per-sequence bytes. The caches are *filled directly* (random bf16 K/V; packed storage quantized by
``kvcalib_kernels.quant_pack``, each block at its PATS tier's bits) instead of a 32k prefill.
``--pats``: CUDA-graph decoding of a PATS middle-heavy cache beside plain 2-bit; ``--sliding``: a
Gemma-3-1B shape (sliding-window layers). Writes ``e2e.json`` / ``e2e_pats.json`` /
``e2e_sliding.json``.

    python -m benchmarks.e2e --steps 140 --batches-bf16 8 --batches-packed 8 32 --out artifacts/bench

``--rounds R``: eager steps of both caches in R interleaved rounds per context and batch
(``e2e_rounds.json``), the comparison the host's drift allows:

    python -m benchmarks.e2e --rounds 5 --steps 40 --contexts 4096 16384 32768 --batches-packed 1 8 --out OUT
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import _write_json, device_info, log


def _fill_grow(gb, t: torch.Tensor, slack_rows: int) -> None:
    """Put ``t`` (B, H, rows, X) into a GrowBuffer with room for ``slack_rows`` more (no regrowth)."""
    rows = t.shape[2]
    buf = t.new_empty((*t.shape[:2], rows + slack_rows, *t.shape[3:]))
    buf[:, :, :rows] = t
    gb.buf, gb.n, gb.front = buf, rows, 0


def fill_compressed(cache, b, t, dev, slack_tokens=None):
    """Fill every CompressedLayer as if a ``t``-token prompt had been prefilled and flushed.
    ``slack_tokens``: room left past the packed tokens; None: the store's own capacity rule
    (``PackedStore.capacity_for``, what a prefill's appends allocate), so a stable launch reads
    as much as it would after a real prefill.

    Random bf16 K/V per layer; the oldest tokens (all but the window and the partial group)
    quantized and packed by the Triton kernel (bit-exact with the runtime's codec, layout from the
    layer's config), the rest left pending in bf16. Needs ``layer._e2e_shape = (kv_heads, D)``.
    """
    from kvcalib_kernels.quant_pack import quantize_pack_keys, quantize_pack_values

    for layer in cache.layers:
        cfg = layer.cfg
        kv_heads, d = layer._e2e_shape
        n = (t - cfg.window) // cfg.flush_block * cfg.flush_block
        # a sliding-window layer has dropped the blocks its next query cannot see (CompressedLayer.flush)
        first = 0 if layer.sliding_window is None else min(n, max(0, t - layer.sliding_window + 1)
                                                             // cfg.flush_block * cfg.flush_block)
        k = torch.randn(b, kv_heads, t, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn(b, kv_heads, t, d, device=dev, dtype=torch.bfloat16)
        layer.lazy_initialization(k[:, :, :0], v[:, :, :0])
        for store, lo, hi in tier_ranges(layer, first, n - first, t):  # one store per PATS tier (one when untiered)
            qk = quantize_pack_keys(k[:, :, lo:hi], store.bits["k"], cfg.k_group, validate=False)
            qv = quantize_pack_values(v[:, :, lo:hi], store.bits["v"], cfg.v_group, validate=False)
            slack = store.capacity_for(hi - lo) - (hi - lo) if slack_tokens is None else slack_tokens
            for side, qt in (("k", qk), ("v", qv)):
                _fill_grow(store.parts[f"{side}_codes"], qt.codes, slack)
                rows_slack = store.part_rows(f"{side}_scale", hi - lo + slack) - qt.scale.shape[2]
                _fill_grow(store.parts[f"{side}_scale"], qt.scale, rows_slack)
                _fill_grow(store.parts[f"{side}_zero"], qt.zero, rows_slack)
            store.start, store.n = lo, hi - lo
            store._changed()  # a new allocation, as an append's would be (the layer graphs' period)
        layer.pend_k = k[:, :, n:].clone()
        layer.pend_v = v[:, :, n:].clone()
        layer.pend_start = n
        layer.n_seen = t
        del k, v, qk, qv


def tier_ranges(layer, start: int, n: int, t: int) -> list:
    """(store, first, end) per stored tier of ``layer`` (youngest first) for packed tokens at
    positions [start, start + n) at context ``t``: each flush block goes to the store of the tier
    the layer's schedule gives it (``Schedule.block_tier``, where the runtime's flushes and
    ``PackedTiers.advance`` put it; the fill quantizes it straight at that tier's bits instead of
    through the requantization chain: the same bytes to read). Untiered: one store, everything."""
    stores = layer.packed.stores
    sched = getattr(layer.codec.state("schedule"), "schedule", None)
    block = layer.cfg.flush_block
    first = len(sched.tiers) - len(stores) if sched is not None else 0  # schedule index of stored tier 0
    bounds: dict[int, tuple[int, int]] = {}
    for a in range(start, start + n, block):
        e = min(a + block, start + n)
        u = sched.block_tier(e, t) - first if sched is not None else 0
        lo, hi = bounds.get(u, (a, e))
        bounds[u] = (min(lo, a), max(hi, e))
    return [(store, *bounds.get(u, (start, start))) for u, store in enumerate(stores)]


def fill_dynamic(cache, n_layers, b, kv_heads, t, d, dev):
    """Random bf16 K/V of ``t`` tokens into a transformers cache (Dynamic or Static; the
    ``cache_position`` kwarg is what a StaticCache of transformers < 5.2x reads)."""
    where = {"cache_position": torch.arange(t, device=dev)}
    for i in range(n_layers):
        k = torch.randn(b, kv_heads, t, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn(b, kv_heads, t, d, device=dev, dtype=torch.bfloat16)
        cache.update(k, v, i, where)


def decode_steps(model, cache, b, steps, vocab, dev):
    """Greedy decode ``steps`` tokens; per-step wall times (synchronised).

    cuDNN SDPA is off for the steps: called without a mask (as here), SDPA on torch 2.11 with
    cuDNN 9.19 (H100) picks cuDNN attention and builds a new plan for every new key length, ~40 ms
    per decode step of the bf16 DynamicCache, which made the bf16 rows of ``e2e_context.md``
    before 2026-11-26 (third session) 2.6x too slow at batch 1; with it off SDPA takes flash
    attention. kvcalib's steps run its own kernels and are not affected."""
    tok = torch.randint(0, vocab, (b, 1), device=dev)
    times = []
    was = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        return _steps(model, cache, tok, steps, times)
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)


def _steps(model, cache, tok, steps, times):
    with torch.no_grad():
        for _ in range(steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            logits = model(input_ids=tok, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            tok = logits[:, -1].argmax(-1, keepdim=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    return times


SMALL_DIMS = dict(layers=2, hidden=1024, inter=2048, heads=8, kv_heads=2, head_dim=128, vocab=1000)  # --quick


def kivi2_recipe(head_dim: int = 128):
    """The 2-bit recipe the e2e and host rows decode with: KIVI's layout, groups of 128 (value
    groups at most one head), a 128-token window."""
    from kvcalib.layout import LayerConfig
    from kvcalib.recipe import Recipe

    return Recipe(name="kivi2-g128-w128", default_layer=LayerConfig(
        k_bits=2, v_bits=2, k_group=128, v_group=min(128, head_dim), window=128))


def packed_cache(model, recipe, b: int, t: int, dev):
    """A CompressedCache of ``recipe`` (switching ``model`` to kvcalib attention) filled as after a
    ``t``-token prompt at batch ``b`` (:func:`fill_compressed`)."""
    from kvcalib.runtime.cache import CompressedCache

    c = model.config
    cache = CompressedCache.from_recipe(model, recipe)
    for lay in cache.layers:
        lay._e2e_shape = (c.num_key_value_heads, c.head_dim)
    fill_compressed(cache, b, t, dev)
    return cache


def random_model(cls, conf, dev):
    """``cls(conf)`` with seeded random bf16 weights made on ``dev``, SDPA attention, eval mode."""
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(dev):
            model = cls(conf)
    finally:
        torch.set_default_dtype(prev)
    model.set_attn_implementation("sdpa")
    return model.eval()


def build_model(dev, layers=32, hidden=4096, inter=14336, heads=32, kv_heads=8, head_dim=128, vocab=32000,
                max_pos=140000):
    from transformers import MistralConfig, MistralForCausalLM

    conf = MistralConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                         vocab_size=vocab, max_position_embeddings=max_pos, sliding_window=None)
    return random_model(MistralForCausalLM, conf, dev)


def build_gemma3_model(dev, max_pos=140000):
    """A random-weight Gemma-3-1B shape (26 layers, hidden 1152, 4 heads / 1 kv head, head_dim 256, a
    512-token sliding window on 5 of every 6 layers, vocab 262144), bf16, SDPA."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    layers = 26
    conf = Gemma3TextConfig(hidden_size=1152, intermediate_size=6912, num_hidden_layers=layers,
                            num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
                            sliding_window=512, query_pre_attn_scalar=256, max_position_embeddings=max_pos,
                            layer_types=["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(layers)])
    return random_model(Gemma3ForCausalLM, conf, dev)


def main_e2e(args) -> None:
    from transformers import DynamicCache

    from kvcalib.layout import LayerConfig

    from kvcalib.recipe import Recipe
    from kvcalib.runtime.cache import CompressedCache

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    small = args.quick
    dims = SMALL_DIMS if small else {}
    t = 4096 if small else args.context
    steps = args.steps
    if args.sliding:
        model = build_gemma3_model(dev, max_pos=t + steps + 64)
        name = "random-weight Gemma-3-1B shape"
    else:
        model = build_model(dev, **dims, max_pos=t + steps + 64)
        name = "random-weight Mistral-7B shape" if not small else "small smoke model"
    c = model.config
    n_layers, kv_heads, d = c.num_hidden_layers, c.num_key_value_heads, c.head_dim
    weights = torch.cuda.memory_allocated()
    total_mem = torch.cuda.get_device_properties(0).total_memory
    res = {"gpu": device_info()["gpu"], "model": name,
           "config": {"layers": n_layers, "hidden": c.hidden_size, "heads": c.num_attention_heads,
                      "kv_heads": kv_heads, "head_dim": d, "vocab": c.vocab_size},
           "context": t, "steps": steps, "weights_bytes": weights, "gpu_memory_bytes": total_mem, "runs": [],
           "command": " ".join(["python -m benchmarks.e2e", *sys.argv[1:]])}
    rec = kivi2_recipe()
    res["recipe"] = rec.default_layer.to_dict()
    e2e_file = "e2e_pats.json" if args.pats else "e2e_sliding.json" if args.sliding else "e2e.json"
    if args.sliding:
        res["sliding_window"] = c.sliding_window
        res["sliding_layers"] = sum(1 for w in c.layer_types if w == "sliding_attention")
    if args.pats:  # PATS middle-heavy: 8 bits from the window to age 1024, 4 to 4096, then 2 (no sinks)
        from kvcalib.methods.schedule import preset_schedule

        tiers = preset_schedule("middle-heavy", window=128, sinks=0)
        pats = Recipe(name="pats-middle-heavy-g128-w128",
                      default_layer=LayerConfig(k_bits=8, v_bits=8, k_group=128, v_group=128, window=128),
                      tensors={f"layers.{i}.kv.schedule": tiers.to_tensor() for i in range(n_layers)})
        res["pats_recipe"] = {**pats.default_layer.to_dict(), "schedule": [[x.age, x.k_bits, x.v_bits] for x in tiers.tiers]}

    def record(kind, b, times, cache_bytes, peak):
        steady = sorted(times[2:]) if len(times) > 4 else sorted(times)
        run = {"cache": kind, "batch": b, "context": t, "steps": len(times),
               "tokens_per_s": b * len(times[2:]) / sum(times[2:]) if len(times) > 2 else b * len(times) / sum(times),
               "median_step_ms": 1e3 * steady[len(steady) // 2], "max_step_ms": 1e3 * max(times[2:] or times),
               "peak_memory_bytes": peak, "cache_bytes": cache_bytes,
               "step_ms": [round(1e3 * x, 3) for x in times],
               "per_sequence_bytes_beyond_weights": (peak - weights) / b}
        run["est_max_batch_at_context"] = int((0.97 * total_mem - weights) // run["per_sequence_bytes_beyond_weights"])
        res["runs"].append(run)
        log(f"  {kind:10s} b={b:3d}: {run['tokens_per_s']:.1f} tok/s, median step {run['median_step_ms']:.2f} ms, "
            f"max {run['max_step_ms']:.2f} ms, peak {peak / 2**30:.1f} GiB, cache {cache_bytes / 2**30:.2f} GiB, "
            f"est. max batch {run['est_max_batch_at_context']}")
        _write_json(out / e2e_file, res)

    def graph_decode(cache, b):
        """Greedy steps replayed from CUDA graphs (kvcalib.runtime.graphs); per-step wall times."""
        from kvcalib.runtime.graphs import GraphDecoder

        times = []
        tok = torch.randint(0, c.vocab_size, (b, 1), device=dev)
        pos = torch.full((b, 1), t, dtype=torch.long, device=dev)
        r = GraphDecoder(model, cache, capture=True).decode(tok, t, pos, steps, step_times=times)
        log(f"    graph: {r.captures} captures, {r.replays} replays, {r.eager_steps} eager steps")
        return times

    def run(kind, b, make, decode):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        try:
            cache, cache_bytes = make(b)
            times = decode(cache, b)
            record(kind, b, times, cache_bytes, torch.cuda.max_memory_allocated())
        except torch.cuda.OutOfMemoryError:
            log(f"  {kind} b={b}: out of memory")
            res["runs"].append({"cache": kind, "batch": b, "context": t, "oom": True})

    def make_dynamic(b):
        model.set_attn_implementation("sdpa")
        cache = DynamicCache(config=model.config)
        fill_dynamic(cache, n_layers, b, kv_heads, t, d, dev)
        return cache, sum(x.numel() * x.element_size() for lay in cache.layers for x in (lay.keys, lay.values))

    def make_static(b):
        from transformers import StaticCache

        model.set_attn_implementation("sdpa")
        cache = StaticCache(config=model.config, max_cache_len=t + steps + 8)
        fill_dynamic(cache, n_layers, b, kv_heads, t, d, dev)
        return cache, sum(x.numel() * x.element_size() for lay in cache.layers for x in (lay.keys, lay.values))

    def make_packed(b, recipe=rec):
        cache = packed_cache(model, recipe, b, t, dev)
        return cache, sum(sum(lay.nbytes().values()) for lay in cache.layers)

    def eager(cache, b):
        return decode_steps(model, cache, b, steps, c.vocab_size, dev)

    def eager_sliding_reference(cache, b):
        """Eager steps with the sliding-window layers on the PyTorch reference (where they ran
        before the kernel took them); the global layers on the kernel."""
        from kvcalib.runtime import triton_path

        real = triton_path._reason_unsupported
        triton_path._reason_unsupported = lambda q, layer: "sliding-window layer" if layer.is_sliding else real(q, layer)
        try:
            return eager(cache, b)
        finally:
            triton_path._reason_unsupported = real

    if args.sliding:  # per batch: bf16, kvcalib before (sliding layers on the reference), now, graphs
        for b in args.batches_packed:
            run("bf16_dynamic", b, make_dynamic, eager)
            run("kvcalib_2bit_sliding_reference", b, make_packed, eager_sliding_reference)
            run("kvcalib_2bit", b, make_packed, eager)
            if args.graphs:
                run("kvcalib_2bit_graph", b, make_packed, graph_decode)
        _write_json(out / e2e_file, res)
        return
    for b in args.batches_bf16:
        run("bf16_dynamic", b, make_dynamic, eager)
        if args.graphs:
            run("bf16_static_graph", b, make_static, graph_decode)
    if args.pats:  # compile the tier-move kernels (requantize 8 -> 4 -> 2) outside the timed steps
        warm = CompressedCache.from_recipe(model, pats).layers[0].codec
        for side, enc in (("k", warm.encode_keys), ("v", warm.encode_values)):
            blk = enc(torch.randn(1, kv_heads, 128, d, device=dev, dtype=torch.bfloat16))
            for bits in (4, 2):
                blk = warm.requantize(side, blk, bits)
        torch.cuda.synchronize()
    for b in args.batches_packed:
        if args.pats:  # graph decoding only: plain 2-bit, then the PATS tiers
            run("kvcalib_2bit_graph", b, make_packed, graph_decode)
            run("kvcalib_pats_graph", b, lambda b: make_packed(b, pats), graph_decode)
            continue
        run("kvcalib_2bit", b, make_packed, eager)
        if args.graphs:
            run("kvcalib_2bit_graph", b, make_packed, graph_decode)
    _write_json(out / e2e_file, res)


def main_rounds(args) -> None:
    """Eager decode steps of bf16 ``DynamicCache`` and kvcalib's 2-bit cache in interleaved rounds
    (bf16, kvcalib, bf16, ...) per context and batch, both caches alive for the whole row, so a
    drift of the host's speed between minutes (bf16's own rounds spanned up to 1.7x on the lent
    H100) hits both alike.
    Rows: per round tokens/s of each, the medians and the median of the rounds' paired ratios;
    ``e2e_rounds.json``."""
    from transformers import DynamicCache

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    dims = SMALL_DIMS if args.quick else {}
    contexts = [4096] if args.quick else args.contexts
    steps, rounds = args.steps, args.rounds
    model = build_model(dev, **dims, max_pos=max(contexts) + steps * rounds + 64)
    c = model.config
    n_layers, kv_heads, d = c.num_hidden_layers, c.num_key_value_heads, c.head_dim
    rec = kivi2_recipe()
    res = {**device_info(), "model": "small smoke model" if args.quick else "random-weight Mistral-7B shape",
           "recipe": rec.default_layer.to_dict(), "steps": steps, "rounds": rounds, "rows": [],
           "command": " ".join(["python -m benchmarks.e2e", *sys.argv[1:]])}
    for t in contexts:
        for b in args.batches_packed:
            torch.cuda.empty_cache()
            bf16 = DynamicCache(config=c)
            fill_dynamic(bf16, n_layers, b, kv_heads, t, d, dev)
            packed = packed_cache(model, rec, b, t, dev)  # (registers "kvcalib" attention)
            per = {"bf16": [], "kvcalib": []}
            for r in range(rounds + 1):  # round 0 warms both (compilation, captures) and is not kept
                for kind, cache, attn in (("bf16", bf16, "sdpa"), ("kvcalib", packed, "kvcalib")):
                    model.set_attn_implementation(attn)
                    times = decode_steps(model, cache, b, steps, c.vocab_size, dev)
                    if r:
                        per[kind].append(b * len(times) / sum(times))
            ratios = sorted(k / f for k, f in zip(per["kvcalib"], per["bf16"]))
            row = {"context": t, "batch": b, "bf16_tokens_per_s": statistics.median(per["bf16"]),
                   "kvcalib_tokens_per_s": statistics.median(per["kvcalib"]), "ratio_median": ratios[len(ratios) // 2],
                   "ratio_min": ratios[0], "rounds_bf16": [round(x, 2) for x in per["bf16"]],
                   "rounds_kvcalib": [round(x, 2) for x in per["kvcalib"]]}
            res["rows"].append(row)
            log(f"  ctx {t:6d} b={b}: bf16 {row['bf16_tokens_per_s']:.1f}, kvcalib {row['kvcalib_tokens_per_s']:.1f} "
                f"tok/s, paired ratio median {row['ratio_median']:.2f}x (min {row['ratio_min']:.2f}x)")
            _write_json(out / "e2e_rounds.json", res)
            del bf16, packed
    log("\n| context | batch | bf16 tok/s | kvcalib tok/s | ratio (median of rounds) | lowest round |")
    log("|---:|---:|---:|---:|---:|---:|")
    for row in res["rows"]:
        log(f"| {row['context']} | {row['batch']} | {row['bf16_tokens_per_s']:.1f} | {row['kvcalib_tokens_per_s']:.1f} "
            f"| {row['ratio_median']:.2f}x | {row['ratio_min']:.2f}x |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="artifacts/bench")
    ap.add_argument("--quick", action="store_true", help="a 2-layer model at 4k (checks the path, seconds)")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batches-bf16", type=int, nargs="*", default=[8])
    ap.add_argument("--batches-packed", type=int, nargs="*", default=[8, 32])
    ap.add_argument("--sliding", action="store_true",
                    help="a Gemma-3-1B shape (sliding-window layers): bf16, kvcalib with its sliding layers on "
                         "the reference and on the kernel, CUDA graphs; writes e2e_sliding.json")
    ap.add_argument("--pats", action="store_true",
                    help="CUDA-graph decoding of a PATS middle-heavy cache beside plain 2-bit (e2e_pats.json)")
    ap.add_argument("--no-graphs", dest="graphs", action="store_false",
                    help="eager steps only (no CUDA-graph runs of either cache)")
    ap.add_argument("--rounds", type=int, default=0,
                    help="> 0: eager steps only, bf16 and kvcalib in this many interleaved rounds per context "
                         "(--contexts) and batch (--batches-packed); writes e2e_rounds.json")
    ap.add_argument("--contexts", type=int, nargs="*", default=[4096, 16384, 32768], help="with --rounds")
    args = ap.parse_args(argv)
    main_rounds(args) if args.rounds > 0 else main_e2e(args)


if __name__ == "__main__":
    main()
