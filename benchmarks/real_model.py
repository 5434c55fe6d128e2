"""A real model on the GPU: warm decode tokens/s of bf16 vs compressed caches in plain
``model.generate`` (eager) and with CUDA-graph decode steps, and whether graph and eager agree.

    python -m benchmarks.real_model --out $OUT [--model smollm2-135m] [--prompt-len 6000]
        [--new-tokens 128] [--batches 1,8] [--recipes kivi-2,recipes/smollm2-135m/recipe.safetensors]

Prompts: ``batch`` windows of exactly ``prompt-len`` tokens of the Britannica article (``--data
longtext``, evaluation split), one per row (no padding). Per (batch, cache, mode): a first call
(Triton compilation and CUDA-graph captures happen here; its time is reported apart as
``first_call_s``), then the warm measurement: the decode rate is ``batch x (new_tokens - 1) /
(t(new_tokens) - t(1))``, i.e. generation time after the prefill and the first token, greedy.
``graph_equals_eager``: the graph decoder's tokens equal plain generate's over all new tokens (for
the compressed caches). Rows go to ``$OUT/real_model.json`` (a list of objects with keys ``model``,
``gpu``, ``batch``, ``prompt_len``, ``new_tokens``, ``cache`` ("bf16" or the recipe's name),
``mode`` ("eager": plain generate; "generate+graphs": plain generate inside
``kvcalib.cuda_graphs(model)``; "graph": kvcalib's GraphDecoder), ``tokens_per_s``,
``first_call_s``, ``graph_equals_eager``); a table is printed last.
"""

from __future__ import annotations

import argparse
import json
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


def run_generate(model, ids: torch.Tensor, cache_factory, new: int) -> tuple[torch.Tensor, float]:
    """Greedy ``model.generate`` over ``ids`` (B, L) with a fresh cache; (new tokens (B, n), seconds)."""
    mask = torch.ones_like(ids)
    _sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache_factory(), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=0)
    _sync()
    return out[:, ids.shape[1]:], time.perf_counter() - t0


def run_graph(model, ids: torch.Tensor, recipe, new: int) -> tuple[torch.Tensor, float]:
    from kvcalib.runtime.cache import CompressedCache
    from kvcalib.runtime.graphs import GraphDecoder

    _sync()
    t0 = time.perf_counter()
    decoder = GraphDecoder(model, CompressedCache.from_recipe(model, recipe))
    res = decoder.generate(ids, torch.ones_like(ids), new)
    _sync()
    return res.tokens, time.perf_counter() - t0


def run_generate_graphs(model, ids: torch.Tensor, recipe, new: int) -> tuple[torch.Tensor, float]:
    """Plain ``model.generate`` inside ``kvcalib.cuda_graphs(model)`` (the one-liner)."""
    import kvcalib
    from kvcalib.runtime.cache import CompressedCache

    with kvcalib.cuda_graphs(model):
        return run_generate(model, ids, lambda: CompressedCache.from_recipe(model, recipe), new)


def rate(fn, batch: int, new: int) -> tuple[float, float, torch.Tensor]:
    """(first-call seconds, warm decode tokens/s, tokens of the warm long call)."""
    _, first = fn(new)  # compiles kernels, captures graphs
    _, t1 = fn(1)
    tokens, tn = fn(new)
    return first, batch * (new - 1) / max(tn - t1, 1e-9), tokens


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
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    from transformers import DynamicCache

    from kvcalib.models import load_model
    from kvcalib.recipe import resolve_recipe
    from kvcalib.runtime.cache import CompressedCache

    loaded = load_model(args.model, device="cuda", dtype="bf16")
    model, tok = loaded.model, loaded.tokenizer
    gpu = torch.cuda.get_device_name(0)
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        ids = prompts(tok, batch, args.prompt_len).cuda()
        base = dict(model=args.model, gpu=gpu, batch=batch, prompt_len=args.prompt_len, new_tokens=args.new_tokens)
        model.set_attn_implementation("sdpa")
        first, tps, _ = rate(lambda n: run_generate(model, ids, DynamicCache, n), batch, args.new_tokens)
        rows.append({**base, "cache": "bf16", "mode": "eager", "tokens_per_s": tps, "first_call_s": first,
                     "graph_equals_eager": None})
        for spec in [r for r in args.recipes.split(",") if r]:
            recipe = resolve_recipe(spec)
            first, tps, eager_tokens = rate(
                lambda n: run_generate(model, ids, lambda: CompressedCache.from_recipe(model, recipe), n),
                batch, args.new_tokens)
            rows.append({**base, "cache": recipe.name, "mode": "eager", "tokens_per_s": tps, "first_call_s": first,
                         "graph_equals_eager": None})
            for mode, fn in (("generate+graphs", run_generate_graphs), ("graph", run_graph)):
                gfirst, gtps, graph_tokens = rate(lambda n: fn(model, ids, recipe, n), batch, args.new_tokens)
                same = bool(torch.equal(eager_tokens.cpu(), graph_tokens.cpu()))
                agree = float((eager_tokens.cpu() == graph_tokens.cpu()).float().mean())
                rows.append({**base, "cache": recipe.name, "mode": mode, "tokens_per_s": gtps, "first_call_s": gfirst,
                             "graph_equals_eager": same, "token_agreement": agree})
                print(json.dumps(rows[-1]), flush=True)
                save(args.out, rows)  # after every row: a run cut short by its time limit keeps what it measured
    save(args.out, rows)
    print(f"\n{'batch':>5} {'cache':<32} {'mode':<15} {'tok/s':>8} {'first s':>8} graph==eager")
    for r in rows:
        print(f"{r['batch']:>5} {r['cache'][:32]:<32} {r['mode']:<15} {r['tokens_per_s']:8.1f} {r['first_call_s']:8.1f} "
              f"{r['graph_equals_eager']} {r.get('token_agreement', '')}")


if __name__ == "__main__":
    main()
