#!/usr/bin/env bash
# Source this on the lent GPU machine (device tool `run`), from the repository root, before anything
# that imports kvcalib there:   source scripts/device_env.sh
#
# The machine has torch, triton and transformers but no PyPI and no hub: it installs the wheels
# carried in .whl/ (optuna and its dependencies, gguf) into /tmp/site, makes kvcalib importable
# from the source tree (kvcalib_kernels is kernels/ under its install name, kvcalib.presets is
# recipes/presets), and points KVCALIB_HOME at /tmp/kvh, where the embedded text and the
# SmolLM2-135M GGUF arrive in parts: .gpu/p1 (first part, the stamp, the texts: britannica and
# milton, the long-context evaluation and calibration texts) and .gpu/p2 (the
# second part) come in two calls made back to back (a warm machine keeps /tmp between them); the
# GGUF is assembled once both parts are there (kvcalib checks it against the pinned sha256 on use).
# Qwen2.5-Coder-0.5B likewise from .gpu/q1 .. .gpu/q9. (The .gpu/ parts are made by splitting the
# files of ~/.cache/kvcalib/models with `split -b 55000000 -d -a 2 FILE qwen.part.`, one part per
# folder: a call carries < 64 MiB with the work tree, ~6 MB; .gpu/q1 also holds the stamp, the
# ATTRIBUTION and `qwen.parts`, the number of parts; .gpu/ is git-ignored.)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 KVCALIB_QUIET=1
# (typer >= 0.25 imports pydantic: pydantic, pydantic-core, annotated-types and typing-inspection
# travel too.) The stamp names the wheel set, so a warm machine installs a changed set again.
# .whl-eval (scripts/eval_wheels.sh: lm-eval and what it needs beyond the machine's image) is
# installed the same way when a call carries it, into the same /tmp/site.
for W in .whl .whl-eval; do
  WHL_STAMP=/tmp/site/.done-$W-$(ls $W 2>/dev/null | md5sum | cut -c1-12)
  if [ -d $W ] && [ ! -e "$WHL_STAMP" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $W/*.whl \
      && touch "$WHL_STAMP"
  fi
done
KK=/tmp/kvcalib_kernels_path
mkdir -p "$KK" && ln -sfn "$(realpath "${KV_KERNELS:-kernels}")" "$KK/kvcalib_kernels"
export PYTHONPATH="$PWD:$KK:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
[ -e kvcalib/presets ] || ln -s ../recipes/presets kvcalib/presets
export KVCALIB_HOME=/tmp/kvh
SMOL=$KVCALIB_HOME/models/smollm2-135m
mkdir -p "$KVCALIB_HOME/parts" "$SMOL"
if [ -d .gpu/p1 ]; then
  cp -r .gpu/p1/text "$KVCALIB_HOME/" 2>/dev/null
  cp .gpu/p1/smol.part.00 "$KVCALIB_HOME/parts/"
  cp .gpu/p1/*.json .gpu/p1/ATTRIBUTION.txt .gpu/p1/LICENSE "$SMOL/"  # the stamp and notices kvcalib expects beside it
fi
[ -d .gpu/p2 ] && cp .gpu/p2/smol.part.01 "$KVCALIB_HOME/parts/"
GGUF=$SMOL/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -s "$GGUF" ] && [ -s "$KVCALIB_HOME/parts/smol.part.00" ] && [ -s "$KVCALIB_HOME/parts/smol.part.01" ]; then
  cat "$KVCALIB_HOME"/parts/smol.part.0* > "$GGUF.tmp" && mv "$GGUF.tmp" "$GGUF"
  echo "device_env: SmolLM2 GGUF assembled: $(sha256sum "$GGUF" | cut -c1-16)"
fi
# Qwen2.5-Coder-0.5B: nine parts in .gpu/q1 .. .gpu/q9, one a call (q1 brings the stamp and the count)
QWEN=$KVCALIB_HOME/models/qwen2.5-coder-0.5b
mkdir -p "$QWEN"
for d in .gpu/q*; do [ -d "$d" ] && cp "$d"/qwen.part.* "$KVCALIB_HOME/parts/"; done
[ -d .gpu/q1 ] && cp .gpu/q1/*.json .gpu/q1/ATTRIBUTION.txt .gpu/q1/qwen.parts "$QWEN/"
QGGUF=$QWEN/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
# qwen.parts (from .gpu/q1): how many parts make the file (each call carries < 64 MiB with the tree)
if [ ! -s "$QGGUF" ] && [ -s "$QWEN/qwen.parts" ] \
    && [ "$(ls "$KVCALIB_HOME"/parts/qwen.part.* 2>/dev/null | wc -l)" = "$(cat "$QWEN/qwen.parts")" ]; then
  cat "$KVCALIB_HOME"/parts/qwen.part.* > "$QGGUF.tmp" && mv "$QGGUF.tmp" "$QGGUF"
  echo "device_env: Qwen GGUF assembled: $(sha256sum "$QGGUF" | cut -c1-16)"
fi
echo "device_env: parts held: $(ls "$KVCALIB_HOME/parts" | tr '\n' ' ')"
python3 -c "import torch, triton, transformers; print('device_env:', torch.cuda.get_device_name(0), 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
