"""The integration tests are the slow tier (pyproject.toml's ``slow`` marker): the real embedded
model at full depth, subprocesses of the real command, a built wheel. `make test` (CI) runs
them with the rest; `make test-quick` leaves them out."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(str(item.fspath)).resolve().parent == HERE:
            item.add_marker(pytest.mark.slow)
