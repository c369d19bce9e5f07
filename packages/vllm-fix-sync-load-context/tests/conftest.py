from __future__ import annotations

from collections.abc import Iterator

import pytest

from vllm_fix_core import runtime
from vllm_fix_sync_load_context import FIX


@pytest.fixture(autouse=True)
def _unpatched() -> Iterator[None]:
    """Every test starts and ends on unpatched vLLM with no forward context bound."""
    from vllm.forward_context import is_forward_context_available

    runtime.revert(FIX)
    assert not is_forward_context_available()
    yield
    runtime.revert(FIX)
    assert not is_forward_context_available(), "a forward context stayed bound after the test"
