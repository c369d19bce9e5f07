"""The disaggregated pair starts real engines (minutes on two cores): it runs only in its own
sessions (``disagg-focused-0.32.0`` in CI, ``disagg-0.32.0`` in full), which set
``FIXES_DISAGG=focused`` or ``full``; other sessions that collect ``integration/`` leave it out."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SIZES = ("focused", "full")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if os.environ.get("FIXES_DISAGG") in SIZES:
        return None
    return collection_path.name.startswith("test_") or None
