#!/usr/bin/env bash
# Reproduces the README's preset table on the two embedded models, held-out (BoolQ dev
# passages, never the calibration split). CPU only. SmolLM2-135M gets every metric (~40 min on
# 2 busy cores); Qwen2.5-Coder-0.5B gets perplexity only (the token-by-token reference decode of
# agreement/passkey is slow on CPU for a 0.5B model).
set -euo pipefail
presets=(--preset fp16 --preset kivi-4 --preset kivi-2 --preset pertoken-4)
if [ "${1:-all}" != "qwen" ]; then
  kvcalib eval --model smollm2-135m "${presets[@]}" \
    --metrics ppl,agreement,passkey --ppl-samples 8 --ppl-seq-len 1024 \
    --agreement-prompts 4 --agreement-tokens 32 --passkey-lengths 512,1024,2048 --passkey-trials 2 \
    --json artifacts/results/presets-smollm2-135m.json
fi
if [ "${1:-all}" != "smollm2" ]; then
  kvcalib eval --model qwen2.5-coder-0.5b "${presets[@]}" \
    --metrics ppl --ppl-samples 4 --ppl-seq-len 1024 \
    --json artifacts/results/presets-qwen2.5-coder-0.5b.json
fi
