"""What a stable decode launch costs on the GPU: the fused kernel over a packed store's whole
allocation with the live count on the device, against the same call over exactly the live tokens.

A stable-launch layer (``kvcalib.runtime.cache.CompressedLayer.stable_launch``) reads its packed
store whole (``PackedStore.capacity_view``: the live tokens plus up to ``GROWTH`` = 1/8 of them,
at least 4 flush blocks) with ``packed_start``/``packed_end`` on the device, so one CUDA graph of
its step outlives flushes. The price: the split plan spans the capacity (the programs past the
live count do nothing), and the range turns off the kernel's unmasked whole-block loop. This
measures that price where the GPU work is largest (Mistral-7B shape, 2-bit KIVI layout, window
128), CUDA-graph time over rotating input sets (no host time) and ``do_bench`` of the eager call:

    python -m benchmarks.stable_launch --out $OUT

Rows go to ``$OUT/stable_launch.json``; a table is printed last.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.common import _bench, _input_sets, device_info, graph_ms_per_call, packed_bytes, packed_inputs

SHAPES = [(1, 4096), (1, 32768), (8, 4096), (8, 32768)]  # (batch, context)
HQ, H, D, WINDOW, GROUP, BLOCK = 32, 8, 128, 128, 32, 32  # Mistral-7B heads; kivi-2's layout


def _calls(b: int, ctx: int, bits: int, stable: bool, dev):
    """Calls of one row over rotating input sets: exact (N live tokens) or stable (the store's
    capacity for N, the range on the device)."""
    from kvcalib.layout import LayerConfig
    from kvcalib.runtime.store import PackedStore
    from kvcalib_kernels.decode_attention import decode_attention

    n = ctx - WINDOW  # packed tokens (a multiple of the block)
    cap = PackedStore(LayerConfig(k_bits=bits, v_bits=bits, k_group=GROUP, v_group=GROUP, window=WINDOW)).capacity_for(n)
    rows = cap if stable else n
    sets = _input_sets(packed_bytes(b, H, HQ, rows, WINDOW, D, bits, GROUP, GROUP)["total"])
    fns = []
    for s in range(sets):
        packed = packed_inputs(b, H, rows, D, bits, GROUP, GROUP, dev, seed=s)
        q = torch.randn(b, HQ, D, device=dev, dtype=torch.bfloat16)
        window = (torch.randn(b, H, WINDOW, D, device=dev, dtype=torch.bfloat16),
                  torch.randn(b, H, WINDOW, D, device=dev, dtype=torch.bfloat16))
        extra = {}
        if stable:
            extra = dict(packed_start=torch.zeros(b, dtype=torch.int32, device=dev),
                         packed_end=torch.full((b,), n, dtype=torch.int32, device=dev))
        fns.append(lambda q=q, packed=packed, window=window, extra=extra: decode_attention(
            q, *packed, k_bits=bits, v_bits=bits, k_group=GROUP, v_group=GROUP, scaling=D ** -0.5,
            fp_segments=[window], fp_positions=[0], out_dtype=torch.bfloat16, **extra))
    return fns, cap


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--bits", default="2,4")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    rows = []
    for bits in [int(x) for x in args.bits.split(",")]:
        for b, ctx in SHAPES:
            row = {"batch": b, "context": ctx, "bits": bits, **device_info()}
            for label, stable in (("exact", False), ("stable", True)):
                fns, cap = _calls(b, ctx, bits, stable, dev)
                row[f"{label}_graph_us"] = 1e3 * graph_ms_per_call(fns, rep=50)
                row[f"{label}_eager_us"] = 1e3 * _bench(fns[0])
                row["capacity"] = cap
                del fns
                torch.cuda.empty_cache()
            row["graph_ratio"] = row["stable_graph_us"] / row["exact_graph_us"]
            rows.append(row)
            print(f"b{b} ctx{ctx} {bits}-bit: exact {row['exact_graph_us']:.1f} us, stable {row['stable_graph_us']:.1f} us "
                  f"(capacity {cap}) -> {row['graph_ratio']:.3f}x", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "stable_launch.json").write_text(json.dumps(rows, indent=1))
    print("\n| batch | context | bits | exact us (graph) | stable us (graph) | ratio | exact us (eager) | stable us (eager) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['batch']} | {r['context']} | {r['bits']} | {r['exact_graph_us']:.1f} | {r['stable_graph_us']:.1f} | "
              f"{r['graph_ratio']:.3f} | {r['exact_eager_us']:.1f} | {r['stable_eager_us']:.1f} |")


if __name__ == "__main__":
    main()
