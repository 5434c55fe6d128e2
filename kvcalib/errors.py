"""The one error type kvcalib raises for problems a user can fix.

The CLI turns a :class:`KvcalibError` into one line on stderr and exit code 2 (no traceback).
Library callers catch it like any exception. The message always names the problem and the fix.
"""

from __future__ import annotations

import errno as errno_
import os
import re


class KvcalibError(Exception):
    """A problem with the user's input or environment (bad flag, missing file, wrong model...).

    ``str(err)`` is a complete sentence naming what is wrong and what to do about it.
    """


class StorageFailed(KvcalibError):
    """A study storage that failed mid-search. ``problem`` names what failed and what is kept,
    without the advice on how to go on, which the command line replaces with the exact command."""

    def __init__(self, problem: str, how_to_go_on: str) -> None:
        super().__init__(f"{problem}; {how_to_go_on}")
        self.problem = problem


class CalibrationError(KvcalibError, ValueError):
    """Calibration input that cannot be fitted (wrong shapes, empty reservoir, NaN/inf...).

    Both a :class:`KvcalibError` (the CLI prints it as one line) and a ``ValueError`` (what the
    quantization core raises for bad arguments), so callers may catch either. It lives here, below
    the methods, because the reservoir helpers the methods share (:mod:`kvcalib.reservoir`,
    :mod:`kvcalib.quant.transforms`) raise it too.
    """


class RecipeError(KvcalibError):
    """A recipe file is corrupt, truncated, of another schema version or for another model."""


class OfflineError(KvcalibError):
    """Something had to come from a hub that this machine cannot reach."""


def _chain(err: BaseException) -> list[BaseException]:
    """``err`` and what it was raised from; the error it was raised while handling only when
    Optuna raised it (its trial bookkeeping fails with an AssertionError or UnboundLocalError
    when the storage broke, or Ctrl-C landed, under it): a bug of ours raised while handling an
    OSError stays a bug."""
    chain: list[BaseException] = []
    current: BaseException | None = err
    while current is not None and all(current is not seen for seen in chain):
        chain.append(current)
        current = current.__cause__ or (current.__context__ if _raised_in(current, "optuna") else None)
    return chain


def interrupted(err: BaseException) -> bool:
    """Whether ``err`` is, or was raised by Optuna while handling, a Ctrl-C."""
    return any(isinstance(e, KeyboardInterrupt) for e in _chain(err))


# modules whose errors are a study storage failing: SQLAlchemy (Optuna's RDB storage), the database
# drivers under it, sqlite3; and Optuna's own StorageInternalError (by name: nothing imported here)
STORAGE_ERROR_MODULES = ("sqlalchemy", "psycopg", "pymysql", "MySQLdb", "sqlite3")


def innermost_storage_error(chain: list[BaseException]) -> BaseException | None:
    """The innermost study-storage error of an exception ``chain`` (outermost first), or None:
    the one classifier the command line (:func:`environment_error`) and the search's
    mid-search handler (:func:`kvcalib.optimize.study.storage_errors`) share."""
    for e in reversed(chain):
        if type(e).__module__.startswith(STORAGE_ERROR_MODULES) or type(e).__name__ == "StorageInternalError":
            return e
    return None


