#!/usr/bin/env bash
# The one script sent to the GPU machine (device tool `run`): kernel tests on CUDA and the
# benchmarks of benchmarks/ (one script per question; `python -m benchmarks.report` makes the
# tables from their JSON). Run from the repository root:
#
#   bash scripts/gpu_bench.sh [STAGE ...]       (default: tests micro)
#
# Stages: tests       pytest tests/kernels on CUDA (small grid + the `gpu`-marked full grid);
#                     $KV_TESTS_PATH: other paths/options, $KV_TESTS_K: a -k expression
#         micro       benchmarks/grid.py: config sweep, grid, quantize vs prefill
#         micro-nosweep   the grid with configs from $KV_CONFIG (JSON), no sweep
#         micro-default   the grid with DecodeConfig's defaults, no sweep
#         ab          the grid's A/B rows (3 shapes, batch 1/8, 4k/32k, 2/4 bits, groups 128/32) twice:
#                     with the kernels tree $KV_BEFORE (e.g. an older commit's kernels/, extracted by
#                     `git archive OLD kernels | tar -x -C _ab_before` before the run), then with
#                     $KV_KERNELS (default kernels/); decode_attention_{before,after}.json and
#                     decode_ab.md (benchmarks/report.py --compare)
#         tests-gpu   only the `gpu`-marked tests
#         combine     benchmarks/combine.py: the split merge alone, the launcher's choice vs 27 others
#         profile-calls  experiments/profile_calls.py: per-kernel GPU time of one call at batch $BATCH (split,
#                     merge) beside bf16 SDPA's kernels ($MODELS, $CTXS, $CFGS)
#         ncu         experiments/profile_ncu.py under Nsight Compute: the split kernel's sections and
#                     SASS-level stall counters ($NCU_CASES; ncu_split.json; KV_NCU_KEEP=1: the report too)
#         latency     benchmarks/latency.py: GPU time (CUDA-graph replay) vs host time per call, small shapes
#         splits      split-K parallelism sweep at batch 1/8 (CUDA-graph time); $KV_MODEL: another shape
#         tune        tile / stages / unpack sweep at batch 1/8 (CUDA-graph time)
#         sweep       benchmarks/sweep.py with the arguments in $KV_SWEEP_ARGS; several sweeps
#                     separated by ';' (e.g. "--name stages --layouts 2/128/128 --configs '[{}, {\"num_stages\": 3}]'")
#         fitted      benchmarks/fitted.py: cost of SKVQ permutations / TaDA means / OTT / PATS (CUDA-graph time)
#         quantizers-smol / quantizers-qwen   benchmarks/quantizers.py: issue 34's ablation (rotation,
#                     levels, pre-RoPE keys, error-bounded codes + Huffman) at 8k (SmolLM2) / 16k (Qwen)
#         groups      benchmarks/groups.py: cost of key / value groups of 32 and 16
#         accuracy    benchmarks/accuracy.py: the kernel's error vs the float32 reference on
#                     outlier-channel keys, beside PyTorch's float16 / bfloat16 (accuracy.json)
#         host        benchmarks/host.py: host time per attention call and eager vs graph decode
#                     steps at batch 1 (random-weight models of the three shapes)
#         profile     experiments/profile_step.py: the kernels of a CUDA-graph decode step (Mistral-7B and
#                     Gemma-3-1B shapes, 32k, batch 1/8)
#         e2e-smoke   end-to-end on a small random model (checks the path, seconds)
#         e2e         end-to-end, random-weight Mistral-7B shape at 32k context
#         e2e-pats    the same, CUDA-graph decoding of a PATS middle-heavy cache beside plain 2-bit
#         e2e-sliding random-weight Gemma-3-1B shape (sliding-window layers) at 32k: bf16, kvcalib with its
#                     sliding layers on the reference vs on the kernel, CUDA graphs (batches $KV_E2E_BATCHES)
# Everything is written under $OUT (the device tool returns it); each stage has a time limit so
# the files of the earlier stages come back even if a later one runs long. Then, for the tables:
# python -m benchmarks.report --out DIR (runs anywhere).
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 KVCALIB_QUIET=1
OUT="${OUT:-$PWD/artifacts/bench/gpu_run}"
mkdir -p "$OUT"
# not installed there: kvcalib imports from the repo root, kvcalib_kernels is kernels/ under its install name
# ($KV_KERNELS: another kernels/ tree to import instead, e.g. an older commit's:
#  git archive OLD kernels | tar -x -C _old && KV_KERNELS=_old/kernels bash scripts/gpu_bench.sh sweep)
KK=/tmp/kvcalib_kernels_path
use_kernels() { mkdir -p "$KK" && ln -sfn "$(realpath "$1")" "$KK/kvcalib_kernels"; }
use_kernels "${KV_KERNELS:-kernels}"
export PYTHONPATH="$PWD:$KK${PYTHONPATH:+:$PYTHONPATH}"
# ... and kvcalib.presets is recipes/presets (pyproject's package-dir): link it for this run only
if [ ! -e kvcalib/presets ]; then
  ln -s ../recipes/presets kvcalib/presets && trap 'rm -f kvcalib/presets' EXIT
