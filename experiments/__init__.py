"""One-off probes and profilers of the decode kernel (not installed; GPU or offline compile),
kept because their commands are quoted in ``artifacts/bench/HISTORY.md``. Run from the
repository root: ``python -m experiments.NAME`` (``scripts/gpu_bench.sh`` stages ``profile-calls``,
``profile`` and ``ncu`` do).

- :mod:`.compile_sm90`: the split kernel compiled for sm_90 offline: SASS instruction mix, registers.
- :mod:`.profile_calls`: per-kernel GPU time of one call (split kernel, merge) beside bf16 SDPA's.
- :mod:`.profile_step`: the kernels of a CUDA-graph decode step.
- :mod:`.profile_ncu`: the split kernel under Nsight Compute (stall reasons per SASS instruction).
- :mod:`.head_sensitivity`: per-head KV sensitivity of a real model (issue 53): one kv head's K or V
  quantized, the rest full precision; KL, perplexity and copy damage per (layer, head, side).
- :mod:`.probe_fp8_dot`: which MMA Triton emits for a float8 ``tl.dot`` on sm_90.
"""
