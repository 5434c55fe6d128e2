"""Evaluation harness behind ``kvcalib eval``: several recipes on identical inputs, one table.

Metrics (each module documents its exact definition):

- :mod:`~kvcalib.eval.perplexity`: decode-faithful perplexity on the evaluation split, over windows
  (:mod:`~kvcalib.eval.windows`) with a bootstrap interval;
- :mod:`~kvcalib.eval.copy`: a passage repeated, the NLL of the second copy's tail (can the model
  still quote its context through the compressed cache?);
- :mod:`~kvcalib.eval.agreement`: greedy-token agreement with full precision;
- :mod:`~kvcalib.eval.passkey`: passkey retrieval at several depths and lengths;
- :mod:`~kvcalib.eval.gsm8k`: GSM8K-100 accuracy;
- effective bits and KV bytes per sequence at a stated context (``Recipe.memory``);
- :mod:`~kvcalib.eval.tasks`: lm-evaluation-harness tasks (RULER) through a recipe, with
  :mod:`~kvcalib.eval.lm_eval_model` as lm-eval's model (lm-eval is an optional extra, imported
  only there).

:func:`evaluate` (in :mod:`~kvcalib.eval.harness`) runs them; importing this package loads no
model and initialises no CUDA.
"""

from kvcalib.eval.harness import (DEFAULT_METRICS, METRICS, EvalConfig, EvalConfigError, EvalResult,
                                  evaluate, results_table_columns, results_table_rows, write_json)

__all__ = ["DEFAULT_METRICS", "METRICS", "EvalConfig", "EvalConfigError", "EvalResult", "evaluate",
           "results_table_columns", "results_table_rows", "write_json"]
