"""The kernel tests' shared preamble: on a machine without CUDA, choose Triton's interpreter
(``TRITON_INTERPRET=1``) before any ``@triton.jit`` function is defined, and import the kernel
modules under it. Call :func:`kernel_modules` at the top of a test module, before importing
anything that imports the kernels."""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch


def _jit_types(module) -> set[str]:
    return {type(v).__name__ for v in vars(module).values() if type(v).__name__ in ("JITFunction", "InterpretedFunction")}


# CPython (3.11+) keeps frames on a per-thread "data stack" of 16 KiB chunks, mmapping a chunk when
# a call does not fit and unmapping it as soon as that call returns. The interpreter runs a kernel
# as one Python call with a deep tree of short calls under it (each tl op); where that tree sits
# across a chunk boundary, every op maps and unmaps a chunk. Which side it lands on depends on the
# caller's stack depth, so it came and went with unrelated edits (session 15: a kernel that gained
# a few locals took test_graph_decode.py from 200 s to 519 s, 38 s of it in mmap/munmap).
# Launching each grid from a frame larger than a chunk puts it at the start of a fresh 128 KiB
# chunk (sizes double from 16 KiB), with the op tree always inside it.
_FRAME_LOCALS = 9000  # x 8 bytes = 72 KiB: the chunk rounds up to 128 KiB, ~56 KiB left for the kernel
_WIDE_FRAME_SRC = (
    "def _call_in_wide_frame(call, args, kwargs):\n"
    "    if call is None:  # never true: the names below only size the frame\n"
    "        " + " = ".join(f"_{i}" for i in range(_FRAME_LOCALS)) + " = None\n"
    "    return call(*args, **kwargs)\n")


# The interpreter patches the language modules a function sees (``tl`` and ``tl.core`` among its
# globals: every builtin of them, of tl.tensor and tl.math wrapped for interpretation) at each grid
# launch, restoring them when the launch ends -- and again at every call of a @triton.jit helper
# from inside a kernel, where the launch has usually patched those modules already: the repeat
# finds nothing left to wrap but still walks the modules with inspect.getmembers, 36% of the
# kernel time of a graph-decode test (triton 3.6-3.9; profiled 2026-11-28: 15 s of 42 s, 8,080
# walks for 280 launches). Inside a launch, a helper whose language modules the launch has patched
# skips the walk; one that sees another (its module imports ``tl.core`` itself) patches as before.
_LAUNCH: dict = {"depth": 0, "patched": set()}  # ids of the language modules patched in this launch


def _patch_language_once_per_launch(interpreter) -> None:
    """Wrap the interpreter's ``_patch_lang`` as said above (an empty patch scope for a repeat)."""
    patch_lang = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if patch_lang is None or scope_type is None or getattr(patch_lang, "_kvcalib_once", False):
        return
    import triton.language as tl

    def patch_once(fn):
        langs = {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}  # what _patch_lang patches
        if _LAUNCH["depth"] and langs and langs <= _LAUNCH["patched"]:
            return scope_type()
        scope = patch_lang(fn)
        if _LAUNCH["depth"]:
            _LAUNCH["patched"] |= langs
        return scope

    patch_once._kvcalib_once = True
    interpreter._patch_lang = patch_once


def _launch_grids_in_fresh_stack_chunks() -> None:
    """Wrap the interpreter's grid launch (``GridExecutor.__call__``) in a frame wider than a
    data-stack chunk (see above), and mark the launch for :func:`_patch_language_once_per_launch`;
    once per process, and not where triton lacks those names."""
    interpreter = importlib.import_module("triton.runtime.interpreter")
    executor = getattr(interpreter, "GridExecutor", None)
    if executor is None or getattr(executor.__call__, "_kvcalib_wide_frame", False):
        return
    _patch_language_once_per_launch(interpreter)
    namespace: dict = {}
    exec(compile(_WIDE_FRAME_SRC, "<kvcalib wide frame>", "exec"), namespace)
    call_in_wide_frame = namespace["_call_in_wide_frame"]
    launch = executor.__call__

    def launch_in_wide_frame(self, *args, **kwargs):
        _LAUNCH["depth"] += 1
        _LAUNCH["patched"] = set()
        try:
            return call_in_wide_frame(launch, (self, *args), kwargs)
        finally:
            _LAUNCH["depth"] -= 1
            _LAUNCH["patched"] = set()

    launch_in_wide_frame._kvcalib_wide_frame = True
    executor.__call__ = launch_in_wide_frame


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
    if interpreting:
        _launch_grids_in_fresh_stack_chunks()
    modules = [importlib.import_module(n) for n in names]
    if interpreting and any("JITFunction" in _jit_types(sys.modules[n]) for n in list(sys.modules)
                            if n.startswith("kvcalib_kernels.")):
        # imported earlier without the interpreter: import every kernel module afresh (a kernel
        # module imports the JIT functions of others, e.g. decode_attention those of decode.*)
        for n in [n for n in sys.modules if n.startswith("kvcalib_kernels.")]:
            del sys.modules[n]
        modules = [importlib.import_module(n) for n in names]
    return device, interpreting, modules
