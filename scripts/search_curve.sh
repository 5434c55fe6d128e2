#!/usr/bin/env bash
# Issue 5's curve benchmark: searched recipes at several memory budgets against the presets, on
# held-out perplexity. For MODEL (an embedded alias: smollm2-135m, qwen2.5-coder-0.5b, gemma3-270m):
#
#   Effective bits count the tokens each layer holds (a sliding-window layer its window), so bf16
#   is 16 and a budget B is 16/B times smaller than the model's bf16 cache on every model; the
#   report compares each searched point with a preset only at the same or more bits (a cheaper
#   preset is "not comparable (fewer bits)").
#
#   1. budgets: KIVI-2's and KIVI-4's effective bits exactly, per-token-4's, 3.0, 4.0 and just
#      above the floor of the search space (python -m benchmarks.search_curve plan);
#   2. statistics collected once on the embedded calibration text, then one `kvcalib search
#      --budget-bits B` per budget (constrained: a search spends its trials at its budget;
#      scripts/search_front.py compares this with one --objective pareto study), each chosen
#      point exported with `kvcalib export --budget-bits B`;
#   3. one `kvcalib eval --metrics ppl` over every exported point and the presets fp16, kivi-2,
#      kivi-4, pertoken-4 on identical held-out inputs (evaluation split), with the perplexity
#      settings of scripts/preset_table.sh (SmolLM2 8 x 1024 tokens, others 4 x 1024);
#   4. artifacts/results/search-curve-MODEL.{json,png,md} (python -m benchmarks.search_curve report).
#
# Every setting can be overridden from the environment, e.g. a smoke run:
#   CURVE_TRIALS=3 CURVE_SAMPLES=2 CURVE_SEQ_LEN=160 CURVE_SCORE_SAMPLES=1 CURVE_SWEEP=0 \
#   CURVE_PPL_SAMPLES=1 CURVE_PPL_SEQ_LEN=256 CURVE_BUDGETS_ONLY="kivi-2" \
#   CURVE_OUT_DIR=/tmp/curve-results scripts/search_curve.sh smollm2-135m
#
#   CURVE_TRIALS         finished trials per search (default 40)
#   CURVE_SAMPLES        calibration windows for the statistics (default 8)
#   CURVE_SEQ_LEN        tokens per calibration / scoring window (default 256)
#   CURVE_SCORE_SAMPLES  held calibration windows the KL is scored on (default 2)
#   CURVE_SWEEP          1 = per-layer sensitivity sweep before each search (default 1)
#   CURVE_SPACE          search space file (default: the built-in space)
#   CURVE_EXTRA_BUDGETS  more budgets, space-separated
#   CURVE_BUDGETS_ONLY   only these budget labels (space-separated, e.g. "kivi-2 3.00b")
#   CURVE_PPL_SAMPLES    held-out perplexity sequences (default 8 for smollm2-135m, else 4)
#   CURVE_PPL_SEQ_LEN    tokens per held-out sequence (default 1024)
#   CURVE_RUN            run folder (default artifacts/runs/curve-MODEL-<time>; an existing one
#                        continues: finished searches are kept, interrupted ones resume)
#   CURVE_OUT_DIR        where the results go (default artifacts/results)
set -euo pipefail
model=${1:?usage: scripts/search_curve.sh MODEL}
trials=${CURVE_TRIALS:-40}
samples=${CURVE_SAMPLES:-8}
seq_len=${CURVE_SEQ_LEN:-256}
score_samples=${CURVE_SCORE_SAMPLES:-2}
if [ "$model" = "smollm2-135m" ]; then default_ppl=8; else default_ppl=4; fi
ppl_samples=${CURVE_PPL_SAMPLES:-$default_ppl}
ppl_seq_len=${CURVE_PPL_SEQ_LEN:-1024}
run=${CURVE_RUN:-artifacts/runs/curve-$model-$(date +%Y%m%d-%H%M%S)}
out_dir=${CURVE_OUT_DIR:-artifacts/results}
space_args=()
if [ -n "${CURVE_SPACE:-}" ]; then space_args=(--space "$CURVE_SPACE"); fi
sweep_args=()
if [ "${CURVE_SWEEP:-1}" = "0" ]; then sweep_args=(--no-sweep); fi

mkdir -p "$run/points"
python -m benchmarks.search_curve plan --model "$model" --run "$run" "${space_args[@]}" \
  --extra-budgets "${CURVE_EXTRA_BUDGETS:-}" \
  --setting "trials=$trials" --setting "samples=$samples" --setting "seq_len=$seq_len" \
  --setting "score_samples=$score_samples" --setting "ppl_samples=$ppl_samples" \
  --setting "ppl_seq_len=$ppl_seq_len" --setting "space=${CURVE_SPACE:-default}" \
  --setting "sweep=${CURVE_SWEEP:-1}" > "$run/budgets.txt"
if [ -n "${CURVE_BUDGETS_ONLY:-}" ]; then
  grep -E "^($(echo "$CURVE_BUDGETS_ONLY" | tr ' ' '|')) " "$run/budgets.txt" > "$run/budgets.sel" || true
  # the plan lists only the selected budgets, so the report shows what was run
  python - "$run" <<'EOF'
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
keep = [line.split()[0] for line in (run / "budgets.sel").read_text().splitlines() if line.strip()]
plan = json.loads((run / "curve-plan.json").read_text())
plan["budgets"] = [b for b in plan["budgets"] if b["label"] in keep]
(run / "curve-plan.json").write_text(json.dumps(plan, indent=2))
EOF
  mv "$run/budgets.sel" "$run/budgets.txt"
fi
echo "search curve for $model in $run: budgets $(cut -d' ' -f1 "$run/budgets.txt" | tr '\n' ' ')" >&2

if [ ! -f "$run/stats/stats.safetensors" ]; then
  kvcalib collect --model "$model" --data embedded --samples "$samples" --seq-len "$seq_len" \
    --block-len "$(( seq_len < 128 ? seq_len : 128 ))" --out "$run/stats" > /dev/null
fi

recipes=()
while read -r label budget; do
  dir="$run/budget-$label"
  if [ ! -f "$dir/search.json" ]; then
    resume=()
    if [ -f "$dir/study.db" ]; then resume=(--resume); else mkdir -p "$dir"; cp "$run/stats/stats.safetensors" "$run/stats/run.json" "$dir/"; fi
    kvcalib search --model "$model" --data embedded --out "$dir" --budget-bits "$budget" --trials "$trials" \
      --samples "$samples" --seq-len "$seq_len" --score-samples "$score_samples" --no-eval \
      "${space_args[@]}" "${sweep_args[@]}" "${resume[@]}" > "$dir/search.log"
  fi
  kvcalib export "$dir" --budget-bits "$budget" -o "$run/points/$label.safetensors" --force > /dev/null
  recipes+=(--recipe "$run/points/$label.safetensors")
done < "$run/budgets.txt"

kvcalib eval --model "$model" "${recipes[@]}" --preset fp16 --preset kivi-2 --preset kivi-4 --preset pertoken-4 \
  --metrics ppl --ppl-samples "$ppl_samples" --ppl-seq-len "$ppl_seq_len" --json "$run/eval.json" > "$run/eval.log"
python -m benchmarks.search_curve report --run "$run" --out-dir "$out_dir"
