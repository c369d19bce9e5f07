"""The backport grid carries fixes into a release's sources (minutes per release): it runs only
in its own sessions (``backport-focused-<release>`` in CI, ``backport-<release>`` in full), which
set ``FIXES_BACKPORT=focused`` or ``full``; other sessions that collect ``integration/`` leave it
out."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SIZES = ("focused", "full")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if os.environ.get("FIXES_BACKPORT") in SIZES:
        return None
    return collection_path.name.startswith("test_") or None