def environment_error(err: BaseException) -> str | None:
    """One line for an error of the user's environment that reached the command line (a write to a
    full or read-only disk, a file that vanished, a study database that went away), naming the
    problem and the fix; None for anything else, which is a bug and keeps its traceback.

    Third-party error types are recognised by name, so this module imports none of them:
    SQLAlchemy's, the database drivers' and sqlite3's errors (Optuna's RDB storage, PostgreSQL
    included), Optuna's ``StorageInternalError``, torch's ``OutOfMemoryError`` (and Python's
    ``MemoryError``), and safetensors' I/O errors (it reports a full disk as ``SafetensorError: ... IoError``).
    """
    chain = _chain(err)
    for e in chain:  # the most specific first: an OS error names the path
        if isinstance(e, OSError):
            return os_error_line(e)
    inner = innermost_storage_error(chain)  # the driver's own words ("database or disk is full") beat Optuna's
    if inner is not None:
        first = (str(inner).strip().splitlines() or [type(inner).__name__])[0][:200]
        if "disk is full" in first or "No space left" in first:
            return "no space left on the device holding the study's database: free some space"
        return (f"the study storage failed ({type(inner).__name__}: {first}): check that its database file or server "
                "is reachable, readable and has space")
    for e in chain:  # torch.OutOfMemoryError (a GPU's) or Python's MemoryError (the host's)
        if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            first = first.split(". GPU ")[0][:160] or type(e).__name__  # torch's line goes on about the allocator
            return (f"out of memory ({first}): the context or batch does not fit this machine: use a shorter "
                    "context (--ppl-seq-len, --eval-seq-len, --score-seq-len, --context), fewer rows a batch, or a "
                    "device with more memory; nothing half-written was kept")
    for e in chain:  # safetensors' I/O errors, read by the one classifier of write failures (storage_failure)
        if type(e).__name__ == "SafetensorError":
            reason = storage_failure(e)
            if reason is not None:
                return f"writing a safetensors file failed: {reason}"
    return None


def _raised_in(err: BaseException, package: str) -> bool:
    """Whether the innermost frame of ``err``'s traceback is in ``package``'s source."""
    import os

    tb = err.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return f"{os.sep}{package}{os.sep}" in tb.tb_frame.f_code.co_filename


def os_error_line(err: OSError) -> str:
    """An OSError as one line: what failed on which path, and the fix."""
    import errno as errno_

    path = err.filename if err.filename is not None else None
    where = f" ({path})" if path is not None else ""
    fixes = {
        errno_.ENOSPC: "no space left on the device: free some space, or write to another disk",
        errno_.EDQUOT: "the disk quota is exhausted: free some space, or write to another disk",
        errno_.EROFS: "the file system is read-only: write to another place",
        errno_.EACCES: "permission denied: write to a place you own, or fix its permissions",
        errno_.EPERM: "operation not permitted: write to a place you own, or fix its permissions",
        errno_.ENOENT: "no such file or folder: check the path (was it moved or deleted while kvcalib ran?)",
        errno_.EISDIR: "it is a folder, not a file: pass a file path",
        errno_.ENOTDIR: "a part of the path is a file, not a folder: check the path",
        errno_.EIO: "the disk reported an I/O error: check the device",
    }
    fix = fixes.get(err.errno, f"{err.strerror or type(err).__name__}: check the path and its disk")
    return f"{fix}{where}"


# the classifier of write failures, here so that kvcalib.io (the one write path) and the command
# line's error mapping share it without importing each other
_OS_ERROR = re.compile(r"os error (\d+)|code: (\d+)")  # safetensors' words for the errno, new and old


def storage_failure(err: BaseException) -> str | None:
    """What failed, as the fix a user needs, when ``err`` (or what it was raised from) is a
    storage failure: an OSError, or a safetensors I/O error; None for anything else."""
    seen: list[BaseException] = []
    current: BaseException | None = err
    while current is not None and all(current is not e for e in seen):  # raised from, not while handling:
        seen.append(current)  # a bug of ours raised while handling an OSError stays a bug
        current = current.__cause__
    for e in seen:
        if isinstance(e, OSError):
            return os_error_line(OSError(e.errno, e.strerror))  # the path is the caller's, not a temporary's
    for e in seen:
        text = str(e)
        if type(e).__name__ == "SafetensorError" and ("I/O error" in text or "IoError" in text):
            match = _OS_ERROR.search(text)
            if match is not None:
                code = int(match.group(1) or match.group(2))
                return os_error_line(OSError(code, os.strerror(code)))
            if "StorageFull" in text or "No space left" in text:
                return os_error_line(OSError(errno_.ENOSPC, os.strerror(errno_.ENOSPC)))
            first = (text.strip().splitlines() or ["SafetensorError"])[0][:200]
            return f"{first}: check the output path and its disk"
    return None
