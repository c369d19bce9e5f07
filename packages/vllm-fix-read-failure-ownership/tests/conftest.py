"""Real vLLM MoRIIO READ workers (built with __new__) around the MORI stand-in."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_fix_testing import FakeStatus, FakeWrapper

NOW = 1000.0
TIMEOUT = 120.0
HOST = "10.0.0.1"


def mc() -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector

    return moriio_connector


def holder_ports() -> Any:
    """What this release's _read_blocks stores as callback port(s).

    0.33.0 keeps a tuple of notify ports, one per holder prefill TP rank, and
    releases through _send_read_release; 0.32.0 keeps a single port string."""
    if hasattr(mc().MoRIIOConnectorWorker, "_send_read_release"):
        return ("7000", "7001")
    return "7000"


def holders() -> list[str]:
    ports = holder_ports()
    return list(ports) if isinstance(ports, tuple) else [ports]


@dataclass
class Read:
    """One tracked READ transfer on the decode worker."""

    req_id: str
    xfer_id: str
    blocks: list[int]
    statuses: dict[str, list[FakeStatus]] = field(default_factory=dict)


@dataclass
class Harness:
    worker: Any
    wrapper: FakeWrapper

    def finish(self) -> BaseException | None:
        """Call the real get_finished; return what it raised (None if nothing)."""
        try:
            self.worker.get_finished()
        except Exception as exc:
            return exc
        return None

    def releases(self) -> list[tuple[Any, Any]]:
        return self.wrapper.releases()

    def tracked(self, req_id: str) -> dict[str, bool]:
        w = self.worker
        return {
            "transfers": req_id in w._recving_transfers,
            "callback": req_id in w._recving_transfers_callback_addr,
            "start": req_id in w._recving_transfers_start,
            "blocks": req_id in w._recving_local_blocks,
        }

    def add(self, read: Read, started: float) -> None:
        w = self.worker
        w.transfer_id_to_request_id[read.xfer_id] = read.req_id
        w._recving_transfers[read.req_id] = read.statuses
        w._recving_transfers_callback_addr[read.req_id] = (HOST, holder_ports(), read.xfer_id)
        w._recving_transfers_start[read.req_id] = started
        w._recving_local_blocks[read.req_id] = list(read.blocks)


def build_worker(*, hybrid: bool, timeout: float = TIMEOUT) -> Harness:
    m = mc()
    cls = m.MoRIIOConnectorWorker
    worker = cls.__new__(cls)
    wrapper = FakeWrapper()
    worker.is_producer = False
    worker.mode = m.MoRIIOMode.READ
    worker.world_size = 1
    worker._has_mamba = hybrid
    worker.moriio_config = SimpleNamespace(recv_abort_timeout=timeout)
    worker.moriio_wrapper = wrapper
    worker.transfer_id_to_request_id = {}
    worker._recving_transfers = {}
    worker._recving_transfers_callback_addr = {}
    worker._recving_transfers_start = {}
    worker._recving_local_blocks = {}
    worker._invalid_block_ids = set()
    return Harness(worker, wrapper)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Callable[[float], None]:
    """Pin time.monotonic (vLLM's module and ours both read it through `time`)."""
    now = [NOW]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])

    def set_now(value: float) -> None:
        now[0] = value

    return set_now


@pytest.fixture(scope="session")
def kit() -> SimpleNamespace:
    """The helpers above, for test modules (importlib import mode cannot import conftest)."""
    return SimpleNamespace(
        mc=mc,
        Read=Read,
        build_worker=build_worker,
        holder_ports=holder_ports,
        holders=holders,
        NOW=NOW,
        TIMEOUT=TIMEOUT,
        HOST=HOST,
    )
