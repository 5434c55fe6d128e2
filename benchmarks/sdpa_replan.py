"""Probe: does SDPA re-plan for every new key length? (the bf16 baseline of eager decode steps)

On torch 2.11 with cuDNN 9.19 (H100, 2026-11-26) a bf16 decode step over a growing
``DynamicCache`` called without a mask took ~40 ms in SDPA: the default backend choice takes cuDNN
attention, which builds a plan per new key length. This prints host+GPU microseconds per call
(synchronised over 100 calls) of: a DynamicCache update; SDPA over a fixed key length; SDPA over a
length that grows by one each call (enable_gqa, and GQA packed as query rows); and the same with
each backend forced. Mistral-7B attention shape, batch 1, 4k context.

    python -m benchmarks.sdpa_replan
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def per_call_us(fn, n: int = 100) -> float:
    """Microseconds per call of ``fn(i)`` (i = 1..n), synchronised before and after."""
    fn(0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(n):
        fn(i + 1)
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - t0) / n


def main() -> None:
    from transformers import DynamicCache

    dev = "cuda"
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name(0)}")
    k = torch.randn(1, 8, 4096, 128, device=dev, dtype=torch.bfloat16)  # (B, H, T, D)
    q = torch.randn(1, 32, 1, 128, device=dev, dtype=torch.bfloat16)  # (B, Hq, 1, D)
    qg = q.reshape(1, 8, 4, 128)  # the 4 query heads of a kv head as query rows
    one = k[:, :, :1].clone()  # (B, H, 1, D)
    kk = torch.randn(1, 8, 6000, 128, device=dev, dtype=torch.bfloat16)  # (B, H, 6000, D)
    cache = DynamicCache()
    cache.update(k.clone(), k.clone(), 0)
    rows = {
        "DynamicCache update": lambda i: cache.update(one, one, 0),
        "SDPA, fixed key length": lambda i: F.scaled_dot_product_attention(q, kk[:, :, :5000], kk[:, :, :5000],
                                                                          enable_gqa=True),
        # lengths 4096.. 4196 from here: a backend that caches plans per length pays once per length
        "SDPA, growing key length (enable_gqa)": lambda i: F.scaled_dot_product_attention(
            q, kk[:, :, :4096 + i], kk[:, :, :4096 + i], enable_gqa=True),
        "SDPA, growing key length (rows)": lambda i: F.scaled_dot_product_attention(
            qg, kk[:, :, :4200 + i], kk[:, :, :4200 + i]),
    }
    for name, us in ((n, per_call_us(f)) for n, f in rows.items()):
        print(f"{name:45s} {us:10.1f} us/call")
    for idx, backend in enumerate((SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                   SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH)):
        def forced(i, backend=backend, base=4400 + 300 * idx):  # lengths no call has seen
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(qg, kk[:, :, :base + i], kk[:, :, :base + i])
        try:
            print(f"{'SDPA, growing, forced ' + backend.name:45s} {per_call_us(forced):10.1f} us/call")
        except RuntimeError as err:
            print(f"SDPA forced {backend.name}: not available ({str(err)[:80]})")


if __name__ == "__main__":
    main()
