# The two commands of the README: `make demo` and `make test`. Both set everything up on a fresh
# Linux machine with Python 3.11+ and PyPI access, and reuse what an earlier run installed.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvcalib-installed
export KVCALIB_HOME ?= $(HOME)/.cache/kvcalib

.PHONY: demo test test-quick setup clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/install_torch.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	bash scripts/install_torch.sh $(BIN)/python
	$(BIN)/python -m pip install --disable-pip-version-check -q -e ".[test]"
	touch $(STAMP)

# The demo scores short windows (--score-seq-len 256, held-out proof on 512-token windows; bits counted
# at 4096) so that it finishes in minutes on a 2-core CPU. `kvcalib search` alone scores windows of the
# context you deploy (--context, default min(8192, the model's maximum)): run that on a GPU.
demo: $(STAMP)
	@echo "make demo: a short-context search for the CPU (256-token scoring windows); kvcalib search alone targets 8192-token contexts (GPU)"
	$(BIN)/kvcalib search --model smollm2-135m --data embedded --budget-bits 3.0 --trials 25 --context 4096 --score-seq-len 256 --eval-seq-len 512 --out artifacts/runs/demo-search-$$(date +%Y%m%d-%H%M%S)

# `make test`: every test (CI: 2 cores), spread over TEST_WORKERS pytest-xdist workers, a test file
# per worker at a time (module fixtures, such as a loaded model, built once); then the slowest 30.
# `make test-quick`: the same without the tests marked slow (pyproject.toml says which).
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --durations=30

test: $(STAMP)
	$(PYTEST)

test-quick: $(STAMP)
	$(PYTEST) -m "not slow"

clean-venv:
	rm -rf $(VENV)
