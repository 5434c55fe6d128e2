#!/usr/bin/env bash
# Wheels for lm-evaluation-harness (`kvcalib eval --tasks`, benchmarks/ruler.py) on a machine without
# PyPI that already has torch, transformers, scikit-learn and typer (the lent GPU machine):
#
#   bash scripts/eval_wheels.sh DIR PYTHON_VERSION      e.g. bash scripts/eval_wheels.sh .whl-eval 3.12
#
# Downloads (never installs) lm-eval 0.4.x, the RULER extras (wonderwords, nltk) and every package they
# and `datasets` need that such a machine lacks, as wheels for PYTHON_VERSION on x86-64 Linux, into DIR;
# sqlitedict and word2number ship as sources only, so their (pure-Python) wheels are built here.
# scripts/device_env.sh installs what .whl/ holds with `pip install --no-deps --target /tmp/site`:
# pyarrow alone is ~40 MB, so carry DIR in two calls (pyarrow*.whl, then the rest) under the 64 MiB a
# call takes. The punkt_tab data and the plays text come from $KVCALIB_HOME/text (copy the `nltk_data`
# and `plays` folders with the other texts).
set -euo pipefail
DIR=${1:?usage: eval_wheels.sh DIR PYTHON_VERSION}; PYV=${2:?usage: eval_wheels.sh DIR PYTHON_VERSION}
PY=${PY:-python3}
mkdir -p "$DIR"
"$PY" -m pip wheel -q --no-deps -w "$DIR" sqlitedict word2number
"$PY" -m pip download -q --no-deps --only-binary :all: --python-version "$PYV" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d "$DIR" \
  "lm_eval>=0.4,<0.5" wonderwords "nltk>=3.9.1" evaluate datasets pyarrow dill multiprocess xxhash fsspec pandas \
  pytz tzdata python-dateutil six aiohttp aiosignal aiohappyeyeballs attrs frozenlist multidict propcache yarl \
  pytablewriter DataProperty mbstrdecoder pathvalidate tabledata tcolorpy typepy chardet rouge-score absl-py \
  sacrebleu portalocker tabulate colorama lxml more_itertools joblib regex
ls -la "$DIR"
