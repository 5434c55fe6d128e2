"""benchmarks/host.py's stage breakdown runs through the decode launcher's current code path.

``stages()`` times ``_prepare`` and each call ``_run`` makes, replayed with the arguments ``_run``
gave them; a change of the split kernel's signature once broke a hand-built copy of that argument
tuple (``TypeError: ... missing 'qk_scale', 'softcap', and 'H'``). Runs on CPU through Triton's
interpreter (``TRITON_INTERPRET=1``, set before any kernel module is imported) at a tiny shape,
and on CUDA as is.
"""

from __future__ import annotations

import math

import torch

from tests.kernels.triton_setup import kernel_modules

# the interpreter must be chosen before a @triton.jit function is defined
DEVICE, INTERPRET, (plan, combine, splits) = kernel_modules(
    "kvcalib_kernels.decode.plan", "kvcalib_kernels.decode.combine", "kvcalib_kernels.decode.splits")
from benchmarks import host  # noqa: E402
from benchmarks.common import packed_inputs  # noqa: E402

STAGES = {"prepare", "partials", "split_launch", "split_key", "combine", "empty"}


def test_stages_time_what_run_launches():
    dev = torch.device(DEVICE)
    b, h, hq, d, n, w = 1, 1, 2, 64, 128, 16  # one key group of 128 packed tokens, a 16-token window
    packed = packed_inputs(b, h, n, d, 2, 128, min(128, d), dev)
    window = (torch.randn(b, h, w, d, device=dev, dtype=torch.bfloat16),  # (B, H, W, D) K, V
              torch.randn(b, h, w, d, device=dev, dtype=torch.bfloat16))
    q = torch.randn(b, hq, d, device=dev, dtype=torch.bfloat16)  # (B, Hq, D)
    got = host.stages(q, packed, window, n, d, calls=2)
    assert set(got) == STAGES
    assert all(math.isfinite(v) and v > 0 for v in got.values()), got
    # the recording hooks are gone again: _run resolves the launcher's own objects
    assert isinstance(plan._SPLIT, plan.FastLauncher)
    assert plan._combine is combine._combine and plan._partials is splits._partials
