#!/usr/bin/env bash
# Reproduces the README's calibration-method ablation (issue 4): for each embedded model, collect
# statistics on the calibration split, export recipes at K2V2 and K4V2 (group 32, window 128) with
# no method, each method alone and all together, then score held-out perplexity (evaluation split)
# for all of them on identical inputs. CPU is enough.
#
# Methods: SKVQ reordering and clipping, TaDA centering, OTT outlier pools (--outliers 3: pools
# where tracing cuts the key error on the statistics, 0 elsewhere) and PATS tiers
# (--schedule middle-heavy: 4 sinks, then the bits halve with age). The schedule's ages are 256
# and 512 tokens here, not the 1024/4096 default, so that tiers change inside the 1024-token
# perplexity windows: with the default ages no block would be requantized within 1024 tokens while
# the effective bits (accounted at 4096) would already count the tiers. At k2v2 no lower tier
# exists, so the schedule row there measures the sinks alone.
set -euo pipefail
stamp=$(date +%Y%m%d-%H%M%S)
pats="--schedule middle-heavy --schedule-ages 256,512"
rows=(
  "baseline:"
  "reorder:--reorder"
  "clip:--clip"
  "center:--center"
  "outliers:--outliers 3"
  "schedule:$pats"
  "all:--reorder --clip --center --outliers 3 $pats"
)
for model in smollm2-135m qwen2.5-coder-0.5b; do
  run="artifacts/runs/ablation-$model-$stamp"
  kvcalib collect --model "$model" --samples 16 --seq-len 512 --out "$run" > /dev/null
  recipes=()
  for bits in k2v2 k4v2; do
    for row in "${rows[@]}"; do
      label="${bits}_${row%%:*}"
      methods="${row#*:}"
      # shellcheck disable=SC2086
      kvcalib export "$run" -o "$run/$label.safetensors" --bits "$bits" --group 32 --window 128 $methods --name "$label" > /dev/null
      recipes+=(--recipe "$run/$label.safetensors")
    done
  done
  kvcalib eval --model "$model" --preset fp16 "${recipes[@]}" --metrics ppl --ppl-samples 4 --ppl-seq-len 1024 \
    --json "artifacts/results/ablation-$model.json"
done
