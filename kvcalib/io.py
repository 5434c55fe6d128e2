"""Atomic writes: nothing half-written is ever left under a user's chosen name.

Write to a temporary sibling, then ``os.replace`` it into place (atomic on POSIX).
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
