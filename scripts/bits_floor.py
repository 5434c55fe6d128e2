"""Below 3 bits: what a layout costs before any search (issue 53, item 4).

Effective bits per cached element of a layer whose keys and values are both 2-bit codes, by
component (codes, float16 scale/zero pairs, full-precision sinks + window + pending tokens), from
the same byte accounting the recipes and the search use (:func:`kvcalib.layout.layer_bytes`), for
the model shapes and contexts issue 53 names. The cheapest 2-bit layout a space holds is the
floor of any budget the search can meet there (``kvcalib search`` refuses a budget under it). The
last column is what the same layout would cost with 8-bit scale and zero (not a stored format
today: half the scale bytes), the first thing a 2.5- or 2.0-bit budget would need.

    python scripts/bits_floor.py [--out docs/bits_floor.md]

CPU only, seconds. Exact: counts, not measurements, at exactly ``context`` tokens (so sinks move
where the pending tokens' last partial block falls: with a context that is a multiple of the group,
4 sinks leave ``group - 4`` more tokens in full precision than none).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcalib.layout import LayerConfig, layer_bytes  # noqa: E402

# (name, kv heads, head_dim, context): the shapes issue 53's targets are set at
SHAPES = (("SmolLM2-135M", 3, 64, 8192), ("Qwen2.5-Coder-0.5B", 2, 64, 16384),
          ("Qwen2.5-Coder-1.5B", 2, 128, 16384), ("Mistral-7B", 8, 128, 32768))
# (key group, value group (None: the head), window, sinks): the default space's cheapest corners,
# then the larger groups and smaller windows a sub-3-bit space could add (a window is 0 or >= the
# key group: kvcalib.layout.LayerConfig)
LAYOUTS = ((64, 64, 128, 4), (64, 64, 64, 4), (64, 64, 64, 0), (32, 32, 64, 4), (128, None, 128, 4), (128, None, 128, 0),
           (64, 64, 0, 0), (128, None, 0, 0))


def rows() -> list[str]:
    out = ["| model | context | key group | value group | window + sinks | bits | codes | scales | full precision "
           "| with 8-bit scales |", "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for name, heads, head_dim, context in SHAPES:
        for k_group, v_group, window, sinks in LAYOUTS:
            v_group = min(v_group or head_dim, head_dim)
            cfg = LayerConfig(k_bits=2, v_bits=2, k_group=k_group, v_group=v_group, window=window, sinks=sinks)
            parts = layer_bytes(cfg, heads, head_dim, context)
            per_bit = 8 / (2 * context * heads * head_dim)  # bytes -> bits per cached element
            codes = (parts.get("k_codes", 0) + parts.get("v_codes", 0)) * per_bit
            scales = (parts.get("k_scales", 0) + parts.get("v_scales", 0)) * per_bit
            fp = parts["full_precision"] * per_bit
            out.append(f"| {name} | {context} | {k_group} | {v_group} | {window} + {sinks} | **{codes + scales + fp:.3f}** "
                       f"| {codes:.3f} | {scales:.3f} | {fp:.3f} | {codes + scales / 2 + fp:.3f} |")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="also write the table here (markdown)")
    args = ap.parse_args(argv)
    table = "\n".join(rows())
    print(table)
    if args.out:
        tmp = args.out.with_name(args.out.name + ".tmp")  # (no half-written table)
        tmp.write_text(table + "\n")
        os.replace(tmp, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
