"""kvcalib: offline calibration and precision search for LLM KV-cache compression.

``import kvcalib`` is light on purpose: it imports no triton, optuna or scikit-learn and
initialises no CUDA. The public objects below load on first access.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it (imported lazily on first attribute access)
_LAZY = {
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
