#!/usr/bin/env bash
# Reproduces the README's preset table: the four presets on the two embedded models,
# held-out (BoolQ dev passages, never the calibration split). CPU is enough (~15-30 min).
set -euo pipefail
for model in smollm2-135m qwen2.5-coder-0.5b; do
  kvcalib eval --model "$model" --preset fp16 --preset kivi-4 --preset kivi-2 --preset pertoken-4 \
    --metrics ppl,agreement,passkey --ppl-samples 8 --ppl-seq-len 1024 \
    --agreement-prompts 4 --agreement-tokens 32 --passkey-lengths 1024 --passkey-trials 2 \
    --json "artifacts/results/presets-$model.json"
done
