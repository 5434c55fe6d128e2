"""Atomic writes (nothing half-written is ever left under a user's chosen name: write to a
temporary sibling, then ``os.replace`` it into place, atomic on POSIX), and reading a
safetensors file that carries a JSON document in its metadata (recipes, coded cache snapshots).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator


@contextlib.contextmanager
def atomic_path(final: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``final``; on success rename it to ``final``.

    Works for files and for folders (the caller creates what it needs at the yielded path).
    On any exception the temporary is removed and ``final`` is untouched.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    tmp_target = tmp / final.name
    try:
        yield tmp_target
        if final.is_dir() and not final.is_symlink():
            backup = final.with_name(f".{final.name}.old")
            shutil.rmtree(backup, ignore_errors=True)
            os.replace(final, backup)
            os.replace(tmp_target, final)
            shutil.rmtree(backup, ignore_errors=True)
        else:
            os.replace(tmp_target, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write ``obj`` as indented JSON to ``path`` atomically."""
    with atomic_path(Path(path)) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


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
    except (json.JSONDecodeError, TypeError) as err:
        raise error_cls(f"{what} {path}: its metadata is not valid JSON ({getattr(err, 'msg', err)})") from None
