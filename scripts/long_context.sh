#!/usr/bin/env bash
# Long-context recipes and their proof, for one model (issue 33):
#
#   bash scripts/long_context.sh MODEL CONTEXT "EVAL CONTEXTS" [BUDGETS]
#   e.g. bash scripts/long_context.sh smollm2-135m 8192 "4096 8192" "3.0 4.0"
#        bash scripts/long_context.sh qwen2.5-coder-0.5b 16384 "16384 32768" "3.0 4.0"
#
# 1. statistics on the long calibration text (--data longtext, split calib: Milton), once;
# 2. per budget, `kvcalib search` scoring CONTEXT-token windows whose last SCORE_LAST tokens are
#    decode steps after a compressed prompt (--score-seq-len / --score-last), effective bits
#    counted at CONTEXT; the chosen recipe, report and plots are copied to
#    recipes/MODEL/long-CONTEXT-Bb/;
# 3. benchmarks/long_context.py: held-out perplexity with its 95% interval, copy and passkey at each
#    EVAL CONTEXT on both held-out texts (the Britannica article and the plays, never calibrated on),
#    full precision beside KIVI-2, KIVI-4 and the searched recipes, into
#    artifacts/results/long_context.{json,md} and a PNG per context.
# Env: TRIALS (30), SCORE_LAST (CONTEXT/8), SCORE_SAMPLES (2), COLLECT_LEN (2048), SAMPLES (8),
# PPL_SAMPLES (8 windows a text: an interval needs them; 2 until issue 51), PASSKEY_TRIALS (4 a depth, 20 in all), RUNS (artifacts/runs/long-MODEL-CONTEXT), KVCALIB (the command:
# default `kvcalib`, or `python3 -m kvcalib.cli` where it is not installed), SEARCH_ARGS (more options
# for `kvcalib search`, e.g. "--timeout 300"), TAG (appended to the recipe folder's name, e.g. "-rot" for a
# search with another --space, so the committed recipes stay until the new ones are proven). A GPU makes it minutes. Steps already done in RUNS are
# skipped, so the script can go on in a later call; an empty "EVAL CONTEXTS" stops after the searches.
set -euo pipefail
MODEL=$1; CTX=$2; EVAL_CTXS=$3; BUDGETS=${4:-"3.0 4.0"}
TRIALS=${TRIALS:-30}; SCORE_LAST=${SCORE_LAST:-$((CTX / 8))}; SCORE_SAMPLES=${SCORE_SAMPLES:-2}
COLLECT_LEN=${COLLECT_LEN:-2048}; SAMPLES=${SAMPLES:-8}; PPL_SAMPLES=${PPL_SAMPLES:-8}
PASSKEY_TRIALS=${PASSKEY_TRIALS:-4}; RUNS=${RUNS:-artifacts/runs/long-$MODEL-$CTX}
KVCALIB=${KVCALIB:-kvcalib}; PY=${PY:-python3}
mkdir -p "$RUNS"
if [ ! -f "$RUNS/stats/stats.safetensors" ]; then
  $KVCALIB collect --model "$MODEL" --data longtext --samples "$SAMPLES" --seq-len "$COLLECT_LEN" --out "$RUNS/stats"
fi
recipes=(--recipe kivi-2 --recipe kivi-4)
for B in $BUDGETS; do
  run="$RUNS/search-$B"; dest="recipes/$MODEL/long-$CTX-${B}b${TAG:-}"
  if [ ! -f "$run/recipe.safetensors" ]; then
    mkdir -p "$run" && cp "$RUNS/stats/stats.safetensors" "$RUNS/stats/run.json" "$run/"
    $KVCALIB search --model "$MODEL" --data longtext --out "$run" --budget-bits "$B" --context "$CTX" \
      --samples "$SAMPLES" --seq-len "$COLLECT_LEN" --score-seq-len "$CTX" --score-last "$SCORE_LAST" \
      --score-samples "$SCORE_SAMPLES" --trials "$TRIALS" --eval-seq-len "$CTX" --eval-samples "$PPL_SAMPLES" \
      ${SEARCH_ARGS:-}
  fi
  if [ -f "$run/recipe.safetensors" ]; then
    mkdir -p "$dest" && cp "$run"/recipe.safetensors "$run"/report.md "$run"/search.json "$run"/*.png "$dest/"
    recipes+=(--recipe "$dest/recipe.safetensors")
  fi
done
[ -n "${EVAL_CTXS// }" ] || exit 0
ctx_args=(); for c in $EVAL_CTXS; do ctx_args+=(--context "$c"); done
$PY benchmarks/long_context.py --model "$MODEL" "${ctx_args[@]}" "${recipes[@]}" --ppl-samples "$PPL_SAMPLES" \
  --passkey-trials "$PASSKEY_TRIALS"
