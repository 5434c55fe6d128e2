"""A real model on the GPU: warm decode tokens/s of bf16 vs compressed caches in plain
``model.generate`` (eager) and with CUDA-graph decode steps, and whether graph and eager agree.

    python -m benchmarks.real_model --out $OUT [--model smollm2-135m] [--prompt-len 6000]
        [--new-tokens 128] [--batches 1,8] [--recipes kivi-2,recipes/smollm2-135m/recipe.safetensors]
        [--padded]

Prompts: ``batch`` windows of exactly ``prompt-len`` tokens of the Britannica article (``--data
longtext``, evaluation split), one per row (no padding; ``--padded``: row ``b`` keeps only its last
``prompt-len - 211 b`` tokens, left-padded, so the rows' lengths differ and so do their flush
steps, as in an lm-eval batch; the decode rate still counts every row's new tokens). Per (batch, cache, mode): a first call
(Triton compilation and CUDA-graph captures happen here; its time is reported apart as
``first_call_s``), then the warm measurement: the decode rate is ``batch x (new_tokens - 1) /
(t(new_tokens) - t(1))``, i.e. generation time after the prefill and the first token, greedy,
measured in ``--rounds`` rounds that take every (cache, mode) of the batch in turn (the host's
speed drifts on these machines; ``tokens_per_s`` is the median, ``rounds`` each round's).
Rows go to ``$OUT/real_model.json`` (a list of objects with keys ``model``,
``gpu``, ``batch``, ``prompt_len``, ``new_tokens``, ``cache`` ("bf16" or the recipe's name; a name two recipes share gets its folder),
``mode`` ("eager": plain generate (bf16: default SDPA; "eager-no-cudnn-sdpa": with
``torch.backends.cuda.enable_cudnn_sdp(False)``, see ``bf16_no_cudnn``), for kvcalib the default cache, whose decode steps replay one CUDA graph
per layer's attention (``kvcalib.runtime.layer_graphs``); "eager-no-layer-graphs": plain
generate with them off (``layer_graphs="off"``), every kernel launched from Python: the reference
tokens; "generate+graphs": plain generate inside ``kvcalib.cuda_graphs(model)``; "graph":
kvcalib's GraphDecoder; "eager-row-by-row": "eager" with a padded batch's rows launched one
by one, ``KVCALIB_JOINT_ROWS=0``), ``tokens_per_s``, ``rounds``, ``prefill_s`` (the median warm
1-token call: the prompt's forward and one sample), ``first_call_s``, ``graph_equals_eager``
(the mode's tokens equal eager-no-layer-graphs' over all new tokens), and for "eager" the last
call's ``layer_graphs`` counters (captures, replays, eager steps, host seconds outside replays));
a table is printed last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def prompts(tok, batch: int, length: int) -> torch.Tensor:
    from kvcalib.data import load_texts

    (text,) = load_texts("longtext", "eval")
    ids = tok(text, return_tensors="pt")["input_ids"][0]  # (N,)
    need = batch * length
    if ids.numel() < need:
        ids = ids.repeat(need // ids.numel() + 1)
    return ids[:need].reshape(batch, length)  # (B, L)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


PAD_STEP = 211  # tokens fewer per row with --padded (not a multiple of any flush block)


def left_pad(ids: torch.Tensor, step: int = PAD_STEP) -> tuple[torch.Tensor, torch.Tensor]:
    """Row ``b`` of ``ids`` (B, L) keeps its last ``L - step * b`` tokens, left-padded with 0:
    (ids, attention mask), both (B, L)."""
    b, length = ids.shape
    keep = torch.tensor([length - step * i for i in range(b)])  # (B,)
    if int(keep.min()) < 1:
        raise SystemExit(f"--padded: {b} rows of {length} tokens leave row {b - 1} without a token; use a longer prompt")
    mask = (torch.arange(length)[None] >= (length - keep)[:, None]).long()  # (B, L)
    return ids * mask, mask


def run_generate(model, ids: torch.Tensor, cache_factory, new: int, mask: torch.Tensor | None = None):
    """Greedy ``model.generate`` over ``ids`` (B, L) (``mask`` (B, L): its attention mask, None: no
    padding) with a fresh cache; (new tokens (B, n), seconds)."""
    mask = torch.ones_like(ids) if mask is None else mask
    _sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache_factory(), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=0)
    _sync()
    return out[:, ids.shape[1]:], time.perf_counter() - t0


def run_graph(model, ids: torch.Tensor, recipe, new: int, mask: torch.Tensor | None = None):
    from kvcalib.runtime.cache import CompressedCache
    from kvcalib.runtime.graphs import GraphDecoder

    _sync()
    t0 = time.perf_counter()
    decoder = GraphDecoder(model, CompressedCache.from_recipe(model, recipe))
    res = decoder.generate(ids, torch.ones_like(ids) if mask is None else mask, new)
    _sync()
    return res.tokens, time.perf_counter() - t0


def run_generate_layer_graphs(model, ids: torch.Tensor, recipe, new: int, seen: list | None = None,
                              mask: torch.Tensor | None = None):
    """Plain ``model.generate`` over a default cache: each layer's attention a CUDA graph replay.
    ``seen``: the cache's LayerGraphs is appended (its counters: captures, replays, host seconds)."""
    from kvcalib.runtime.cache import CompressedCache

    def factory():
        cache = CompressedCache.from_recipe(model, recipe)
        if seen is not None:
            seen.append(cache.layer_graphs)
        return cache

    return run_generate(model, ids, factory, new, mask)


