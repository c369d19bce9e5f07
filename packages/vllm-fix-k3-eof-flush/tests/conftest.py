"""Fixtures for the k3-eof-flush tests (real vLLM, in-memory K3 tokenizer, no hub)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def k3() -> object:
    """Import the real K3 parser module (the fix's trigger) once."""
    import vllm.parser.kimi_k3

    return vllm.parser.kimi_k3


@pytest.fixture(scope="session")
def chat(k3: object, tmp_path_factory: pytest.TempPathFactory) -> object:
    """vLLM's real OpenAI chat server (Kimi K3 parsers) over a scripted engine stand-in."""
    from vllm_fix_testing.kimi_k3 import K3Chat

    return K3Chat(tmp_path_factory.mktemp("kimi-k3-standin"))


@pytest.fixture
def patched(k3: object) -> Iterator[object]:
    """The fix applied in strict mode for one test, reverted afterwards."""
    from vllm_fix_k3_eof_flush import FIX
    from vllm_fix_testing import applied

    with applied(FIX) as decision:
        yield decision


@pytest.fixture
def unpatched(k3: object) -> None:
    """Make sure the fix is not applied (a previous test reverted it)."""
    from vllm_fix_core import layers_of, runtime
    from vllm_fix_k3_eof_flush import FIX

    runtime.revert(FIX)
    assert layers_of(k3.KimiK3Parser, "parse_delta") == []  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def patched_module(k3: object) -> Iterator[object]:
    """The fix applied in strict mode for a whole module (hypothesis tests)."""
    from vllm_fix_k3_eof_flush import FIX
    from vllm_fix_testing import applied

    with applied(FIX) as decision:
        yield decision
