"""Benchmark: any DecodeConfig grid on any shapes and layouts, CUDA-graph time with bf16 SDPA
beside it (the experiment behind a change of a default). Writes ``decode_sweep_<--name>.json``
(sweep logs are not kept in the repository: what one showed goes to ``artifacts/bench/HISTORY.md``
with its numbers and this command).

    python -m benchmarks.sweep --name stages --layouts 2/128/128 --configs '[{}, {"num_stages": 3}]'
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.common import MODELS, _write_json, graph_sweep


def main_sweep(args) -> None:
    """Any config grid on any shapes and layouts, CUDA-graph time with bf16 SDPA beside (the
    experiments behind a change of a default): ``--model``, ``--shapes 1x4096,8x32768`` (batch x
    context), ``--layouts 2/128/128,4/32/32`` (bits / key group / value group), ``--configs
    '[{}, {"num_stages": 3}]'`` (DecodeConfig fields over the defaults; ``{}`` is the default).
    Writes ``decode_sweep_<--name>.json``."""
    from kvcalib_kernels.decode_attention import DecodeConfig

    def pairs(text, sep):
        return tuple(tuple(int(x) for x in item.split(sep)) for item in text.split(",") if item)

    shapes, layouts = pairs(args.shapes, "x"), pairs(args.layouts, "/")
    if any(len(s) != 2 for s in shapes) or any(len(lay) != 3 for lay in layouts):
        raise SystemExit("--shapes wants BATCHxCONTEXT,... and --layouts BITS/KGROUP/VGROUP,...")
    configs = [DecodeConfig(**c) for c in json.loads(args.configs)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = graph_sweep(out / f"decode_sweep_{args.name}.json", shapes, lambda bits: configs,
                       lambda bits: DecodeConfig(), model=args.model, layouts=layouts)
    _write_json(out / f"decode_sweep_{args.name}.json",
                {"rows": rows, "command": "python -m benchmarks.sweep " + " ".join(
                    f"--{k} '{getattr(args, k)}'" for k in ("name", "model", "shapes", "layouts", "configs"))})


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="artifacts/bench")
    ap.add_argument("--model", choices=tuple(MODELS), default="mistral-7b", help="the shape to sweep")
    ap.add_argument("--shapes", default="1x32768,8x32768", help="BATCHxCONTEXT,...")
    ap.add_argument("--layouts", default="2/128/128,4/128/128", help="BITS/KGROUP/VGROUP,...")
    ap.add_argument("--configs", default="[{}]", help="JSON list of DecodeConfig fields ({} = defaults)")
    ap.add_argument("--name", default="custom", help="writes decode_sweep_NAME.json")
    main_sweep(ap.parse_args(argv))


if __name__ == "__main__":
    main()
