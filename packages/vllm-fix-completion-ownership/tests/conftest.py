"""Shared fixtures for vllm-fix-completion-ownership (tests run on real vLLM)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from vllm_fix_completion_ownership import FIX


@pytest.fixture
def patched() -> Iterator[object]:
    """The fix applied in strict mode for one test, reverted afterwards."""
    from vllm_fix_testing import applied

    with applied(FIX) as decision:
        yield decision
