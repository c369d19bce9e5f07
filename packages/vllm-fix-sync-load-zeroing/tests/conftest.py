from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_fix_core import runtime
from vllm_fix_sync_load_zeroing import FIX


@pytest.fixture(autouse=True)
def _unpatched() -> Iterator[None]:
    """Every test starts and ends on unpatched vLLM."""
    runtime.revert(FIX)
    yield
    runtime.revert(FIX)


# The probe keeps its coverage facts in a memo under vLLM's cache root (memo.py). No test may
# read a memo an earlier test or run left, nor write into the session's real cache root: every
# module (its module-scoped fixtures and the processes they start included) and every test gets
# a fresh VLLM_CACHE_ROOT.


@pytest.fixture(autouse=True, scope="module")
def _module_cache_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("vllm-cache-module")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_CACHE_ROOT", str(root))
        yield root


@pytest.fixture(autouse=True)
def cache_root(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path_factory.mktemp("vllm-cache")
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(root))
    return root
