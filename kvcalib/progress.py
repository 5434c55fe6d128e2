"""Progress display for long work: rich bars and spinners on stderr.

Everything goes to stderr so stdout stays clean for tables and JSON. Set ``KVCALIB_QUIET=1`` to
silence progress (tests do).
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator


def _quiet() -> bool:
    return os.environ.get("KVCALIB_QUIET", "") not in ("", "0")


def console():
    """The shared stderr console."""
    from rich.console import Console

    return Console(stderr=True)


@contextlib.contextmanager
def status(message: str) -> Iterator[None]:
    """A spinner with ``message`` while the block runs."""
    if _quiet():
        yield
        return
    with console().status(message):
        yield


class _NullBar:
    def advance(self, n: float = 1, **fields) -> None:  # noqa: D401 - mirrors ProgressBar
        pass

    def update(self, **fields) -> None:
        pass


class ProgressBar:
    """``with ProgressBar(total, "collect") as bar: bar.advance()``; extra text via ``update``."""

    def __init__(self, total: float | None, description: str, unit: str = "") -> None:
        self.total, self.description, self.unit = total, description, unit
        self._progress = None
        self._task = None

    def __enter__(self):
        if _quiet():
            return _NullBar()
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn,
                                   TextColumn, TimeElapsedColumn, TimeRemainingColumn)

        self._progress = Progress(
            SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(),
            MofNCompleteColumn(), TextColumn(self.unit), TimeElapsedColumn(), TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"), console=console(), transient=False,
        )
        self._progress.__enter__()
        self._task = self._progress.add_task(self.description, total=self.total, info="")
        return self

    def advance(self, n: float = 1, **fields) -> None:
        self._progress.update(self._task, advance=n, **({"info": fields["info"]} if "info" in fields else {}))

    def update(self, **fields) -> None:
        self._progress.update(self._task, **fields)

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)
