"""FastLauncher: the key covers what triton specializes on; on CUDA, fast launches compute what
the JIT's launches compute (the CPU interpreter always takes the JIT's path)."""

from __future__ import annotations

import inspect

import pytest
import torch

from tests.kernels.triton_setup import kernel_modules

DEVICE, INTERPRET, (launch, da, plan, combine) = kernel_modules(
    "kvcalib_kernels.launch", "kvcalib_kernels.decode_attention", "kvcalib_kernels.decode.plan",
    "kvcalib_kernels.decode.combine")
from tests.kernels.test_decode_attention import make_case  # noqa: E402

requires_cuda = pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device (run through the device tool)")


class _Param:
    """What FastLauncher reads of triton's KernelParam."""

    def __init__(self, name, constexpr=False, dns=False, default=inspect.Parameter.empty):
        self.name, self.is_constexpr, self.do_not_specialize = name, constexpr, dns
        self.default, self.has_default = default, default is not inspect.Parameter.empty


class _Fn:
    params = [_Param("X"), _Param("stride"), _Param("N", dns=True), _Param("scale"), _Param("B", constexpr=True),
              _Param("FLAG", constexpr=True, default=False)]


def test_key_covers_specialization():
    fl = launch.FastLauncher(_Fn())
    x = torch.zeros(64, dtype=torch.float16)
    meta = {"B": 16, "num_warps": 4}

    def key(*args, **kw):
        return fl.key(args, {**meta, **kw})

    base = key(x, 64, 100, 0.5)
    assert key(x.clone(), 64, 100, 0.5) == base  # another tensor, same dtype and alignment
    assert key(x, 64, 7, 2.0) == base  # an unspecialized int and a float: their values do not matter
    assert key(x[1:], 64, 100, 0.5) != base  # misaligned pointer
    assert key(x.float(), 64, 100, 0.5) != base  # dtype
    assert key(x, 48, 100, 0.5) != base  # a specialized int: by value (48 vs 64 are both % 16)
    assert key(x, 64, 2 ** 31, 0.5) != base  # an unspecialized int past int32
    assert key(x, 64, 100, 0.5, B=32) != base  # constexprs
    assert key(x, 64, 100, 0.5, num_warps=8) != base  # launch options
    assert key(None, 64, 100, 0.5) != base
    assert fl.constexprs == [("B", None), ("FLAG", False)]
    assert fl.unspecialized == {2}


def test_interpreter_takes_the_jit_path():
    if not INTERPRET:
        pytest.skip("CUDA: the fast path is on")
    assert not plan._SPLIT.enabled and not combine._COMBINE.enabled


@requires_cuda
def test_fast_launches_match_the_jit():
    """A decode loop's calls (new query, growing window, another packed length, a misaligned
    query view) through the fast path give the JIT path's result bit for bit."""
    assert plan._SPLIT.enabled and combine._COMBINE.enabled
    cfg = da.DecodeConfig(block_n=16, fp_block=16)
    cases = [make_case(b=2, h=2, rep=4, d=64, n=n, f=(2, u), seed=s, k_bits=2, v_bits=4)
             for s, (n, u) in enumerate([(48, 5), (48, 6), (48, 7), (64, 3), (64, 9)])]
    fast_before = plan._SPLIT.fast_calls
    outs = []
    for args, kw in cases * 2:  # the second round: every key seen
        outs.append(da.decode_attention(*args, **kw, config=cfg))
    assert plan._SPLIT.fast_calls > fast_before
    for lf in (plan._SPLIT, combine._COMBINE):
        lf.enabled = False
    try:
        for (args, kw), out in zip(cases * 2, outs):
            assert torch.equal(da.decode_attention(*args, **kw, config=cfg), out)
        args, kw = cases[0]
        q = args[0]
        wide = torch.zeros(*q.shape[:2], q.shape[2] + 1, dtype=q.dtype, device=q.device)
        wide[..., 1:] = q
        jit_out = da.decode_attention(wide[..., 1:], *args[1:], **kw, config=cfg)
    finally:
        for lf in (plan._SPLIT, combine._COMBINE):
            lf.enabled = True
    for _ in range(2):  # misaligned query: its own key (a JIT launch, then fast), same result
        assert torch.equal(da.decode_attention(wide[..., 1:], *args[1:], **kw, config=cfg), jit_out)
