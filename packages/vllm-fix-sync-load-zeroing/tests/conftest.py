from __future__ import annotations

from collections.abc import Iterator

import pytest

from vllm_fix_core import runtime
from vllm_fix_sync_load_zeroing import FIX


@pytest.fixture(autouse=True)
def _unpatched() -> Iterator[None]:
    """Every test starts and ends on unpatched vLLM."""
    runtime.revert(FIX)
    yield
    runtime.revert(FIX)
