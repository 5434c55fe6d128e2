#!/usr/bin/env bash
# Issue 50 on the GPU machine, one call: source scripts/device_env.sh first. Stages (default all):
#   ptx    experiments/ptx_same.py with the kernels tree of _ab_before/kernels (the commit before, made by
#          `git archive OLD kernels | tar -x -C _ab_before`) and with kernels/: same PTX for every old layout?
#   tests  the GPU kernel tests of every code width (3-bit cases of the full-size grid and configs, the lane probe)
#   grid   benchmarks/grid.py --rows widths: 2/3/4-bit Mistral-7B shape, batch 1/8, 4k/32k/128k, vs bf16 SDPA
# Results under $OUT (ptx_*.json, tests.log, decode_widths.json).
set -uo pipefail
OUT="${OUT:-$PWD/artifacts/bench/gpu_run}"
mkdir -p "$OUT"
KK=/tmp/kvcalib_kernels_path
stages="${*:-ptx tests grid}"
for stage in $stages; do
  case "$stage" in
    ptx)
      if [ -d _ab_before/kernels ]; then
        ln -sfn "$(realpath _ab_before/kernels)" "$KK/kvcalib_kernels"
        timeout 300 python3 -m experiments.ptx_same --out "$OUT/ptx_before.json" 2>&1 | tail -3
        ln -sfn "$(realpath kernels)" "$KK/kvcalib_kernels"
        timeout 300 python3 -m experiments.ptx_same --out "$OUT/ptx_after.json" --compare "$OUT/ptx_before.json" 2>&1 | tail -3
      fi ;;
    tests)
      timeout "${KV_TESTS_TIMEOUT:-400}" python3 -m pytest -q -p no:cacheprovider -x tests/kernels/test_lane_ptx.py \
        tests/kernels/test_decode_attention.py -k "${KV_TESTS_K:-three_bit or k3 or v3 or 3b or fast_unpack or lane}" \
        2>&1 | tee "$OUT/tests.log" | tail -15 ;;
    grid)
      timeout "${KV_GRID_TIMEOUT:-400}" python3 -m benchmarks.grid --rows widths --no-sweep --no-quant --tag widths \
        --out "$OUT" 2>&1 | tee "$OUT/grid.log" | grep -E "speedup|error|Error" | tail -20 ;;
  esac
done
