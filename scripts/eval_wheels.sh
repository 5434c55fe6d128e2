#!/usr/bin/env bash
# Wheels for lm-evaluation-harness (`kvcalib eval --tasks`, benchmarks/ruler.py) on a machine without
# PyPI that already has torch, transformers, scikit-learn and typer (the lent GPU machine):
#
#   bash scripts/eval_wheels.sh DIR PYTHON_VERSION      e.g. bash scripts/eval_wheels.sh .whl-eval 3.12
#
# Downloads (never installs) lm-eval 0.4.x, the RULER extras (wonderwords, nltk) and every package they
# and `datasets` need that such a machine lacks, as wheels for PYTHON_VERSION on x86-64 Linux, into DIR;
# sqlitedict and word2number ship as sources only, so their (pure-Python) wheels are built here.
# scripts/device_env.sh installs what .whl/ holds with `pip install --no-deps --target /tmp/site`
# (~25 MB, one call). pyarrow and pandas are left out: the lent GPU machine's image has them (pyarrow
# 25), and wheels of other versions installed over them broke lm-eval's RULER data there (datasets
# failed to hash a pyarrow type, 2026-11-29: pyarrow 24 and pandas 3.1 over the image's); set
# WITH_ARROW=1 for a machine without them (pyarrow alone is ~55 MB: carry it in a call of its own). The punkt_tab data and the plays text come from $KVCALIB_HOME/text (copy the `nltk_data`
# and `plays` folders with the other texts).
set -euo pipefail
DIR=${1:?usage: eval_wheels.sh DIR PYTHON_VERSION}; PYV=${2:?usage: eval_wheels.sh DIR PYTHON_VERSION}
PY=${PY:-python3}
mkdir -p "$DIR"
"$PY" -m pip wheel -q --no-deps -w "$DIR" sqlitedict word2number
"$PY" -m pip download -q --no-deps --only-binary :all: --python-version "$PYV" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d "$DIR" \
  "lm_eval>=0.4,<0.5" wonderwords "nltk>=3.9.1" evaluate datasets dill multiprocess xxhash fsspec \
  pytz tzdata python-dateutil six aiohttp aiosignal aiohappyeyeballs attrs frozenlist multidict propcache yarl \
  pytablewriter DataProperty mbstrdecoder pathvalidate tabledata tcolorpy typepy chardet rouge-score absl-py \
  sacrebleu portalocker tabulate colorama lxml more_itertools joblib regex \
  ${WITH_ARROW:+pyarrow pandas}
ls -la "$DIR"
