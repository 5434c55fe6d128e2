#!/usr/bin/env bash
# Source this on the lent GPU machine (device tool `run`), from the repository root, before anything
# that imports kvcalib there:   source scripts/device_env.sh
#
# The machine has torch, triton and transformers but no PyPI and no hub: it installs the wheels
# carried in .whl/ (optuna and its dependencies, gguf) into /tmp/site, makes kvcalib importable
# from the source tree (kvcalib_kernels is kernels/ under its install name, kvcalib.presets is
# recipes/presets), and points KVCALIB_HOME at /tmp/kvh, where the embedded text and the
# SmolLM2-135M GGUF arrive in parts: .gpu/p1 (first part, the stamp, the notices, smol.parts),
# .gpu/p2 (second part and the texts: britannica, milton and plays, the long-context evaluation and
# calibration texts) and .gpu/p3 (the last part), in calls made back to back (a warm machine keeps
# /tmp between them); the GGUF is assembled once every part is there (kvcalib checks it against the
# pinned sha256 on use). The Qwen models likewise (see assemble_parts below). (The .gpu/ parts are
# made by splitting the files of ~/.cache/kvcalib/models with `split -b BYTES -d -a 2 FILE
# PREFIX.part.`, one part per folder: a call carries < 64 MiB with the work tree, ~12 MiB, so a part
# of 35 MB leaves room for the wheels; the first part's folder also holds the stamp, the ATTRIBUTION
# and `PREFIX.parts`, the number of parts; .gpu/ is git-ignored.)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 KVCALIB_QUIET=1
# (typer >= 0.25 imports pydantic: pydantic, pydantic-core, annotated-types and typing-inspection
# travel too.) The stamp names the wheel set, so a warm machine installs a changed set again.
# .whl-eval (scripts/eval_wheels.sh: lm-eval and what it needs beyond the machine's image) is
# installed the same way when a call carries it, into the same /tmp/site.
for WHEELS in .whl .whl-eval; do  # (not W: scripts that source this use W)
  WHL_STAMP=/tmp/site/.done-$WHEELS-$(ls $WHEELS 2>/dev/null | md5sum | cut -c1-12)
  if [ -d $WHEELS ] && [ ! -e "$WHL_STAMP" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHEELS/*.whl \
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
# the texts travel in whichever part has room (.gpu/p2 beside SmolLM2's second part, .gpu/q10 beside
# Qwen's last: a call that brings only Qwen's parts still needs them)
for t in .gpu/*/text; do [ -d "$t" ] && cp -r "$t" "$KVCALIB_HOME/"; done
# Each model from its parts, one a call (the first part's folder brings the stamp, the notices and
# PREFIX.parts, how many parts make the file: each call carries < 64 MiB with the tree, ~12 MiB):
# SmolLM2-135M from .gpu/p1 .. .gpu/p3 (smol.part.*, 35 MB each: two parts of 55 MB no longer fit
# beside the tree), Qwen2.5-Coder-0.5B from .gpu/q1 .. .gpu/q10 (qwen.part.*, 50 MB each, the texts in q10), Qwen2.5-Coder-1.5B from .gpu/r1 ..
# .gpu/r21 (big.part.*; r21, 17 MB, has room for the wheels in the same call)
assemble_parts() {  # PREFIX FIRST_DIR MODEL_FOLDER GGUF_NAME
  local prefix=$1 first=$2 folder=$KVCALIB_HOME/models/$3 gguf=$KVCALIB_HOME/models/$3/$4 d
  mkdir -p "$folder"
  for d in .gpu/*; do compgen -G "$d/$prefix.part.*" > /dev/null && cp "$d"/$prefix.part.* "$KVCALIB_HOME/parts/"; done
  [ -d "$first" ] && cp "$first"/*.json "$first"/ATTRIBUTION.txt "$first/$prefix.parts" "$folder/" \
    && { [ ! -e "$first/LICENSE" ] || cp "$first/LICENSE" "$folder/"; }
  if [ ! -s "$gguf" ] && [ -s "$folder/$prefix.parts" ] \
      && [ "$(ls "$KVCALIB_HOME"/parts/$prefix.part.* 2>/dev/null | wc -l)" = "$(cat "$folder/$prefix.parts")" ]; then
    cat "$KVCALIB_HOME"/parts/$prefix.part.* > "$gguf.tmp" && mv "$gguf.tmp" "$gguf"
    echo "device_env: $3 GGUF assembled: $(sha256sum "$gguf" | cut -c1-16)"
  fi
}
assemble_parts smol .gpu/p1 smollm2-135m SmolLM2-135M-Instruct.Q4_1.gguf
assemble_parts qwen .gpu/q1 qwen2.5-coder-0.5b qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
assemble_parts big .gpu/r1 qwen2.5-coder-1.5b qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
echo "device_env: parts held: $(ls "$KVCALIB_HOME/parts" | tr '\n' ' ')"
python3 -c "import torch, triton, transformers; print('device_env:', torch.cuda.get_device_name(0), 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
