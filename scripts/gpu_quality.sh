#!/usr/bin/env bash
# Quality runs on the lent GPU machine (issues 51 and 53): RULER through lm-evaluation-harness
# (benchmarks/ruler.py) and perplexity / copy / passkey (benchmarks/long_context.py) at one context,
# as many processes side by side as the groups below make. A model of 135M-1.5B parameters leaves an
# H200 mostly idle, so the processes share it; each one saves its rows as each recipe finishes, so a
# process stopped by TIMEOUT keeps what it finished. Everything lands under $W and is packed into
# $OUT/quality.tgz (the device tool returns at most 8 files). From the repository root, after
# `source scripts/device_env.sh` (carry .whl-eval for lm-eval, and the model's parts):
#
#   MODEL=smollm2-135m CONTEXT=8192 RECIPES="kivi-2 kivi-4 recipes/smollm2-135m/recipe.safetensors" \
#       bash scripts/gpu_quality.sh [ruler] [long] [copy-decode]          (default: ruler long)
#
# Back on this machine:   tar xzf quality.tgz -C DIR
#   python benchmarks/ruler.py $(printf -- '--merge %s ' DIR/ruler_*.json)        (one --merge a file)
#   python benchmarks/long_context.py $(printf -- '--merge %s ' DIR/lc_*/lc.json)
#
# The device tool gives a machine back 30 s after a call returns, background processes included:
# a run longer than one call starts this script with `setsid nohup ... &` and then keeps a call in
# flight (back-to-back calls that sleep, then pack what is there) until it ends.
#
# Stages:
#   ruler        one process per (task group x chunk of CHUNK recipes) with --no-fp, and one per task
#                group for full precision alone (the samples depend on the seed alone, so the merge
#                pairs every row with it by prompts_sha256; each process repeated it before);
#                --baselines '' (name presets in RECIPES)
#   long         one process per (text x chunk): ppl (PPL_SAMPLES windows) and copy on every text,
#                passkey (PASSKEY_TRIALS x 5 depths) on the first text only
#   copy-decode  copy through a real CompressedCache decode (--decode), first text, one process per chunk
# Env: MODEL, CONTEXT, RECIPES (required); CHUNK (2), LIMIT (50 samples a task), BATCH (8), GEN (64
# tokens at most per answer: RULER's answers are a few words), TASK_GROUPS (three groups of two tasks),
# TEXTS ("longtext plays"), PPL_SAMPLES (8), PASSKEY_TRIALS (4), TIMEOUT (500 s a process), W (/tmp/quality),
# DEVICE (cuda), LONG_ARGS (more options for long_context.py, e.g. a short --copy-len for a CPU smoke run).
# Measured (one H200, 2026-11-28, SmolLM2-135M at 8k, 6 processes at once): RULER, one recipe on two
# tasks at 50 samples and batch 8: 70-160 s; long_context on the plays (ppl + copy) for 7 recipes:
# < 500 s; the same on the Britannica text with passkey did not finish 7 recipes in 500 s.
# Qwen2.5-Coder-0.5B at 16k (2026-11-29, 15 processes, before full precision ran once per group):
# RULER 6.5 s a request in full precision, 15-26 s through a compressed cache (batch 8); in 1,250 s
# each long-context process finished full precision and one recipe on the plays, none on Britannica.
# The same at 16k after padded rows joined in one launch (2026-11-29, one process per task and recipe,
# 50 samples): a compressed recipe 253-260 s a process with 4 processes, 273-312 s with 8; full
# precision 159-176 s with 8 (the compressed processes beside it did not finish in 390 s).
set -uo pipefail
: "${MODEL:?MODEL=...}" "${CONTEXT:?CONTEXT=...}" "${RECIPES:?RECIPES=\"preset-or-file ...\"}"
CHUNK=${CHUNK:-2}; LIMIT=${LIMIT:-50}; BATCH=${BATCH:-8}; GEN=${GEN:-64}; TIMEOUT=${TIMEOUT:-500}
TASK_GROUPS=${TASK_GROUPS:-"niah_single_1,niah_multikey_2 niah_multikey_3,ruler_vt ruler_cwe,ruler_fwe"}
TEXTS=${TEXTS:-"longtext plays"}; PPL_SAMPLES=${PPL_SAMPLES:-8}; PASSKEY_TRIALS=${PASSKEY_TRIALS:-4}
DEVICE=${DEVICE:-cuda}; LONG_ARGS=${LONG_ARGS:-}
W=${W:-/tmp/quality}; OUT=${OUT:-$W/out}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}  # several processes share the host's cores
mkdir -p "$W" "$OUT"
STAGES="${*:-ruler long}"

