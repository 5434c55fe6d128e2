"""Evaluation harness behind ``kvcalib eval``: several recipes on identical inputs, one table.

Metrics (each module documents its exact definition):

- :mod:`~kvcalib.eval.perplexity`: decode-faithful perplexity on the evaluation split;
- :mod:`~kvcalib.eval.agreement`: greedy-token agreement with full precision;
- :mod:`~kvcalib.eval.passkey`: passkey retrieval at several depths and lengths;
- :mod:`~kvcalib.eval.gsm8k`: GSM8K-100 accuracy;
- effective bits and KV bytes per sequence at a stated context (``Recipe.memory``).

:func:`evaluate` (in :mod:`~kvcalib.eval.harness`) runs them; importing this package loads no
model and initialises no CUDA.
"""

from kvcalib.eval.harness import (DEFAULT_METRICS, METRICS, EvalConfig, EvalConfigError, EvalResult,
                                  evaluate, results_table_columns, results_table_rows, write_json)

__all__ = ["DEFAULT_METRICS", "METRICS", "EvalConfig", "EvalConfigError", "EvalResult", "evaluate",
           "results_table_columns", "results_table_rows", "write_json"]
