"""Why a code width runs at the speed it does: for the Mistral-7B shape (32/8 heads, head_dim 128,
groups 128) at batch 8 / 32k, per width and unpack, the plan the launcher picks, whether the lane
PTX was refused (and why), the compiled split kernel's registers and spills, and its CUDA-graph
time against bf16 SDPA's. Run with the kernels tree to probe first on the import path
(scripts/device_env.sh, ``KV_KERNELS``):

    python -m experiments.width_probe [--bits 2,3,4] [--unpacks default,6] [--batch 8] [--context 32768]
        [--configs "num_stages=1;block_n=32/num_stages=2"]

``--configs``: DecodeConfig fields per row (``;`` between rows, ``/`` between fields), in place of
``--unpacks`` (e.g. whether a width is bound by shared memory per program: fewer pipeline stages).
"""

from __future__ import annotations

import argparse
import json

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bits", default="2,3,4")
    ap.add_argument("--unpacks", default="default,6")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--label", default="")
    ap.add_argument("--configs", default=None, help="DecodeConfig fields per row: 'num_stages=1;block_n=32/num_stages=2'")
    ap.add_argument("--three-bit-bytes", type=int, default=None,
                    help="the unpack of 3-bit byte tiles for this run: 5 (PTX lanes) or 6 (Triton ops)")
    args = ap.parse_args()
    from benchmarks.common import WINDOW, _bench, _replay, bf16_variants, kernel_call, packed_inputs
    from kvcalib_kernels.decode import plan
    from kvcalib_kernels.decode_attention import DecodeConfig

    if args.three_bit_bytes is not None:
        plan.THREE_BIT_BYTE_LANES_MIN_D = 0 if args.three_bit_bytes == 5 else 1 << 30
        plan._plan.cache_clear()
    dev = torch.device("cuda")
    hq, h, d, g = 32, 8, 128, 128
    b, n = args.batch, args.context - WINDOW
    q = torch.randn(b, hq, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(b, h, args.context, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    bf16 = _bench(_replay(bf16_variants(q[:, :, None], k, v, d ** -0.5)["sdpa_enable_gqa"]))
    window = (k[:, :, n:].contiguous(), v[:, :, n:].contiguous())
    del k, v
    rows = []
    for bits in (int(x) for x in args.bits.split(",")):
        packed = packed_inputs(b, h, n, d, bits, g, g, dev)
        variants = args.configs.split(";") if args.configs else args.unpacks.split(",")
        for unpack in variants:
            if args.configs:  # "field=value/field=value"
                cfg = DecodeConfig(**{kk: (float(vv) if "." in vv else int(vv))
                                      for kk, vv in (f.split("=") for f in unpack.split("/") if f)})
            else:
                cfg = DecodeConfig() if unpack == "default" else DecodeConfig(unpack=int(unpack))
            plan._SPLIT.compiled.clear()
            fn = kernel_call(q, packed, window, bits, g, g, n, d ** -0.5, cfg)
            fn()
            torch.cuda.synchronize()
            ms = _bench(_replay(fn))
            kern = [kk for kk, _ in plan._SPLIT.compiled.values()]
            meta = plan._prepare(q, *packed, k_bits=bits, v_bits=bits, k_group=g, v_group=g, k_axis="channel",
                                 scaling=d ** -0.5, softcap=None, packed_start=None, packed_end=None,
                                 packed_position=0, fp_segments=[window], fp_positions=[n], mask=None,
                                 config=cfg).meta
            meta = plan.split_fields(meta) if hasattr(plan, "split_fields") else meta  # (older trees: named)
            row = {"label": args.label, "bits": bits, "unpack": unpack, "ms": round(ms, 5), "ms_bf16": round(bf16, 5),
                   "speedup": round(bf16 / ms, 3),
                   "regs": [getattr(kk, "n_regs", None) for kk in kern], "spills": [getattr(kk, "n_spills", None) for kk in kern],
                   "shared": [getattr(getattr(kk, "metadata", None), "shared", None) for kk in kern],
                   "k_unpack": meta["K_UNPACK"], "v_unpack": meta["V_UNPACK"], "v_units": meta["V_UNITS"],
                   "v_t": meta["V_T"], "block_n": meta["BLOCK_N"], "stages": meta["num_stages"],
                   "refused": {str(kk): vv[:300] for kk, vv in plan.LANES_REFUSED.items()}}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("width_probe " + args.label + ": " + "; ".join(f"{r['bits']}b/u{r['unpack']} {r['speedup']}x "
                                                         f"(k{r['k_unpack']} v{r['v_unpack']} units {r['v_units']} "
                                                         f"spills {r['spills']})" for r in rows))


if __name__ == "__main__":
    main()
