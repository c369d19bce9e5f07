"""Fixtures: vLLM's real MoRIIO modules and workers; stand-ins (vllm_fix_testing) only for
what this machine lacks (MORI, the TP group, the attention-backend lookup)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_fix_testing.moriio_worker import (
    Startup,
    free_port_blocks,
    install_worker_stand_ins,
    kv_cache_config,
    moriio_modules,
    shut_down,
    worker_vllm_config,
)

HANDSHAKE_BASE = 16301
NOTIFY_BASE = 26005


@pytest.fixture(scope="session")
def mods() -> SimpleNamespace:
    return moriio_modules()


@pytest.fixture
def stand_ins(monkeypatch: pytest.MonkeyPatch, mods: SimpleNamespace) -> SimpleNamespace:
    return install_worker_stand_ins(monkeypatch, mods)


@pytest.fixture
def ranks(stand_ins: SimpleNamespace) -> Callable[[int, int], None]:
    """Set this process's (tp_rank, tp_size) as vLLM's TP group would report it."""
    setter: Callable[[int, int], None] = stand_ins.set_ranks
    return setter


@pytest.fixture
def make_worker(mods: SimpleNamespace, ranks: Callable[[int, int], None]) -> Iterator[Callable[..., Any]]:
    """Run the real MoRIIOConnectorWorker.__init__ for rank (dp, tp) of a DP x TP host."""
    made: list[Any] = []

    def make(
        dp: int,
        tp: int,
        dp_local: int,
        tp_size: int,
        *,
        handshake: int = HANDSHAKE_BASE,
        notify: int = NOTIFY_BASE,
        producer: bool = True,
    ) -> Any:
        ranks(tp, tp_size)
        config = worker_vllm_config(
            dp, dp_local, tp_size, handshake=handshake, notify=notify, producer=producer
        )
        worker = mods.connector.MoRIIOConnectorWorker(config, f"engine-dp{dp}", kv_cache_config())
        made.append(worker)
        return worker

    yield make
    for worker in made:
        shut_down(worker)


@pytest.fixture
def engine_core_tp_group(monkeypatch: pytest.MonkeyPatch, mods: SimpleNamespace) -> Callable[[], None]:
    """From here on this process has no TP group, as the engine core that runs the scheduler:
    vLLM's own getters (they raise there) replace the stand-ins of ``ranks``."""

    def enter() -> None:
        from vllm.distributed import parallel_state

        for module in (mods.common, mods.connector):
            for name in ("get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size"):
                if hasattr(module, name):
                    monkeypatch.setattr(module, name, getattr(parallel_state, name))
        with pytest.raises(AssertionError):
            mods.connector.get_tensor_model_parallel_world_size()

    return enter


@pytest.fixture
def free_bases() -> Callable[[int], tuple[int, int]]:
    return free_port_blocks


@pytest.fixture
def startup() -> Callable[[Any], Startup]:
    return Startup
