"""On the real model (GPU): do graph decoding, ``model.generate`` and padded batches compute what
they should? Issue 35 item 2 (static == dynamic) and issue 33 item 4 (padded rows == alone).

For each recipe (the searched ``recipes/smollm2-135m`` and the kivi-2 / kivi-4 presets), at each
prompt length (a window of the Britannica article):

``modes``   greedy tokens of ``GraphDecoder`` (CUDA graphs) and of ``model.generate(past_key_values=
            CompressedCache)``; the first step where they part (null: never); and the largest
            |logit difference| per step between the graph's logits and ordinary (eager, dynamic)
            decoding teacher-forced on the graph's tokens -- 0.0 when the two modes are one
            computation, as they are since the pending window's buffer is shared (before, the
            searched recipe parted at step 20 with differences up to 0.72 on an H100).
``padded``  prompts of ``--pad-lens`` tokens left-padded into one batch, teacher-forced on the
            next 48 tokens of the text: per row the loss (nats/token) and the largest |logit
            difference| against the same prompt alone, eager and graph (issue 33 measured 3.39
            padded vs 3.02 alone for 4,100 tokens beside 6,000 before rows were held apart).

    python scripts/real_model_modes.py --device cuda                  # bf16, ~3 min on an H100
    python scripts/real_model_modes.py --device cuda --dtype fp32     # the same without bf16 rounding

Writes ``artifacts/bench/real_model_modes.json`` (a list of objects, one per check, each with
``model``, ``gpu``, ``dtype``, ``recipe``, ``check``, ``prompt_len`` and its numbers).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _text_ids(tokenizer, n: int, offset: int = 0) -> torch.Tensor:
    """(n,) token ids of the Britannica article, from token ``offset``."""
    from kvcalib.data import _britannica_text

    ids = tokenizer(_britannica_text()[: 40 * (n + offset + 64)], return_tensors="pt")["input_ids"][0]
    if ids.numel() < offset + n + 48:
        raise SystemExit(f"the text holds {ids.numel()} tokens, fewer than {offset + n + 48}")
    return ids[offset:offset + n + 48]


def _eager_logits(model, recipe, ids, mask, tokens):
    """Ordinary decoding over a fresh CompressedCache, teacher-forced on ``tokens`` (B, steps):
    logits (steps, B, V) float32 -- the prompt's last position, then each fed token but the last."""
    from kvcalib.runtime.cache import CompressedCache

    cache = CompressedCache.from_recipe(model, recipe)
    b, t = ids.shape
    full = torch.cat([mask, mask.new_ones((b, tokens.shape[1]))], 1)  # (B, T + steps)
    pos = (full.cumsum(-1) - 1).clamp_min(0)
    out = []
    with torch.no_grad():
        out.append(model(input_ids=ids, attention_mask=mask, position_ids=pos[:, :t], past_key_values=cache,
                         logits_to_keep=1).logits[:, -1].float())
        for i in range(tokens.shape[1] - 1):
            out.append(model(input_ids=tokens[:, i:i + 1], attention_mask=full[:, :t + i + 1],
                             position_ids=pos[:, t + i:t + i + 1], past_key_values=cache).logits[:, -1].float())
    return torch.stack(out)


def _decoder(model, recipe):
    """A graph decoder over a fresh cache (CUDA graphs on CUDA; the same steps eagerly elsewhere)."""
    from kvcalib.runtime.cache import CompressedCache
    from kvcalib.runtime.graphs import GraphDecoder

    cuda = next(model.parameters()).is_cuda
    return GraphDecoder(model, CompressedCache.from_recipe(model, recipe), keep_logits=True, capture=cuda)


def _check_modes(model, recipe, ids, new_tokens: int) -> dict:
    from kvcalib.runtime.cache import CompressedCache

    dev = next(model.parameters()).device
    ids = ids[None].to(dev)
    mask = torch.ones_like(ids)
    graph = _decoder(model, recipe).generate(ids, mask, max_new_tokens=new_tokens)
    with torch.no_grad():
        gen = model.generate(ids, attention_mask=mask, past_key_values=CompressedCache.from_recipe(model, recipe),
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0)[:, ids.shape[1]:]
    parted = (graph.tokens[0] != gen[0]).nonzero()
    eager = _eager_logits(model, recipe, ids, mask, graph.tokens)
    diff = (torch.stack(graph.logits) - eager).abs().amax(dim=(1, 2))  # (steps,)
    return {"graph_equals_eager": bool(torch.equal(graph.tokens, gen)),
            "tokens_part_at": None if parted.numel() == 0 else int(parted[0, 0]),
            "max_abs_logit_diff": float(diff.max()), "steps_with_logit_diff": int((diff > 0).sum()),
            "logit_scale": float(eager.abs().max()), "captures": graph.captures, "replays": graph.replays}