fi
PY=python3
STAGES="${*:-tests micro}"
T0=$(date +%s)
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  $PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name(0))"
  $PY -c "import xdist" 2>/dev/null && echo "pytest-xdist: yes" || echo "pytest-xdist: no"
} 2>&1 | tee "$OUT/env.log"
XDIST=""
$PY -c "import xdist" 2>/dev/null && XDIST="-n 8"
for st in $STAGES; do
  echo "=== stage $st at +$(( $(date +%s) - T0 )) s"
  case "$st" in
    tests)
      timeout "${KV_TESTS_TIMEOUT:-200}" $PY -m pytest -q -p no:cacheprovider $XDIST --maxfail=30 -rfE \
        ${KV_TESTS_K:+-k "$KV_TESTS_K"} ${KV_TESTS_PATH:-tests/kernels} > "$OUT/tests.log" 2>&1
      echo "tests exit $?"; tail -n 30 "$OUT/tests.log" ;;
    micro)
      timeout "${KV_MICRO_TIMEOUT:-330}" $PY -m benchmarks.grid --out "$OUT" > "$OUT/bench.log" 2>&1
      echo "micro exit $?"; grep -E "^(device|  best|sweep|grid|  quantize)" "$OUT/bench.log"; tail -n 45 "$OUT/bench.log" ;;
    micro-nosweep)
      timeout "${KV_MICRO_TIMEOUT:-330}" $PY -m benchmarks.grid --config "${KV_CONFIG}" --out "$OUT" > "$OUT/bench.log" 2>&1
      echo "micro exit $?"; tail -n 45 "$OUT/bench.log" ;;
    micro-default)
      timeout "${KV_MICRO_TIMEOUT:-330}" $PY -m benchmarks.grid --no-sweep --out "$OUT" > "$OUT/bench.log" 2>&1
      echo "micro exit $?"; tail -n 45 "$OUT/bench.log" ;;
    ab)
      before="${KV_BEFORE:?KV_BEFORE: the kernels/ tree to compare against (see the stage list)}"
      for side in before after; do
        tree="${KV_KERNELS:-kernels}"; [ "$side" = before ] && tree="$before"
        use_kernels "$tree"
        KV_KERNELS_LABEL="$side: $tree" timeout "${KV_AB_TIMEOUT:-170}" $PY -m benchmarks.grid --rows ab --tag "$side" \
          --no-sweep --no-quant --bf16 sdpa_enable_gqa --out "$OUT" > "$OUT/ab_$side.log" 2>&1
        echo "ab $side ($tree) exit $? at +$(( $(date +%s) - T0 )) s"; tail -n 3 "$OUT/ab_$side.log"
      done
      use_kernels "${KV_KERNELS:-kernels}"
      $PY -m benchmarks.report --compare "$OUT/decode_attention_before.json" "$OUT/decode_attention_after.json" ;;
    tests-gpu)
      timeout "${KV_TESTS_TIMEOUT:-200}" $PY -m pytest -q -p no:cacheprovider $XDIST --maxfail=30 -rfE -m gpu tests/kernels \
        > "$OUT/tests.log" 2>&1
      echo "tests exit $?"; tail -n 5 "$OUT/tests.log" ;;
    combine)
      timeout "${KV_COMBINE_TIMEOUT:-200}" $PY -m benchmarks.combine --out "$OUT" > "$OUT/combine.log" 2>&1
      echo "combine exit $?"; tail -n 17 "$OUT/combine.log" ;;
    profile-calls)
      OUT="$OUT" timeout "${KV_PROFILE_TIMEOUT:-200}" $PY -m experiments.profile_calls > "$OUT/profile_calls.log" 2>&1
      echo "profile-calls exit $?"; grep -v -i warn "$OUT/profile_calls.log" | tail -n 12 ;;
    ncu)
      NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
      timeout "${KV_NCU_TIMEOUT:-300}" "$NCU" --profile-from-start off -k regex:_decode_split_kernel --set full \
        --import-source no --clock-control none -f -o "$OUT/ncu_split" $PY -m experiments.profile_ncu \
        > "$OUT/ncu.log" 2>&1
      echo "ncu exit $?"; tail -n 5 "$OUT/ncu.log"
      "$NCU" -i "$OUT/ncu_split.ncu-rep" --page details > "$OUT/ncu_details.txt" 2>&1
      "$NCU" -i "$OUT/ncu_split.ncu-rep" --page raw --csv > "$OUT/ncu_raw.csv" 2>&1
      "$NCU" -i "$OUT/ncu_split.ncu-rep" --page source --print-source sass --csv > "$OUT/ncu_source.csv" 2>&1
      $PY -m experiments.profile_ncu --summarize "$OUT" | tail -n 4
      # the report and its exports are large: kept only with KV_NCU_KEEP=1 (ncu_split.json summarizes them)
      [ "${KV_NCU_KEEP:-0}" = 1 ] || rm -f "$OUT/ncu_split.ncu-rep" "$OUT/ncu_raw.csv" "$OUT/ncu_source.csv" \
        "$OUT/ncu_details.txt" "$OUT/ncu.log" ;;
    latency)
      timeout "${KV_LAT_TIMEOUT:-150}" $PY -m benchmarks.latency --mode latency ${KV_CONFIG:+--config "$KV_CONFIG"} \
        --out "$OUT" >> "$OUT/bench.log" 2>&1
      echo "latency exit $?"; grep -E "ours do_bench" "$OUT/bench.log" | tail -n 12 ;;
    splits)
      timeout "${KV_SPLITS_TIMEOUT:-200}" $PY -m benchmarks.latency --mode splits ${KV_MODEL:+--model "$KV_MODEL"} \
        --out "$OUT" > "$OUT/splits.log" 2>&1
      echo "splits exit $?"; grep -E "^  b=" "$OUT/splits.log" ;;
    tune)
      timeout "${KV_TUNE_TIMEOUT:-240}" $PY -m benchmarks.latency --mode tune --out "$OUT" > "$OUT/tune.log" 2>&1
      echo "tune exit $?"; grep -E "^  b=|failed" "$OUT/tune.log" ;;
    profile)
      OUT="$OUT" timeout "${KV_PROFILE_TIMEOUT:-560}" $PY -m experiments.profile_step > "$OUT/profile.log" 2>&1
      echo "profile exit $?"; grep -v Warning "$OUT/profile.log" | tail -n 30 ;;
    sweep)
      IFS=';' read -ra SWEEPS <<< "${KV_SWEEP_ARGS:?KV_SWEEP_ARGS: the sweep arguments}"
      for sw in "${SWEEPS[@]}"; do
        eval "timeout \"\${KV_SWEEP_TIMEOUT:-200}\" $PY -m benchmarks.sweep $sw --out \"\$OUT\"" \
          >> "$OUT/sweep.log" 2>&1
        echo "sweep exit $?"
      done
      grep -E "^  b=|failed" "$OUT/sweep.log" ;;
    fitted)
      timeout "${KV_FITTED_TIMEOUT:-200}" $PY -m benchmarks.fitted --out "$OUT" > "$OUT/fitted.log" 2>&1
      echo "fitted exit $?"; grep -E "^  b=|Error" "$OUT/fitted.log" ;;
    quantizers-smol|quantizers-qwen)
      # issue 34's ablation at long context (benchmarks/quantizers.py): SmolLM2 at 8k, Qwen2.5-Coder-0.5B
      # at 16k; rows merge into $OUT/quantizers.json (copy them into artifacts/results/quantizers.json)
      if [ "$st" = quantizers-smol ]; then qm=smollm2-135m; qc=8192; else qm=qwen2.5-coder-0.5b; qc=16384; fi
      timeout "${KV_QUANTIZERS_TIMEOUT:-580}" $PY benchmarks/quantizers.py --model "$qm" --context "$qc" \
        --ppl-samples "${KV_QUANTIZERS_SAMPLES:-4}" --device cuda --out "$OUT/quantizers.json" > "$OUT/$st.log" 2>&1
      echo "$st exit $?"; grep -E "bits  ppl|Error" "$OUT/$st.log" ;;
    groups)
      timeout "${KV_GROUPS_TIMEOUT:-420}" $PY -m benchmarks.groups --out "$OUT" > "$OUT/groups.log" 2>&1
      echo "groups exit $?"; grep -E "^  b=|Error" "$OUT/groups.log" ;;
    accuracy)
      timeout "${KV_ACC_TIMEOUT:-150}" $PY -m benchmarks.accuracy --out "$OUT" > "$OUT/accuracy.log" 2>&1
      echo "accuracy exit $?"; tail -n 3 "$OUT/accuracy.log" ;;
    e2e-smoke)
      timeout "${KV_E2E_TIMEOUT:-90}" $PY -m benchmarks.e2e --quick --steps 6 --batches-bf16 2 \
        --batches-packed 2 --out "$OUT/smoke" > "$OUT/e2e_smoke.log" 2>&1
      echo "e2e-smoke exit $?"; tail -n 12 "$OUT/e2e_smoke.log" ;;
    host)
      timeout "${KV_HOST_TIMEOUT:-300}" $PY -m benchmarks.host --out "$OUT" --steps "${KV_HOST_STEPS:-30}" \
        > "$OUT/host.log" 2>&1
      echo "host exit $?"; tail -n 12 "$OUT/host.log" ;;
    e2e)
      timeout "${KV_E2E_TIMEOUT:-300}" $PY -m benchmarks.e2e --steps "${KV_E2E_STEPS:-140}" \
        --batches-bf16 8 --batches-packed 8 32 ${KV_E2E_ARGS:-} --out "$OUT" > "$OUT/e2e.log" 2>&1
      echo "e2e exit $?"; tail -n 12 "$OUT/e2e.log" ;;
    e2e-pats)
      timeout "${KV_E2E_TIMEOUT:-300}" $PY -m benchmarks.e2e --pats --steps "${KV_E2E_STEPS:-140}" \
        --batches-bf16 --batches-packed ${KV_E2E_BATCHES:-8} --out "$OUT" > "$OUT/e2e_pats.log" 2>&1
      echo "e2e-pats exit $?"; tail -n 8 "$OUT/e2e_pats.log" ;;
    e2e-sliding)
      timeout "${KV_E2E_TIMEOUT:-300}" $PY -m benchmarks.e2e --sliding --steps "${KV_E2E_STEPS:-40}" \
        --batches-packed ${KV_E2E_BATCHES:-1 8} --out "$OUT" > "$OUT/e2e_sliding.log" 2>&1
      echo "e2e-sliding exit $?"; tail -n 10 "$OUT/e2e_sliding.log" ;;
    probe-swap|probe-vlayout)
      echo "stage $st: the transposed-products probe was removed; its findings are in artifacts/bench/HISTORY.md" ;;
    *) echo "unknown stage $st" ;;
  esac
done
echo "=== done at +$(( $(date +%s) - T0 )) s"
