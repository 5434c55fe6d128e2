#!/usr/bin/env bash
# Install torch into the venv before the project, so that a machine with no GPU gets a CPU build
# (an unpinned `torch` from PyPI pulls several GB of CUDA packages).
#   - torch already importable: nothing to do;
#   - an NVIDIA GPU: the default PyPI build (CUDA);
#   - no GPU: the CPU build from PyTorch's CPU index; where that index is unreachable, torch==2.13.0,
#     which resolves to a local CPU wheel on machines that provide one (pip's find-links).
set -euo pipefail
PY="$1"
if "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "torch $("$PY" -c 'import torch; print(torch.__version__)') already installed"
  exit 0
fi
PIP=("$PY" -m pip install --disable-pip-version-check -q)
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  "${PIP[@]}" "torch>=2.11"
else
  "${PIP[@]}" --retries 0 --timeout 15 --index-url https://download.pytorch.org/whl/cpu "torch>=2.11" 2>/dev/null \
    || "${PIP[@]}" "torch==2.13.0"
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'installed')"
