"""The kernel tests' shared preamble: on a machine without CUDA, choose Triton's interpreter
(``TRITON_INTERPRET=1``) before any ``@triton.jit`` function is defined, and import the kernel
modules under it. Call :func:`kernel_modules` at the top of a test module, before importing
anything that imports the kernels."""

from __future__ import annotations

import importlib
import os

import pytest
import torch


def _jit_types(module) -> set[str]:
    return {type(v).__name__ for v in vars(module).values() if type(v).__name__ in ("JITFunction", "InterpretedFunction")}


def kernel_modules(*names: str):
    """``(device, interpreting, modules)``: "cuda" or "cpu", whether the interpreter runs the
    kernels, and the modules ``names`` (in dependency order), reloaded under the interpreter when
    an earlier import compiled them for CUDA. Skips the calling module when neither can run."""
    has_cuda = torch.cuda.is_available()
    if not has_cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    device = "cuda" if has_cuda and not interpreting else "cpu"
    pytest.importorskip("triton")
    if not has_cuda and not interpreting:
        pytest.skip("no CUDA and TRITON_INTERPRET=0: Triton kernels cannot run here", allow_module_level=True)
    modules = [importlib.import_module(n) for n in names]
    if interpreting and any("JITFunction" in _jit_types(m) for m in modules):
        modules = [importlib.reload(m) for m in modules]  # imported earlier without the interpreter
    return device, interpreting, modules
