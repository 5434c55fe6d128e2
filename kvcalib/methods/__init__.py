"""The compression methods, one module each, and the registry everything else iterates.

Every module of this package except :mod:`.base` defines one :class:`~.base.Method` subclass
(its whole contract: see :mod:`.base`). :func:`registry` imports them all on first use and
returns them in pipeline order (``Method.order``: later methods fit on what earlier ones
fitted), so adding a method is adding one file here. :func:`register` adds a method defined
elsewhere (a plugin, or a test's toy method) for the life of the process.

Importing this package imports torch but not scikit-learn or scipy (imported inside the KMeans
fit only).
"""

from __future__ import annotations

import importlib
import pkgutil

from kvcalib.methods.base import CalibrationError, KernelAttend, KernelEncode, Method, MethodState

__all__ = ["CalibrationError", "KernelAttend", "KernelEncode", "Method", "MethodState", "registry", "get", "register",
           "unregister"]

_EXTRA: dict[str, type[Method]] = {}
_FOUND: dict[str, type[Method]] | None = None


def _discover() -> dict[str, type[Method]]:
    found: dict[str, type[Method]] = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name == "base" or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        for obj in vars(module).values():
            if (isinstance(obj, type) and issubclass(obj, Method) and obj is not Method
                    and obj.__module__ == module.__name__ and "name" in vars(obj)):
                found[obj.name] = obj
    return found


def registry() -> dict[str, type[Method]]:
    """name -> Method subclass, in pipeline order (``order``, then name)."""
    global _FOUND
    if _FOUND is None:
        _FOUND = _discover()
    merged = {**_FOUND, **_EXTRA}
    return dict(sorted(merged.items(), key=lambda item: (item[1].order, item[0])))


def get(name: str) -> type[Method]:
    """The method registered as ``name``; a KvcalibError lists the known ones otherwise."""
    methods = registry()
    if name not in methods:
        raise CalibrationError(f"unknown method {name!r}: use one of {', '.join(methods)}")
    return methods[name]


def register(cls: type[Method]) -> type[Method]:
    """Add ``cls`` to the registry (usable as a class decorator); its name must be new."""
    if not (isinstance(cls, type) and issubclass(cls, Method)) or not getattr(cls, "name", None):
        raise TypeError(f"register() takes a Method subclass with a name, got {cls!r}")
    if cls.name in registry() and registry()[cls.name] is not cls:
        raise ValueError(f"a method named {cls.name!r} is already registered")
    _EXTRA[cls.name] = cls
    return cls


def unregister(name: str) -> None:
    """Remove a method added by :func:`register` (tests clean up after themselves)."""
    _EXTRA.pop(name, None)
