"""Fixtures: vLLM's real MoRIIO workers; stand-ins (vllm_fix_testing) only for MORI, the TP
group and the attention-backend lookup."""

from __future__ import annotations

import socket
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


@pytest.fixture(scope="session")
def mods() -> SimpleNamespace:
    return moriio_modules()


@pytest.fixture
def make_worker(monkeypatch: pytest.MonkeyPatch, mods: SimpleNamespace) -> Iterator[Callable[..., Any]]:
    """Run the real MoRIIOConnectorWorker.__init__ for rank (dp, tp) of a DP x TP host."""
    stand_ins = install_worker_stand_ins(monkeypatch, mods)
    made: list[Any] = []

    def make(dp: int, tp: int, dp_local: int, tp_size: int, *, handshake: int, notify: int) -> Any:
        stand_ins.set_ranks(tp, tp_size)
        config = worker_vllm_config(dp, dp_local, tp_size, handshake=handshake, notify=notify)
        worker = mods.connector.MoRIIOConnectorWorker(config, f"engine-dp{dp}", kv_cache_config())
        made.append(worker)
        return worker

    yield make
    for worker in made:
        shut_down(worker)


@pytest.fixture
def held_port() -> Iterator[Callable[[], int]]:
    """A TCP port held by a listener of another party (as a colliding rank would hold it)."""
    socks: list[socket.socket] = []

    def hold() -> int:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("0.0.0.0", 0))
        sock.listen(8)
        socks.append(sock)
        return int(sock.getsockname()[1])

    yield hold
    for sock in socks:
        sock.close()


@pytest.fixture
def free_bases() -> Callable[[int], tuple[int, int]]:
    return free_port_blocks


@pytest.fixture
def startup() -> Callable[[Any], Startup]:
    return Startup
