"""The rule alone (no vLLM): which configs ask for port 0, what the worker adopts."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_fix_listener_port.rule import (
    ListenerPortError,
    adopt_native_port,
    let_native_engine_choose,
    native_port,
)
from vllm_fix_testing.mori_io import EngineDesc


class Engine:
    def __init__(self, port: Any) -> None:
        self.port = port

    def get_engine_desc(self) -> EngineDesc:
        return EngineDesc("k", "127.0.0.1", self.port)


def _worker(backend: str, engine: Any, port: int = 12345) -> Any:
    config = SimpleNamespace(backend=backend, local_kv_port=port)
    return SimpleNamespace(moriio_config=config, moriio_engine=engine, local_kv_port=port)


@given(st.sampled_from(["rdma", "RDMA", "Rdma"]), st.integers(1, 65535))
def test_rdma_asks_for_zero(backend: str, port: int) -> None:
    config = SimpleNamespace(backend=backend, local_kv_port=port, local_ping_port=port)
    assert let_native_engine_choose(config) is config
    assert config.local_kv_port == 0
    assert config.local_ping_port == port


@given(st.integers(1, 65535))
def test_xgmi_untouched(port: int) -> None:
    config = SimpleNamespace(backend="xgmi", local_kv_port=port)
    let_native_engine_choose(config)
    assert config.local_kv_port == port
    assert adopt_native_port(_worker("xgmi", Engine(0), port)) is None


@given(st.integers(1, 65535))
def test_adopts_the_bound_port(port: int) -> None:
    worker = _worker("rdma", Engine(port), 0)
    assert adopt_native_port(worker) == port
    assert worker.local_kv_port == worker.moriio_config.local_kv_port == port


def test_port_zero_is_a_clear_error() -> None:
    worker = _worker("rdma", Engine(0), 0)
    with pytest.raises(ListenerPortError, match=r"reports listen port 0.*VLLM_FIXES_DISABLE=listener-port"):
        adopt_native_port(worker)
    assert worker.local_kv_port == 0  # nothing half-done


@pytest.mark.parametrize("bad", [None, -1, 70000, "5000", True])
def test_invalid_descriptor_port(bad: Any) -> None:
    with pytest.raises(ListenerPortError, match="no valid port"):
        native_port(Engine(bad))


def test_missing_engine_or_descriptor() -> None:
    with pytest.raises(ListenerPortError, match="no native engine"):
        native_port(None)
    with pytest.raises(ListenerPortError, match="get_engine_desc"):
        native_port(object())
