"""Accuracy of the fused decode kernel on keys with outlier channels, against the float32
reference and against the same attention computed by PyTorch in float16 and bfloat16.

Data: :func:`draw_kv` (Laplace keys
with per-channel location and spread, every 32nd channel 4x wider; Gaussian values), quantized
per channel (keys) / per token (values) in groups of 128; Mistral-7B shape, batch 1, 32k context
(the last 128 tokens a bf16 window). Each row: the largest absolute error of the kernel (default
``DecodeConfig``) and of ``decode_attention_reference_in`` in float16 / bfloat16, all against
``decode_attention_reference_in`` in float32 on the same packed values, and the largest output
magnitude.

    python -m benchmarks.accuracy --out DIR      (CUDA, repository root; writes DIR/accuracy.json)
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

GROUP = 128  # tokens per key group, channels per value group


def draw_kv(b, h, t, d, dev, seed):
    """(K, V) float32 (B, H, T, D): keys Laplace with per-channel location/spread (a few outlier
    channels, as real keys have), values Gaussian."""
    g = torch.Generator(device=dev).manual_seed(seed)
    loc = torch.randn(1, h, 1, d, device=dev, generator=g) * 2
    spread = torch.exp(torch.randn(1, h, 1, d, device=dev, generator=g) * 0.5)
    spread[..., :: d // 4] *= 4  # outlier channels
    u = torch.rand(b, h, t, d, device=dev, generator=g) - 0.5
    k = loc - spread * u.sign() * torch.log1p(-2 * u.abs().clamp(max=0.4999999))
    v = torch.randn(b, h, t, d, device=dev, generator=g)
    return k, v


def quantize(k, v, bits):
    from kvcalib.quant.uniform import quantize_keys, quantize_values

    return quantize_keys(k, bits, GROUP), quantize_values(v, bits, min(GROUP, k.shape[-1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for accuracy.json")
    ap.add_argument("--context", type=int, default=32768)
    args = ap.parse_args()
    from kvcalib_kernels.decode_attention import decode_attention
    from kvcalib_kernels.reference import decode_attention_reference_in

    dev = torch.device("cuda")
    b, h, hq, d, window = 1, 8, 32, 128, 128
    n = args.context - window
    g = torch.Generator(device=dev).manual_seed(1)
    q = torch.randn(b, hq, d, device=dev, generator=g).to(torch.bfloat16)  # (B, Hq, D)
    win = (torch.randn(b, h, window, d, device=dev, generator=g).to(torch.bfloat16),  # (B, H, W, D) x 2
           torch.randn(b, h, window, d, device=dev, generator=g).to(torch.bfloat16))
    rows = []
    for bits in (2, 4):
        k, v = draw_kv(b, h, n, d, dev, seed=bits)  # (B, H, N, D) float32 each
        qk, qv = quantize(k, v, bits)
        del k, v
        packed = (q, qk.codes, qk.scale, qk.zero, qv.codes, qv.scale, qv.zero)
        kw = dict(k_bits=bits, v_bits=bits, k_group=GROUP, v_group=GROUP, scaling=d ** -0.5,
                  fp_segments=[win], fp_positions=[n])
        ref = decode_attention_reference_in(torch.float32, *packed, **kw).float()  # (B, Hq, D)
        err = {name: float((out.float() - ref).abs().max()) for name, out in (
            ("kernel", decode_attention(*packed, **kw)),
            ("torch_float16", decode_attention_reference_in(torch.float16, *packed, **kw)),
            ("torch_bfloat16", decode_attention_reference_in(torch.bfloat16, *packed, **kw)))}
        rows.append({"bits": bits, "batch": b, "context": args.context, "group": GROUP,
                     "max_abs_output": float(ref.abs().max()), **{f"max_abs_err_{k}": v for k, v in err.items()}})
        print(f"{bits}-bit: |out| <= {rows[-1]['max_abs_output']:.3f}; max error vs float32 reference: kernel "
              f"{err['kernel']:.5f}, torch float16 {err['torch_float16']:.5f}, torch bfloat16 {err['torch_bfloat16']:.5f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"gpu": torch.cuda.get_device_name(0), "command": "python -m benchmarks.accuracy --out DIR",
           "rows": rows}
    tmp = out / "accuracy.json.tmp"
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(out / "accuracy.json")


if __name__ == "__main__":
    main()
