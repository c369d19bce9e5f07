"""The fix's state: where each connector's ledger / gate lives, and what apply() learned.

The ledger (scheduler side) and the gate (worker side) are instance attributes of the
MultiConnector they serve; :data:`VLLM` is the one module-level object, filled by
``patch.apply`` from the installed vLLM and read by the replaced bodies at every step.
"""

from __future__ import annotations

from typing import Any

from vllm_fix_completion_ownership.gate import WorkerGate
from vllm_fix_completion_ownership.ledger import SchedulerLedger
from vllm_fix_core import get_logger

LEDGER_ATTR = "_vllm_fix_co_ledger"
GATE_ATTR = "_vllm_fix_co_gate"
WARNED_ATTR = "_vllm_fix_co_warned"

logger = get_logger("completion-ownership")


class Learned:
    """What ``patch.apply`` found in the installed vLLM (its classes, the originals the fix
    falls back to, the KVConnectorOutput fields it has)."""

    __slots__ = (
        "get_finished",
        "get_transfer_results",
        "has_failed",
        "has_worker_meta",
        "metadata",
        "multi_connector",
        "shared_output",
        "transfer_results",
        "worker_metadata",
    )

    def __init__(self) -> None:
        self.has_failed = True  # KVConnectorOutput.failed_recving exists (vLLM 0.30.0+)
        self.has_worker_meta = True  # KVConnectorOutput.kv_connector_worker_meta exists (0.18.1+)
        # update_connector_output hands every child the same output (vLLM 0.14.1-0.17.1)
        self.shared_output = False
        self.multi_connector: Any = None  # MultiConnector
        self.metadata: Any = None  # MultiKVConnectorMetadata
        self.worker_metadata: Any = None  # MultiKVConnectorWorkerMetadata (None before 0.18.1)
        self.transfer_results: Any = None  # KVConnectorTransferResults (0.30.0+)
        self.get_transfer_results: Any = None  # vLLM's original (0.30.0+)
        self.get_finished: Any = None  # vLLM's original (0.14.1-0.29.0)


VLLM = Learned()


def ledger_of(connector: Any) -> SchedulerLedger:
    state = connector.__dict__
    ledger = state.get(LEDGER_ATTR)
    if ledger is None:
        ledger = state[LEDGER_ATTR] = SchedulerLedger(len(connector._connectors))
    return ledger  # type: ignore[no-any-return]


def gate_of(connector: Any) -> WorkerGate | None:
    return connector.__dict__.get(GATE_ATTR)  # type: ignore[no-any-return]


def new_gate(connector: Any) -> WorkerGate:
    gate = connector.__dict__[GATE_ATTR] = WorkerGate()
    return gate
