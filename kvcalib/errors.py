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
