"""Does this vLLM's MoRIIO READ consumer swallow hybrid READ failures and timeouts?

Drives the real, installed ``MoRIIOConnectorWorker.get_finished`` (which calls
``_pop_done_transfers``) on workers built with ``__new__`` plus the attributes the READ
path reads, as vLLM's own MoRIIO tests build them. The wrapper is vLLM's own
``MoRIIOWrapper`` (its real lock discipline and ``poll_transfer_batch``), with only its
socket send and shutdown recorded on the instance. The one thing this machine cannot
provide is a MORI transfer status (the native engine is absent), so the probe carries
the minimal stand-in for one: four answers, frozen.

Nothing global is changed: no clock is patched (a timed-out transfer is one whose start
lies far in the past), no socket is opened, and the error lines the scenarios make
vLLM (and the fix) log are filtered out for the probe's own request id only, with the
filter removed afterwards.

A vLLM without hybrid (attention + Mamba/KDA) READ has no code this bug can live in:
the probe says "not applicable" there.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from vllm_fix_core import Check, NotApplicable, ProbeReport

REQ = "vllm-fix-probe-read-failure-ownership"
XFER = "vllm-fix-probe-xfer"
BLOCKS = [7, 8]
TIMEOUT = 120.0
FIX_LOGGER = "vllm.fixes.read-failure-ownership"
# The worker method that posts the Mamba/KDA state READs: present exactly where vLLM
# has hybrid READ (0.31.0 on).
HYBRID_READ = "_post_mamba_reads"


class FrozenStatus:
    """A MORI transfer status frozen in one state (what vLLM's poll asks of it)."""

    __slots__ = ("state",)

    def __init__(self, state: str) -> None:
        self.state = state

    def Succeeded(self) -> bool:
        return self.state == "done"

    def Failed(self) -> bool:
        return self.state == "failed"

    def Message(self) -> str:
        return "probe: injected failure"

    def Code(self) -> int:
        return -1


def _wrapper(wrapper_cls: Any, sent: list[str | None]) -> Any:
    """vLLM's own MoRIIOWrapper, without its engine: a real lock, the real poll, and
    ``send_notify`` / ``shutdown`` recorded on the instance instead of a socket."""
    wrapper = wrapper_cls.__new__(wrapper_cls)
    wrapper.lock = threading.Lock()
    wrapper.send_notify = lambda *args, message_type=None, **kwargs: sent.append(message_type)
    wrapper.shutdown = lambda: None
    return wrapper


@dataclass(frozen=True)
class Outcome:
    raised: str  # exception class name, "" if none
    releases: int
    tracked: bool  # every tracking dict still holds the transfer
    forgotten: bool  # no tracking dict holds it any more
    reported: frozenset[int]


def _modules() -> tuple[Any, Any]:
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector as mc
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_engine as me

    return mc, me


def holder_ports(worker_cls: Any) -> Any:
    """Callback-address ports: one per holder TP rank where vLLM releases every holder."""
    return ("7000", "7001") if hasattr(worker_cls, "_send_read_release") else "7000"


def run(states: list[str], *, hybrid: bool, age: float) -> Outcome:
    mc, me = _modules()
    cls = mc.MoRIIOConnectorWorker
    worker = cls.__new__(cls)
    sent: list[str | None] = []
    wrapper = _wrapper(me.MoRIIOWrapper, sent)
    worker.is_producer = False
    worker.mode = mc.MoRIIOMode.READ
    worker.world_size = 1
    worker._has_mamba = hybrid
    worker.moriio_config = SimpleNamespace(recv_abort_timeout=TIMEOUT)
    worker.moriio_wrapper = wrapper
    worker.transfer_id_to_request_id = {XFER: REQ}
    worker._recving_transfers = {REQ: {"attn0": [FrozenStatus(s) for s in states]}}
    worker._recving_transfers_callback_addr = {REQ: ("127.0.0.1", holder_ports(cls), XFER)}
    worker._recving_transfers_start = {REQ: time.monotonic() - age}
    worker._recving_local_blocks = {REQ: list(BLOCKS)}
    worker._invalid_block_ids = set()
    raised = ""
    try:
        worker.get_finished()
    except Exception as exc:
        raised = type(exc).__name__
    tracking = (
        worker._recving_transfers,
        worker._recving_transfers_callback_addr,
        worker._recving_transfers_start,
        worker._recving_local_blocks,
    )
    return Outcome(
        raised=raised,
        releases=sent.count("release"),
        tracked=all(REQ in d for d in tracking),
        forgotten=not any(REQ in d for d in tracking),
        reported=frozenset(worker._invalid_block_ids),
    )


class _OnlyOtherRequests(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        try:
            text = record.getMessage()
        except Exception:
            return True
        return REQ not in text


@contextmanager
def _quiet(*loggers: logging.Logger) -> Iterator[None]:
    flt = _OnlyOtherRequests()
    for lg in loggers:
        lg.addFilter(flt)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(flt)


def probe() -> ProbeReport:
    mc, _ = _modules()
    if not hasattr(mc.MoRIIOConnectorWorker, HYBRID_READ):
        raise NotApplicable(
            "this vLLM's MoRIIO has no hybrid (attention + Mamba/KDA) READ "
            f"(MoRIIOConnectorWorker.{HYBRID_READ} is absent); the bug lives there"
        )
    holders = 2 if isinstance(holder_ports(mc.MoRIIOConnectorWorker), tuple) else 1
    failed_closed = Outcome("TransferError", 0, True, False, frozenset())
    with _quiet(mc.logger, logging.getLogger(FIX_LOGGER)):
        failure = run(["failed", "pending"], hybrid=True, age=1.0)
        timeout = run(["pending"], hybrid=True, age=TIMEOUT * 100)
        success = run(["done", "done"], hybrid=True, age=1.0)
        waiting = run(["pending"], hybrid=True, age=1.0)
        attention = run(["failed", "pending"], hybrid=False, age=1.0)
    return ProbeReport(
        (
            Check("hybrid-failure-fails-open", failure != failed_closed, f"{failure}"),
            Check("hybrid-timeout-fails-open", timeout != failed_closed, f"{timeout}"),
            # Guards: behaviours the fix must keep.
            Check(
                "hybrid-success-releases-once",
                success != Outcome("", holders, False, True, frozenset()),
                f"{success}",
                guard=True,
            ),
            Check(
                "pending-read-waits",
                waiting != Outcome("", 0, True, False, frozenset()),
                f"{waiting}",
                guard=True,
            ),
            Check(
                "attention-failure-recovers",
                attention != Outcome("", holders, False, True, frozenset(BLOCKS)),
                f"{attention}",
                guard=True,
            ),
        )
    )