def _check_padded(model, recipe, rows: list[torch.Tensor]) -> dict:
    """Left-padded batch of ``rows`` (prompt + 48 continuation tokens each), teacher-forced."""
    dev = next(model.parameters()).device
    prompts = [r[:-48] for r in rows]
    cont = torch.stack([r[-48:] for r in rows]).to(dev)  # (B, 48)
    width = max(len(p) for p in prompts)
    ids = torch.stack([torch.cat([torch.zeros(width - len(p), dtype=torch.long), p]) for p in prompts]).to(dev)
    mask = (torch.arange(width)[None] >= torch.tensor([[width - len(p)] for p in prompts])).long().to(dev)

    def loss(logits, target):  # logits (48, V) predicting target (48,)
        return float(torch.nn.functional.cross_entropy(logits.float(), target))

    batch = _eager_logits(model, recipe, ids, mask, cont)  # (48, B, V)
    out = {"prompt_lens": [len(p) for p in prompts], "rows": []}
    for i, p in enumerate(prompts):
        one = torch.ones((1, len(p)), dtype=torch.long, device=dev)
        alone = _eager_logits(model, recipe, p[None].to(dev), one, cont[i:i + 1])
        out["rows"].append({"prompt_len": len(p), "loss_padded": loss(batch[:, i], cont[i]),
                            "loss_alone": loss(alone[:, 0], cont[i]),
                            "max_abs_logit_diff_eager": float((batch[:, i] - alone[:, 0]).abs().max())})
    graph = _decoder(model, recipe).generate(ids, mask, max_new_tokens=16)
    for i, p in enumerate(prompts):
        alone = _decoder(model, recipe).generate(p[None].to(dev), None, max_new_tokens=16)
        out["rows"][i]["graph_tokens_equal_alone"] = bool(torch.equal(graph.tokens[i], alone.tokens[0]))
        out["rows"][i]["max_abs_logit_diff_graph"] = max(
            float((a[i] - b[0]).abs().max()) for a, b in zip(graph.logits, alone.logits))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--recipes", default="recipes/smollm2-135m/recipe.safetensors,kivi-2,kivi-4")
    ap.add_argument("--prompt-lens", default="300,1000,6000")
    ap.add_argument("--pad-lens", default="4100,6000")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--out", default=str(ROOT / "artifacts/bench/real_model_modes.json"))
    args = ap.parse_args()

    import kvcalib
    from kvcalib.recipe import resolve_recipe

    loaded = kvcalib.load_model(args.model, device=args.device, dtype=args.dtype)
    model, tok = loaded.model, loaded.tokenizer
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    records = []
    for name in args.recipes.split(","):
        recipe = resolve_recipe(name)
        for n in (int(x) for x in args.prompt_lens.split(",")):
            t0 = time.perf_counter()
            rec = _check_modes(model, recipe, _text_ids(tok, n)[:n], args.new_tokens)
            records.append({"model": args.model, "gpu": gpu, "dtype": args.dtype, "recipe": recipe.name,
                            "check": "modes", "prompt_len": n, "new_tokens": args.new_tokens, **rec,
                            "seconds": round(time.perf_counter() - t0, 1)})
            print(json.dumps(records[-1]), flush=True)
        lens = [int(x) for x in args.pad_lens.split(",")]
        rows = [_text_ids(tok, n, offset=200 * i) for i, n in enumerate(lens)]
        t0 = time.perf_counter()
        rec = _check_padded(model, recipe, rows)
        records.append({"model": args.model, "gpu": gpu, "dtype": args.dtype, "recipe": recipe.name,
                        "check": "padded", "prompt_len": max(lens), **rec,
                        "seconds": round(time.perf_counter() - t0, 1)})
        print(json.dumps(records[-1]), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(records, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