# RECIPES in chunks of CHUNK, each chunk as "--recipe A --recipe B"
chunks=(); current=(); n=0
for r in $RECIPES; do
  current+=(--recipe "$r"); n=$((n + 1))
  if [ "$n" -ge "$CHUNK" ]; then chunks+=("${current[*]}"); current=(); n=0; fi
done
[ "$n" -gt 0 ] && chunks+=("${current[*]}")

pids=()
for st in $STAGES; do
  case "$st" in
    ruler)
      g=0
      for tasks in $TASK_GROUPS; do
        timeout "$TIMEOUT" python3 benchmarks/ruler.py --model "$MODEL" --context "$CONTEXT" --device "$DEVICE" \
          --limit "$LIMIT" --batch-size "$BATCH" --max-gen-toks "$GEN" --tasks "$tasks" --baselines '' \
          --out "$W/ruler_g${g}fp.json" --output-path "$W/lm_g${g}fp" > "$W/ruler_g${g}fp.log" 2>&1 &
        pids+=($!)
        c=0
        for chunk in "${chunks[@]}"; do
          tag="g${g}c${c}"
          # shellcheck disable=SC2086  # a chunk is several words on purpose
          timeout "$TIMEOUT" python3 benchmarks/ruler.py --model "$MODEL" --context "$CONTEXT" --device "$DEVICE" \
            --limit "$LIMIT" --batch-size "$BATCH" --max-gen-toks "$GEN" --tasks "$tasks" --baselines '' --no-fp $chunk \
            --out "$W/ruler_$tag.json" --output-path "$W/lm_$tag" > "$W/ruler_$tag.log" 2>&1 &
          pids+=($!); c=$((c + 1))
        done
        g=$((g + 1))
      done ;;
    long)
      t=0
      for text in $TEXTS; do
        metrics=ppl,copy; [ "$t" = 0 ] && metrics=ppl,copy,passkey
        c=0
        for chunk in "${chunks[@]}"; do
          tag="$text-c$c"
          # shellcheck disable=SC2086
          timeout "$TIMEOUT" python3 benchmarks/long_context.py --model "$MODEL" --context "$CONTEXT" --device "$DEVICE" \
            --text "$text" --metrics "$metrics" --ppl-samples "$PPL_SAMPLES" --passkey-trials "$PASSKEY_TRIALS" \
            $chunk $LONG_ARGS --out "$W/lc_$tag/lc.json" > "$W/lc_$tag.log" 2>&1 &
          pids+=($!); c=$((c + 1))
        done
        t=$((t + 1))
      done ;;
    copy-decode)
      first=${TEXTS%% *}; c=0
      for chunk in "${chunks[@]}"; do
        # shellcheck disable=SC2086
        timeout "$TIMEOUT" python3 benchmarks/long_context.py --model "$MODEL" --context "$CONTEXT" --device "$DEVICE" \
          --text "$first" --metrics copy --decode $chunk $LONG_ARGS --out "$W/lc_decode-c$c/lc.json" > "$W/lc_decode-c$c.log" 2>&1 &
        pids+=($!); c=$((c + 1))
      done ;;
    *) echo "gpu_quality.sh: unknown stage $st (ruler, long, copy-decode)" >&2 ;;
  esac
done
echo "gpu_quality.sh: ${#pids[@]} processes"
for p in "${pids[@]}"; do wait "$p"; echo "process $p exit $?"; done
# lm-eval's per-sample files are large: the results files and our rows travel
(cd "$W" && tar czf "$OUT/quality.tgz" --exclude='samples_*' --exclude=out .)
ls -la "$OUT"
for f in "$W"/*.log; do echo "== $f"; grep -E "bits  |error|Error" "$f" | tail -n 8; done
