"""The one error type kvcalib raises for problems a user can fix.

The CLI turns a :class:`KvcalibError` into one line on stderr and exit code 2 (no traceback).
Library callers catch it like any exception. The message always names the problem and the fix.
"""

from __future__ import annotations


class KvcalibError(Exception):
    """A problem with the user's input or environment (bad flag, missing file, wrong model...).

    ``str(err)`` is a complete sentence naming what is wrong and what to do about it.
    """


class RecipeError(KvcalibError):
    """A recipe file is corrupt, truncated, of another schema version or for another model."""


class OfflineError(KvcalibError):
    """Something had to come from a hub that this machine cannot reach."""


def environment_error(err: BaseException) -> str | None:
    """One line for an error of the user's environment that reached the command line (a write to a
    full or read-only disk, a file that vanished, a study database that went away), naming the
    problem and the fix; None for anything else, which is a bug and keeps its traceback.

    Third-party error types are recognised by name, so this module imports none of them:
    SQLAlchemy's and sqlite3's errors (Optuna's RDB storage), Optuna's ``StorageInternalError``,
    and safetensors' I/O errors (it reports a full disk as ``SafetensorError: ... IoError``).
    """
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:  # the error, then what it was raised from
        seen.add(id(current))
        if isinstance(current, OSError):
            return os_error_line(current)
        kind, module = type(current).__name__, type(current).__module__
        first = (str(current).strip().splitlines() or [kind])[0][:200]
        if module.startswith(("sqlalchemy", "sqlite3")) or kind == "StorageInternalError":
            return (f"the study storage failed ({kind}: {first}): check that its database file or server is "
                    "reachable, readable and has space; the trials it finished before are kept in it")
        if kind == "SafetensorError" and "IoError" in str(current):
            full = "StorageFull" in str(current) or "No space left" in str(current)
            return ("writing a safetensors file failed: " + ("no space left on the device: free some space or write "
                    "to another disk" if full else f"{first}: check the output path and its disk"))
        current = current.__cause__  # not __context__: a bug raised while handling an OSError is a bug
    return None


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
