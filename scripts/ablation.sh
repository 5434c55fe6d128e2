#!/usr/bin/env bash
# Reproduces the README's calibration-method ablation (issue 4): for each embedded model, collect
# statistics on the calibration split, export recipes at K2V2 and K4V2 (group 32, window 128) with
# no method, each method alone and all together, then score held-out perplexity (evaluation split)
# for all of them on identical inputs. CPU is enough.
set -euo pipefail
stamp=$(date +%Y%m%d-%H%M%S)
for model in smollm2-135m qwen2.5-coder-0.5b; do
  run="artifacts/runs/ablation-$model-$stamp"
  kvcalib collect --model "$model" --samples 16 --seq-len 512 --out "$run" > /dev/null
  recipes=()
  for bits in k2v2 k4v2; do
    for methods in "" "--reorder" "--clip" "--center" "--reorder --clip --center"; do
      label=$(echo "$bits ${methods:-baseline}" | tr -d '-' | tr ' ' '_')
      # shellcheck disable=SC2086
      kvcalib export "$run" -o "$run/$label.safetensors" --bits "$bits" --group 32 --window 128 $methods --name "$label" > /dev/null
      recipes+=(--recipe "$run/$label.safetensors")
    done
  done
  kvcalib eval --model "$model" --preset fp16 "${recipes[@]}" --metrics ppl --ppl-samples 4 --ppl-seq-len 1024 \
    --json "artifacts/results/ablation-$model.json"
done