def run_generate_row_by_row(model, ids: torch.Tensor, recipe, new: int, mask: torch.Tensor | None = None):
    """Plain ``model.generate`` over a default cache whose padded rows are never joined
    (``KVCALIB_JOINT_ROWS=0``: one kernel launch per row, ``kvcalib/runtime/joint.py``): the
    baseline of the joint launch."""
    import os

    was = os.environ.get("KVCALIB_JOINT_ROWS")
    os.environ["KVCALIB_JOINT_ROWS"] = "0"
    try:
        return run_generate_layer_graphs(model, ids, recipe, new, mask=mask)
    finally:
        if was is None:
            del os.environ["KVCALIB_JOINT_ROWS"]
        else:
            os.environ["KVCALIB_JOINT_ROWS"] = was


def run_generate_graphs(model, ids: torch.Tensor, recipe, new: int, mask: torch.Tensor | None = None):
    """Plain ``model.generate`` inside ``kvcalib.cuda_graphs(model)`` (the one-liner)."""
    import kvcalib
    from kvcalib.runtime.cache import CompressedCache

    with kvcalib.cuda_graphs(model):
        return run_generate(model, ids, lambda: CompressedCache.from_recipe(model, recipe), new, mask)


def rates(configs: dict, batch: int, new: int, rounds: int, on_round=None, deadline: float | None = None) -> dict:
    """Per config (name -> fn(n) -> (tokens, seconds)): first-call seconds (compiles kernels,
    captures graphs), then ``rounds`` interleaved rounds of a 1-token and a ``new``-token call
    over every config in turn (the host's speed drifts between minutes on these machines, so
    configs are compared round by round), the median warm decode rate and each round's, and the
    tokens of the last long call. ``on_round(res)`` runs after the first calls and after each
    round (the caller saves what is measured so far: a device call cut short by its time limit
    keeps it); no round starts after ``deadline`` (``time.perf_counter()`` seconds)."""
    res = {}
    for name, fn in configs.items():
        tokens, seconds = fn(new)
        res[name] = {"first": seconds, "rates": [], "prefills": [], "tokens": tokens, "median": None}
    for _ in range(rounds):
        if on_round is not None:
            on_round(res)
        if deadline is not None and time.perf_counter() > deadline:
            print(f"real_model: time budget spent, {len(next(iter(res.values()))['rates'])} of {rounds} rounds",
                  flush=True)
            break
        for name, fn in configs.items():
            _, t1 = fn(1)
            tokens, tn = fn(new)
            res[name]["rates"].append(batch * (new - 1) / max(tn - t1, 1e-9))
            res[name]["prefills"].append(t1)  # the 1-token call: the prompt's forward and one sample
            res[name]["tokens"] = tokens
            res[name]["median"] = statistics.median(res[name]["rates"])
    return res


