"""Writes, and reading a safetensors file that carries a JSON document in its metadata (recipes,
coded cache snapshots).

Every file or folder kvcalib writes goes through one path, :func:`atomic_path`: nothing
half-written is ever left under a user's chosen name (write to a temporary sibling, then
``os.replace`` it into place, atomic on POSIX), and a storage failure while writing -- an
``OSError`` (a full, read-only or vanished disk), safetensors' ``SafetensorError`` (which reports
a full disk as ``I/O error: No space left on device (os error 28)``), a disk that fills mid-write --
becomes one :class:`WriteFailed` naming the file and the fix, with the temporary removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

from kvcalib.errors import KvcalibError, storage_failure


class WriteFailed(KvcalibError):
    """Writing an output failed for a reason of the machine's storage (one line: the file, what
    failed, the fix). ``path`` is the output named; ``reason`` the line without the path."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"cannot write {path}: {reason}; nothing was left behind")
        self.path, self.reason = Path(path), reason


@contextlib.contextmanager
def atomic_path(final: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``final``; on success rename it to ``final``.

    Works for files and for folders (the caller creates what it needs at the yielded path).
    On any exception the temporary is removed and ``final`` is untouched; a storage failure
    (:func:`storage_failure`) becomes :class:`WriteFailed` naming ``final`` (a failure inside a
    nested write, e.g. a file of a run folder being written, names the outer ``final``).
    """
    final = Path(final)
    tmp: Path | None = None
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
        tmp_target = tmp / final.name
        yield tmp_target
        if final.is_dir() and not final.is_symlink():
            backup = final.with_name(f".{final.name}.old")
            shutil.rmtree(backup, ignore_errors=True)
            os.replace(final, backup)
            os.replace(tmp_target, final)
            shutil.rmtree(backup, ignore_errors=True)
        else:
            os.replace(tmp_target, final)
    except WriteFailed as err:
        if tmp is not None and tmp in err.path.parents:  # a file written inside this temporary
            raise WriteFailed(final, err.reason) from None
        raise
    except Exception as err:
        reason = storage_failure(err)
        if reason is None:
            raise
        raise WriteFailed(final, reason) from None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write ``obj`` as indented JSON to ``path`` atomically."""
    with atomic_path(Path(path)) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically."""
    with atomic_path(Path(path)) as tmp:
        tmp.write_text(text)


def read_safetensors_document(path: Path, key: str, what: str, not_a: str, error_cls: type[Exception],
                              fix: str = "") -> tuple[Any, dict]:
    """(JSON document under metadata ``key``, tensors) of the safetensors file ``path``.

    Every failure is one ``error_cls`` naming ``path``: ``what`` names the kind of file in the
    message ("recipe"), ``not_a`` what a file without the key is not ("a kvcalib recipe"), ``fix``
    is appended to the corrupt-file message (": re-export it").
    """
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as err:  # safetensors raises several error types on corrupt input
        raise error_cls(f"{what} {path} is corrupt or truncated ({type(err).__name__}: {err}){fix}") from None
    if key not in meta:
        raise error_cls(f"{path} has no {key!r} metadata: it is not {not_a}")
    try:
        return json.loads(meta[key]), tensors
    except (ValueError, TypeError) as err:  # ValueError: JSONDecodeError, or an integer of > 4300 digits
        raise error_cls(f"{what} {path}: its metadata is not valid JSON ({getattr(err, 'msg', err)})") from None
