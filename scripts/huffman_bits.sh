#!/usr/bin/env bash
# Huffman coding of the quantized cache (issue 7): bits per symbol on held-out text vs the
# calibration estimate, coded vs uncoded effective bits at context 4096, and drift during a
# 256-token greedy generation. Recipes (group 32, window 128): K2V2 and K4V2 plain and --reorder,
# K4V4 and K8V8 plain (wider codes are where min/max quantization leaves the most skew).
#
#   scripts/huffman_bits.sh [MODEL]        MODEL: smollm2-135m (default) or qwen2.5-coder-0.5b
#   RUN=artifacts/runs/<collect run> scripts/huffman_bits.sh MODEL   reuse collected statistics
#
# Writes artifacts/results/huffman-MODEL.json and .md; the exported recipes and the same recipes
# with codebooks (<label>-huffman.safetensors) go to a new folder artifacts/runs/huffman-MODEL-<stamp>.
# CPU is enough (smollm2-135m: about 2 minutes with one thread, after collection).
set -euo pipefail
model="${1:-smollm2-135m}"
stamp=$(date +%Y%m%d-%H%M%S)
out="artifacts/runs/huffman-$model-$stamp"
run="${RUN:-$out}"
if [ -z "${RUN:-}" ]; then
  kvcalib collect --model "$model" --samples 16 --seq-len 512 --out "$run" > /dev/null
else
  mkdir -p "$out"
fi
recipes=()
for bits in k2v2 k4v2 k4v4 k8v8; do
  variants=("" "--reorder")
  case "$bits" in k4v4|k8v8) variants=("") ;; esac  # wider codes: the baseline only
  for methods in "${variants[@]}"; do
    label=$(echo "$bits ${methods:-baseline}" | tr -d '-' | tr ' ' '_')
    # shellcheck disable=SC2086
    kvcalib export "$run" -o "$out/$label.safetensors" --bits "$bits" --group 32 --window 128 $methods --name "$label" > /dev/null
    recipes+=("$out/$label.safetensors")
  done
done
python - "$model" "$run" "$out" "${recipes[@]}" <<'PY'
import sys

from benchmarks.huffman_bits import EntropyConfig, huffman_report

model, run, out, *recipes = sys.argv[1:]
huffman_report(model, run, recipes, f"artifacts/results/huffman-{model}.json", f"artifacts/results/huffman-{model}.md",
               EntropyConfig(samples=4, seq_len=1024, context=4096, drift_prompt_len=256, drift_new_tokens=256,
                             drift_window=64, sweep_tokens_per_stream=(4, 32)), recipes_out=out)
print(open(f"artifacts/results/huffman-{model}.md").read())
PY
