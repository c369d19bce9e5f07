"""The drift drill runs vLLM's newest release's tree several times in child processes (minutes):
it runs only in its own sessions (``drift-focused-<newest>`` in CI, ``drift-<newest>`` in full),
which set ``FIXES_DRIFT=focused`` or ``full``; other sessions that collect ``integration/`` leave
it out."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SIZES = ("focused", "full")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if os.environ.get("FIXES_DRIFT") in SIZES:
        return None
    return collection_path.name.startswith("test_") or None
