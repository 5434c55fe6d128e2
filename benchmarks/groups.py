"""Benchmark: what key groups of 32 tokens and value groups of 32 / 16 channels cost the fused
kernel (CUDA-graph time, Mistral shape, against bf16 SDPA). Writes ``decode_groups.json``.

    python -m benchmarks.groups --out artifacts/bench     (CUDA, repository root)
"""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks.common import (MODELS, WINDOW, _input_sets, _write_json, bf16_bytes, bf16_sdpa_graph_ms,
                               graph_ms_per_call, kernel_call, log, main_with_out, packed_bytes, packed_inputs)


GROUP_VARIANTS = ((128, 128), (32, 128), (128, 32), (32, 32), (128, 16))  # (k_group, v_group)


def value_path(d, bits, v_group) -> str:
    """The groups table's label of how the kernel reads values of this layout
    (:func:`kvcalib_kernels.decode.plan.value_fold`, which the launch plan calls): one fold per
    plane, one per value group (chunks of a plane), or per-element dequantization."""
    from kvcalib_kernels.decode.plan import value_fold

    fold, n_chunks = value_fold(d, bits, v_group)
    return ("fold" if n_chunks == 1 else "group-fold") if fold else "per-element"


def key_blocks(d, rep, bits, k_group) -> str:
    """How the kernel runs key groups of this layout at the default block of 64 tokens: one group
    per block, two in the block's halves, or two as sets of virtual query rows."""
    import triton

    from kvcalib_kernels.decode.plan import DEFAULT_CONFIG, MIN_ROWS, _key_group_pairs

    if k_group >= DEFAULT_CONFIG.block_n:
        return "one"
    return "pairs" if _key_group_pairs(d, max(MIN_ROWS, triton.next_power_of_2(rep)), bits, bits) else "halves"


def main_groups(args) -> None:
    """What small groups cost the fused kernel: CUDA-graph time on the Mistral shape (batch 1 at
    4k / 32k, batch 8 at 32k; 4 and 8 bits) of each :data:`GROUP_VARIANTS` -- key groups of 32
    tokens (two per 64-token block), value groups of 32 channels (one accumulator per value group)
    and of 16 (per-element dequantization) -- against bf16 SDPA, default config.
    Writes ``decode_groups.json``."""
    from kvcalib_kernels.decode_attention import DecodeConfig

    dev = torch.device("cuda")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    hq, h, d = MODELS["mistral-7b"]
    scale = d ** -0.5
    rows = []
    for b, ctx in ((1, 4096), (1, 32768), (8, 32768)):
        n = ctx - WINDOW
        bb = bf16_bytes(b, h, hq, ctx, d)
        bf16_ms = bf16_sdpa_graph_ms(b, h, hq, ctx, d, dev)
        for bits in (4, 8):
            for kg, vg in GROUP_VARIANTS:
                cfg = DecodeConfig()
                keys = key_blocks(d, hq // h, bits, kg)
                nb = packed_bytes(b, h, hq, n, WINDOW, d, bits, kg, vg)["total"]
                sets = _input_sets(nb)
                inputs = [(torch.randn(b, hq, d, device=dev, dtype=torch.bfloat16),
                           packed_inputs(b, h, n, d, bits, kg, vg, dev, seed=i),
                           (torch.randn(b, h, WINDOW, d, device=dev, dtype=torch.bfloat16),
                            torch.randn(b, h, WINDOW, d, device=dev, dtype=torch.bfloat16))) for i in range(sets)]
                ms = graph_ms_per_call([kernel_call(q, pk, w, bits, kg, vg, n, scale, cfg) for q, pk, w in inputs],
                                       rep=30)
                path = value_path(d, bits, vg)
                rows.append({"model": "mistral-7b", "batch": b, "context": ctx, "bits": bits, "k_group": kg,
                             "v_group": vg, "key_blocks": keys, "value_path": path, "ms_graph": ms, "bf16_ms_graph": bf16_ms,
                             "speedup": bf16_ms / ms, "bytes": nb, "bf16_bytes": bb,
                             "gpu": torch.cuda.get_device_name(0)})
                log(f"  b={b} ctx={ctx:6d} bits={bits} k_group={kg:3d} ({keys}) v_group={vg:3d} {path:11s}: "
                    f"{1e3 * ms:7.1f} us (bf16 {1e3 * bf16_ms:.1f} us, {bf16_ms / ms:.2f}x)")
                del inputs
                torch.cuda.empty_cache()
        _write_json(out / "decode_groups.json", {"rows": rows, "command": "python -m benchmarks.groups"})


def main(argv=None) -> None:
    main_with_out(main_groups, __doc__, argv)


if __name__ == "__main__":
    main()
