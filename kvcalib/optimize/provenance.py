"""How a search run records where it lives and what made it, without machine-specific paths.

A recipe or report that says ``/tmp/kvs_demo3`` tells the next reader nothing and leaks the
machine's layout, so search outputs record:

- the run folder relative to the current directory when it lies under it, else its name only
  (:func:`display_path`);
- the storage as a URL with the same path rule and no password (:func:`describe_storage`);
- the command line that made it, with the same rules applied to its arguments
  (:func:`command_line`).
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path
from typing import Sequence

_PASSWORD = re.compile(r"(://[^:/@]+):[^@/]*@")  # scheme://user:password@host


def display_path(path: Path | str, cwd: Path | str | None = None) -> str:
    """``path`` relative to ``cwd`` (default: the current directory) when it lies under it,
    else its last component; POSIX separators."""
    p = Path(path).expanduser()
    base = Path(cwd if cwd is not None else os.getcwd()).resolve()
    full = p if p.is_absolute() else base / p
    full = Path(os.path.normpath(full))
    try:
        rel = full.relative_to(base)
    except ValueError:
        return full.name or str(full)
    return rel.as_posix() if rel.parts else "."


def describe_storage(url: str | None, run_dir: Path | str | None = None, cwd: Path | str | None = None) -> str:
    """A storage URL fit to record: ``study.db`` for the default (``url`` None: the run folder's
    SQLite file), file paths through :func:`display_path`, passwords replaced by ``***``."""
    if url is None:
        return "study.db"
    if url.startswith("sqlite:///"):
        return "sqlite:///" + display_path(url[len("sqlite:///"):], cwd)
    if url.startswith("journal:"):
        return "journal:" + display_path(url[len("journal:"):], cwd)
    if "://" not in url and url.endswith((".log", ".journal")):
        return display_path(url, cwd)
    return _PASSWORD.sub(r"\1:***@", url)


def _arg(token: str, cwd: Path | str | None) -> str:
    if token.startswith("--") and "=" in token:
        flag, _, value = token.partition("=")
        return f"{flag}={_arg(value, cwd)}"
    if "://" in token or token.startswith("journal:"):
        return describe_storage(token, cwd=cwd)
    if token.startswith(("/", "~")):
        return display_path(token, cwd)
    return token


def command_line(argv: Sequence[str] | None = None, cwd: Path | str | None = None) -> str:
    """The command that runs now (``sys.argv``), as a shell line: the program by its name
    (``kvcalib``), absolute paths and storage URLs as :func:`display_path`/:func:`describe_storage`."""
    args = list(sys.argv if argv is None else argv)
    if not args:
        return ""
    prog = Path(args[0]).name
    if prog in ("__main__.py", "cli.py"):  # python -m kvcalib.cli
        prog = "kvcalib"
    return shlex.join([prog, *(_arg(a, cwd) for a in args[1:])])
