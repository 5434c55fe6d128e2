"""The transposed-products probe (``kernels/bench/probe_swap.py``) computes the same attention as
the reference: its timings in ``artifacts/bench/probe_swap.json`` are of a correct kernel.

CPU interpreter at small shapes (the probe times on CUDA); tolerance rule of STYLE habit 2.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_setup import kernel_modules

DEVICE, INTERPRET, (da, probe) = kernel_modules("kvcalib_kernels.decode_attention", "kvcalib_kernels.bench.probe_swap")
from kvcalib.quant.uniform import quantize_keys, quantize_values  # noqa: E402
from kvcalib_kernels.reference import decode_attention_reference_in  # noqa: E402


@pytest.mark.parametrize("bits,v_swap,block_n,v_tok", [(2, False, 16, False), (2, True, 16, False), (4, False, 32, False),
                                                     (4, True, 16, False), (2, False, 16, True), (4, True, 32, True)],
                         ids=str)
def test_probe_matches_reference(bits, v_swap, block_n, v_tok):
    g = torch.Generator().manual_seed(bits)
    b, h, rep, d, n, group = 2, 2, 3, 64, 160, 32
    k = torch.randn(b, h, n, d, generator=g) * 2 + torch.randn(1, 1, 1, d, generator=g)
    v = torch.randn(b, h, n, d, generator=g)
    qk, qv = quantize_keys(k, bits, group), quantize_values(v, bits, group)
    packed = [t.to(DEVICE) for t in (qk.codes, qk.scale, qk.zero, qv.codes, qv.scale, qv.zero)]
    q = (torch.randn(b, h * rep, d, generator=g) * 1.5).half().to(DEVICE)
    kw = dict(k_bits=bits, v_bits=bits, k_group=group, v_group=group, scaling=d ** -0.5)
    truth = decode_attention_reference_in(torch.float64, q, *packed, **kw)
    same = decode_attention_reference_in(torch.float16, q, *packed, **kw)
    if v_tok:  # the token-word value layout (4 tokens of a byte column per word), plane-by-plane unpack
        packed[3] = probe.to_tok(packed[3], False)
    out = probe.swap_attention(q, *packed, bits=bits, k_group=group, v_group=group, scaling=d ** -0.5,
                               block_n=block_n, v_swap=v_swap, splits=3, v_tok=v_tok)
    err = float((out - truth).abs().max())
    assert err <= 2 * float((same - truth).abs().max()) + 1e-3, err
