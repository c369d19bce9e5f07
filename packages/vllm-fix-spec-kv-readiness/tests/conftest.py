from __future__ import annotations

from collections.abc import Iterator

import pytest

from vllm_fix_core import runtime
from vllm_fix_spec_kv_readiness import FIX


@pytest.fixture(autouse=True)
def _unpatched() -> Iterator[None]:
    """Every test starts and ends on unpatched vLLM."""
    runtime.revert(FIX)
    yield
    runtime.revert(FIX)