def save(out: Path, rows: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "real_model.json.tmp").write_text(json.dumps(rows, indent=1))
    (out / "real_model.json.tmp").replace(out / "real_model.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompt-len", type=int, default=6000)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--recipes", default="kivi-2,recipes/smollm2-135m/recipe.safetensors")
    parser.add_argument("--modes", default="eager,generate+graphs,graph",
                        help="compressed-cache modes beside eager-no-layer-graphs (always run: the reference tokens)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (median reported)")
    parser.add_argument("--padded", action="store_true",
                        help=f"left-pad the rows: row b keeps its last prompt-len - {PAD_STEP} b tokens")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no timing round after this many seconds (rows keep the rounds done)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    deadline = None if args.budget_s is None else time.perf_counter() + args.budget_s
    modes = set(args.modes.split(","))

    from transformers import DynamicCache

    from kvcalib.models import load_model
    from kvcalib.recipe import resolve_recipe
    from kvcalib.runtime.cache import CompressedCache

    loaded = load_model(args.model, device="cuda", dtype="bf16")
    model, tok = loaded.model, loaded.tokenizer
    gpu = torch.cuda.get_device_name(0)
    rows = []
    specs = [spec for spec in args.recipes.split(",") if spec]
    recipes = [resolve_recipe(spec) for spec in specs]
    # a row names its cache by the recipe's name; two recipes of one search share it (every search
    # names its pick MODEL-search-Nb), so a name that repeats gets its file's folder beside it
    names = [r.name for r in recipes]
    labels = [n if names.count(n) == 1 else f"{n} ({Path(spec).parent.name or spec})"
              for n, spec in zip(names, specs)]
    for batch in [int(b) for b in args.batches.split(",")]:
        ids = prompts(tok, batch, args.prompt_len)  # (B, L)
        mask = None
        if args.padded:
            ids, mask = left_pad(ids)
            mask = mask.cuda()
        ids = ids.cuda()
        base = dict(model=args.model, gpu=gpu, batch=batch, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                    padded=args.padded)

        def bf16(n):
            model.set_attn_implementation("sdpa")
            return run_generate(model, ids, DynamicCache, n, mask)

        def bf16_no_cudnn(n):
            # torch 2.11 + cuDNN 9.19 on Hopper: default SDPA takes cuDNN attention and plans it anew
            # for every new key length, ~40 ms per decode step of a growing DynamicCache (one plan
            # per step, shared by the layers); with cuDNN SDPA off it takes flash attention
            model.set_attn_implementation("sdpa")
            was = torch.backends.cuda.cudnn_sdp_enabled()
            torch.backends.cuda.enable_cudnn_sdp(False)
            try:
                return run_generate(model, ids, DynamicCache, n, mask)
            finally:
                torch.backends.cuda.enable_cudnn_sdp(was)

        configs = {("bf16", "eager"): bf16, ("bf16", "eager-no-cudnn-sdpa"): bf16_no_cudnn}
        seen: dict = {}
        for recipe, label in zip(recipes, labels):
            # plain generate without layer graphs: every compressed attention call launched from Python
            configs[(label, "eager-no-layer-graphs")] = (
                lambda n, r=recipe: run_generate(model, ids, lambda: CompressedCache.from_recipe(
                    model, r, layer_graphs="off"), n, mask))
            seen[label] = []
            for mode, fn in (("eager", run_generate_layer_graphs), ("eager-row-by-row", run_generate_row_by_row),
                             ("generate+graphs", run_generate_graphs), ("graph", run_graph)):
                if mode in modes:
                    extra = {"seen": seen[label]} if mode == "eager" else {}
                    configs[(label, mode)] = lambda n, r=recipe, f=fn, e=extra: f(model, ids, r, n, mask=mask, **e)
        def batch_rows(res: dict) -> list[dict]:
            out = []
            for (cache, mode), r in res.items():
                row = {**base, "cache": cache, "mode": mode, "tokens_per_s": r["median"], "rounds": list(r["rates"]),
                       "prefill_s": statistics.median(r["prefills"]) if r["prefills"] else None,
                       "first_call_s": r["first"], "graph_equals_eager": None}
                if cache != "bf16" and mode != "eager-no-layer-graphs":
                    ref = res[(cache, "eager-no-layer-graphs")]["tokens"].cpu()
                    row["graph_equals_eager"] = bool(torch.equal(ref, r["tokens"].cpu()))
                    row["token_agreement"] = float((ref == r["tokens"].cpu()).float().mean())
                if mode == "eager" and seen.get(cache):
                    lg = seen[cache][-1]  # the last long call's cache
                    row["layer_graphs"] = {"captures": lg.captures, "replays": lg.replays,
                                           "eager_steps": lg.eager_steps,
                                           "host_s": {k: round(v, 4) for k, v in lg.seconds.items()}}
                out.append(row)
            return out

        done = list(rows)  # the batches before this one
        # after the first calls and every round: a run cut short by its time limit keeps what it measured
        res = rates(configs, batch, args.new_tokens, args.rounds,
                    on_round=lambda res: save(args.out, done + batch_rows(res)), deadline=deadline)
        for row in batch_rows(res):
            rows.append(row)
            print(json.dumps(row), flush=True)
        save(args.out, rows)
    save(args.out, rows)
    print(f"\n{'batch':>5} {'cache':<24} {'mode':<22} {'tok/s':>8} {'rounds':<20} {'prefill s':>9} {'first s':>8} "
          "graph==eager")
    for r in rows:
        spread = "/".join(f"{x:.0f}" for x in r["rounds"])
        rate = float("nan") if r["tokens_per_s"] is None else r["tokens_per_s"]
        prefill = float("nan") if r["prefill_s"] is None else r["prefill_s"]
        print(f"{r['batch']:>5} {r['cache'][:24]:<24} {r['mode']:<22} {rate:8.1f} {spread:<20} {prefill:9.3f} "
              f"{r['first_call_s']:8.1f} {r['graph_equals_eager']} {r.get('layer_graphs', '')}")


if __name__ == "__main__":
    main()
