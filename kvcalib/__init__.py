"""kvcalib: offline calibration and precision search for LLM KV-cache compression.

``import kvcalib`` is light on purpose: it imports no triton, optuna or scikit-learn and
initialises no CUDA. The public objects below load on first access.

Three lines to decode with a compressed cache (``inputs`` from the model's tokenizer)::

    loaded = kvcalib.load_model("smollm2-135m")
    cache = kvcalib.CompressedCache.from_recipe(loaded.model, "kivi-2")
    out = loaded.model.generate(**inputs, past_key_values=cache, max_new_tokens=32)

Offline: ``kvcalib.collect`` (K/V statistics) -> ``kvcalib.search`` / ``kvcalib export``
(a recipe) -> ``kvcalib.evaluate`` (held-out quality and memory); ``kvcalib.load_recipe`` reads
a recipe file or a preset. docs/python_api.md has runnable examples.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it (imported lazily on first attribute access)
_LAZY = {
    # runtime
    "CompressedCache": "kvcalib.runtime.cache",
    "cuda_graphs": "kvcalib.runtime.graphs",
    # recipes
    "Recipe": "kvcalib.recipe",
    "LayerConfig": "kvcalib.layout",
    "load_recipe": "kvcalib.api",
    # models
    "load_model": "kvcalib.models",
    "LoadedModel": "kvcalib.models",
    "ModelInfo": "kvcalib.models",
    # offline phases (typed configs and results beside each function)
    "collect": "kvcalib.api",
    "CollectConfig": "kvcalib.collection",
    "CollectResult": "kvcalib.collection",
    "evaluate": "kvcalib.api",
    "EvalConfig": "kvcalib.eval.harness",
    "EvalResult": "kvcalib.eval.harness",
    "search": "kvcalib.optimize",
    "SearchConfig": "kvcalib.optimize",
    "SearchResult": "kvcalib.optimize",
    # serving export (FP8 k_scale/v_scale in the compressed-tensors layout)
    "export_compressed_tensors": "kvcalib.serving",
    # errors
    "KvcalibError": "kvcalib.errors",
    "RecipeError": "kvcalib.errors",
    "OfflineError": "kvcalib.errors",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvcalib' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
