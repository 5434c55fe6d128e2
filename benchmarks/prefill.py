"""The prompt's forward through a CompressedCache: its own attention over the uncompressed prompt
(``kvcalib.runtime.reference.full_precision_prefill``) taken whole or in chunks of query rows.

    python benchmarks/prefill.py --model smollm2-135m --tokens 8000 --recipe kivi-2 --rounds 2

Interleaved rounds of one prompt forward each way (``CPU_CAUSAL_WHOLE`` on and off; on CUDA in
float32 the chunks are what runs either way), the seconds of each, and the largest difference of
the last position's logits between the two. The prompt is the embedded Britannica text's first
``--tokens`` tokens. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=8000)
    parser.add_argument("--recipe", default="kivi-2")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    import kvcalib.runtime.reference as ref
    from kvcalib.assets import embedded_text_file
    from kvcalib.models import load_model
    from kvcalib.runtime.cache import CompressedCache

    loaded = load_model(args.model, device=args.device)
    text = open(embedded_text_file("britannica"), encoding="utf-8").read()
    ids = loaded.tokenizer(text, return_tensors="pt")["input_ids"][:, :args.tokens].to(args.device)  # (1, T)
    seconds: dict[str, list[float]] = {"chunked": [], "whole": []}
    last: dict[str, torch.Tensor] = {}
    for _ in range(args.rounds):
        for name in ("chunked", "whole"):
            ref.CPU_CAUSAL_WHOLE = name == "whole"
            cache = CompressedCache.from_recipe(loaded.model, args.recipe)
            t0 = time.perf_counter()
            with torch.no_grad():
                logits = loaded.model(input_ids=ids, past_key_values=cache).logits[0, -1]  # (V,)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            seconds[name].append(round(time.perf_counter() - t0, 2))
            last[name] = logits.float().cpu()
    print(json.dumps({"model": args.model, "tokens": int(ids.shape[1]), "recipe": args.recipe, "device": args.device,
                      "threads": torch.get_num_threads(), "seconds": seconds,
                      "max_logit_diff": float((last["whole"] - last["chunked"]).abs().max())}))


if __name__ == "__main__":
    main()
