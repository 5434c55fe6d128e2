# The two commands of the README: `make demo` and `make test`. Both set everything up on a fresh
# Linux machine with Python 3.11+ and PyPI access, and reuse what an earlier run installed.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvcalib-installed
export KVCALIB_HOME ?= $(HOME)/.cache/kvcalib

.PHONY: demo test setup clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/install_torch.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	bash scripts/install_torch.sh $(BIN)/python
	$(BIN)/python -m pip install --disable-pip-version-check -q -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/kvcalib search --model smollm2-135m --data embedded --budget-bits 3.0 --trials 25 --out artifacts/runs/demo-search-$$(date +%Y%m%d-%H%M%S)

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider

clean-venv:
	rm -rf $(VENV)
