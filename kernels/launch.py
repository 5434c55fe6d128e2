"""Low-overhead launches of a ``@triton.jit`` kernel.

``kernel[grid](*args, **meta)`` binds every argument again at each call: it specializes each of
them (type, 16-byte alignment, ints equal to 1 or divisible by 16), builds a cache key from the
list and looks the compiled kernel up. For the decode kernel (~90 arguments, 19 constexprs) that
is most of a launch's host time (``benchmarks/host.py`` measures calls with and without
this module), and a decode step's attention is host-bound whenever the GPU work is short: batch 1,
short contexts, every eager ``model.generate`` step.

:class:`FastLauncher` keeps the compiled kernel per *key* and launches it directly
(``CompiledKernel.run``, what the JIT calls last). The key holds, for every argument, what
triton's specialization depends on, or more: the raw value of each specialized int (strides,
sizes: an equal value gives an equal specialization), the integer width class of each
``do_not_specialize`` int, dtype and 16-byte alignment of each tensor, and the constexprs and
launch options. A key seen for the first time goes through ``kernel[grid]`` (compiling if need
be), which returns the compiled kernel stored under it; so every fast launch runs a kernel the JIT
itself chose for an equal key. Under ``TRITON_INTERPRET=1`` (the kernel is then an interpreted
function), and wherever triton's internals are not the ones this relies on (no ``triton.knobs``,
constexprs before other parameters), every call takes the ordinary path.
"""

from __future__ import annotations

from operator import attrgetter, itemgetter
from typing import Any, Callable

import torch

try:
    import triton
    from triton import knobs as _knobs  # triton >= 3.4
except Exception:  # pragma: no cover - triton missing or too old: FastLauncher falls back
    triton = None  # type: ignore[assignment]
    _knobs = None

_I32 = 2 ** 31
_I64 = 2 ** 63
_MAX_KEYS = 4096  # keys kept per kernel (each holds a reference to a compiled kernel and a tuple)


def _int_width(x: int) -> int:
    """The integer type triton gives an unspecialized int: 0 i32, 1 i64, 2 u64."""
    return 0 if -_I32 <= x < _I32 else (1 if x < _I64 else 2)


_DTYPE = attrgetter("dtype")
_DATA_PTR = torch.Tensor.data_ptr
_LOW_BITS = (15).__and__  # a pointer's offset from 16-byte alignment


def _picker(positions: list[int]) -> Callable[[tuple], tuple]:
    """A function taking ``args`` to the tuple of its items at ``positions`` (C-level itemgetter)."""
    if not positions:
        return lambda args: ()
    if len(positions) == 1:
        i = positions[0]
        return lambda args: (args[i],)
    return itemgetter(*positions)


class _Layout:
    """Where each kind of argument sits, for one tuple of argument types: tensors (keyed by dtype
    and 16-byte alignment), specialized ints (by value), unspecialized ints (by int width),
    floats (by type only) and everything else (by value)."""

    __slots__ = ("tensors", "ints", "wide", "other")

    def __init__(self, types: tuple, unspecialized: frozenset) -> None:
        tensors = [i for i, c in enumerate(types) if issubclass(c, torch.Tensor)]
        ints = [i for i, c in enumerate(types) if c is int and i not in unspecialized]
        wide = [i for i, c in enumerate(types) if c is int and i in unspecialized]
        taken = set(tensors) | set(ints) | set(wide)
        other = [i for i, c in enumerate(types) if i not in taken and c is not float]
        self.tensors, self.ints, self.wide, self.other = (_picker(tensors), _picker(ints), _picker(wide),
                                                          _picker(other))


class FastLauncher:
    """``launcher(grid, args, meta)`` == ``fn[grid](*args, **meta)`` with less host time.

    ``args``: the kernel's non-constexpr parameters, in order, positionally (all of them);
    ``meta``: constexprs and launch options (``num_warps``, ``num_stages``, ``maxnreg``) by name.
    """

    def __init__(self, fn) -> None:
        self.fn = fn
        params = list(getattr(fn, "params", None) or ())  # none under TRITON_INTERPRET=1
        plain = [p for p in params if not p.is_constexpr]
        self.n_plain = len(plain)
        self.unspecialized = frozenset(i for i, p in enumerate(plain) if p.do_not_specialize)
        # constexpr parameters in signature order (the compiled launcher takes every parameter)
        self.constexprs = [(p.name, p.default if p.has_default else None) for p in params if p.is_constexpr]
        self.compiled: dict[Any, tuple[Any, tuple]] = {}
        self.layouts: dict[tuple, _Layout] = {}  # argument types -> where each kind sits
        # the fast path appends the constexprs after the positional arguments: they must come last
        self.enabled = bool(params) and _knobs is not None and all(params[i] is p for i, p in enumerate(plain))
        self.fast_calls = 0  # launches that skipped the JIT (tests and benchmarks read these)
        self.slow_calls = 0

    def key(self, args: tuple, meta: dict) -> tuple:
        """What the compiled kernel of this call depends on (module docstring): the arguments'
        types, then per kind (:class:`_Layout`) the tensors' dtypes and pointer offsets from
        16-byte alignment, specialized ints' values, unspecialized ints' widths, the other values
        (None, bools, numpy scalars: their specialization is a function of the value), and the
        constexprs and launch options. Built with C-level maps over the positions of each kind
        (one Python loop per argument took ~30 us of a decode call's host time)."""
        types = tuple(map(type, args))
        layout = self.layouts.get(types)
        if layout is None:
            layout = self.layouts[types] = _Layout(types, self.unspecialized)
        tensors = layout.tensors(args)
        wide = layout.wide(args)
        # widths: all i32 (the usual case: lengths and offsets) in one test, else one per int
        widths = 0 if not wide or (-_I32 <= min(wide) and max(wide) < _I32) else tuple(map(_int_width, wide))
        return (types, tuple(map(_DTYPE, tensors)), tuple(map(_LOW_BITS, map(_DATA_PTR, tensors))),
                layout.ints(args), widths, layout.other(args), tuple(meta.items()))

    def __call__(self, grid: tuple, args: tuple, meta: dict) -> None:
        if not self.enabled or len(args) != self.n_plain:
            self.fn[grid](*args, **meta)
            return
        device = triton.runtime.driver.active.get_current_device()
        key = (device, self.key(args, meta))
        hit = self.compiled.get(key)
        if hit is None:
            self.slow_calls += 1
            kernel = self.fn[grid](*args, **meta)  # binds, compiles if need be, launches
            tail = tuple(meta.get(name, default) for name, default in self.constexprs)
            if kernel is not None and hasattr(kernel, "run") and hasattr(kernel, "packed_metadata"):
                if len(self.compiled) >= _MAX_KEYS:  # many distinct strides over a long life: start over
                    self.compiled.clear()
                self.compiled[key] = (kernel, tail)
            return
        kernel, tail = hit
        self.fast_calls += 1
        stream = triton.runtime.driver.active.get_current_stream(device)
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        enter, leave = _knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook
        launch_meta = kernel.launch_metadata(grid, stream, *args, *tail) if enter is not None else None
        kernel.run(grid[0], g1, g2, stream, kernel.function, kernel.packed_metadata, launch_meta, enter, leave,
                   *args, *tail)
