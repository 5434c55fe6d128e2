"""The one seam for the optional GPU dependency: which implementation runs, reference or Triton.

``KVCALIB_BACKEND=reference|triton`` forces one; ``auto`` (the default) picks the Triton kernels
for work on CUDA tensors when triton imports, the PyTorch reference otherwise. Encoding
(:mod:`kvcalib.codec`) and attention (:mod:`kvcalib.runtime.backend`) both ask here, so they
always agree. Nothing here imports triton at module import, and nothing initialises CUDA.
"""

from __future__ import annotations

import functools
import os

import torch

from kvcalib.errors import KvcalibError

BACKENDS = ("auto", "reference", "triton")


@functools.lru_cache(maxsize=1)
def has_triton() -> bool:
    """True when triton imports (it is only useful with CUDA or TRITON_INTERPRET=1)."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``: the CPU tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def requested_backend() -> str:
    name = os.environ.get("KVCALIB_BACKEND", "auto").strip().lower() or "auto"
    if name not in BACKENDS:
        raise KvcalibError(f"KVCALIB_BACKEND={name!r} is not known: use one of {', '.join(BACKENDS)}.")
    return name


def triton_chosen(x: torch.Tensor) -> bool:
    """The backend choice for work on ``x``'s device: ``reference`` never, ``triton`` always (it
    must import), ``auto`` on CUDA tensors when triton imports. Shared by attention and encoding."""
    name = requested_backend()
    if name == "reference":
        return False
    if name == "triton":
        if not has_triton():
            raise KvcalibError("KVCALIB_BACKEND=triton but triton is not installed: pip install triton, or unset KVCALIB_BACKEND.")
        return True
    return x.is_cuda and has_triton()
