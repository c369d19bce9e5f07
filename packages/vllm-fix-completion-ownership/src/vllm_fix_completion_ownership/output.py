"""Scheduler side: ``update_connector_output`` (body replaced for the fingerprinted shapes)
gives each child a private view of the step output and surfaces R once every owner completed.

One body serves both known shapes: the one that hands each child its own worker metadata
(vLLM 0.18.1+) and the one where every child gets the same output and no worker metadata
(0.14.1-0.17.1, ``VLLM.shared_output``).
"""

from __future__ import annotations

from typing import Any

from vllm_fix_completion_ownership.ledger import SchedulerLedger
from vllm_fix_completion_ownership.state import LEDGER_ATTR, VLLM, ledger_of, logger


def _view(ids: set[str] | None, loaders: dict[str, int], child: int) -> set[str]:
    if not ids:
        return set()
    return {r for r in ids if loaders.get(r, child) == child}


def _apply_view_edits(
    final: set[str],
    view: set[str] | frozenset[str],
    returned: set[str] | None,
    loaders: dict[str, int],
    child: int,
) -> None:
    """A child may hold back or add ids it loads; ids it does not load stay as they are."""
    returned = returned or set()
    for req_id in view - returned:
        if loaders.get(req_id) == child:
            final.discard(req_id)
    for req_id in returned - view:
        if loaders.get(req_id, child) == child:
            final.add(req_id)


def _let_go(ledger: SchedulerLedger, index: int, child: Any, returned: set[str]) -> None:
    """The child handed back `returned` from its view: it lets those ids go; ids it does not
    own are ignored."""
    ignored = ledger.let_go(index, returned)
    if ignored:
        logger.debug(
            "completion-ownership: child %d (%s) reported %s, which it does not own; ignored",
            index,
            type(child).__name__,
            sorted(ignored),
        )


def update_connector_output(self: Any, connector_output: Any) -> None:
    """Each child sees a private view; R is surfaced once all of O(R) completed."""
    ledger = self.__dict__.get(LEDGER_ATTR)
    if ledger is None:
        ledger = ledger_of(self)
    vllm = VLLM
    per_child = not vllm.shared_output
    multi_meta = connector_output.kv_connector_worker_meta if per_child else None
    if multi_meta is not None and not isinstance(multi_meta, vllm.worker_metadata):
        raise AssertionError(f"expected MultiKVConnectorWorkerMetadata, got {type(multi_meta).__name__}")
    incoming = connector_output.finished_sending
    if incoming:
        ledger.note_workers_done(incoming)
    recv = connector_output.finished_recving
    has_failed = vllm.has_failed
    failed = connector_output.failed_recving if has_failed else None
    if recv or failed:
        _update_routed(self, ledger, connector_output, multi_meta, recv, failed)
        return
    # No recv ids this step (nearly every step): each child sees only its own send ids.
    held = ledger.held
    index = 0
    try:
        for child in self._connectors:
            if multi_meta is not None:
                connector_output.kv_connector_worker_meta = multi_meta.metadata[index]
            # A copy (= ledger.view(index), without the call): the child may edit it.
            connector_output.finished_sending = set(held[index]) if held[index] else None
            child.update_connector_output(connector_output)
            returned = connector_output.finished_sending
            if returned:
                _let_go(ledger, index, child, returned)
            if connector_output.finished_recving or (has_failed and connector_output.failed_recving):
                _own_recv_only(self, connector_output, index)
            index += 1
    finally:
        if per_child:
            connector_output.kv_connector_worker_meta = multi_meta
    connector_output.finished_sending = ledger.surface() if ledger.done or ledger.ready else None


def _own_recv_only(self: Any, output: Any, index: int) -> None:
    """A child added recv ids of its own: keep the ones it may report (its own loads, or an
    unknown loader); the children after it see them as vLLM shows them."""
    loaders = self._requests_to_connector
    recv = output.finished_recving
    if recv:
        output.finished_recving = {r for r in recv if loaders.get(r, index) == index} or None
    if VLLM.has_failed and output.failed_recving:
        output.failed_recving = {r for r in output.failed_recving if loaders.get(r, index) == index}


def _update_routed(
    self: Any, ledger: SchedulerLedger, output: Any, multi_meta: Any, recv: Any, failed: Any
) -> None:
    """Recv ids this step: each child also sees only the recv ids it loads (or unknown)."""
    loaders: dict[str, int] = self._requests_to_connector
    has_failed = VLLM.has_failed
    final_recv: set[str] = set(recv) if recv else set()
    final_failed: set[str] = set(failed) if failed else set()
    try:
        for index, child in enumerate(self._connectors):
            if multi_meta is not None:
                output.kv_connector_worker_meta = multi_meta.metadata[index]
            output.finished_sending = ledger.view(index)
            view_recv = _view(recv, loaders, index)
            output.finished_recving = view_recv or None
            if has_failed:
                view_failed = _view(failed, loaders, index)
                output.failed_recving = view_failed
            child.update_connector_output(output)
            returned = output.finished_sending
            if returned:
                _let_go(ledger, index, child, returned)
            _apply_view_edits(final_recv, view_recv, output.finished_recving, loaders, index)
            if has_failed:
                _apply_view_edits(final_failed, view_failed, output.failed_recving, loaders, index)
    finally:
        if VLLM.has_worker_meta:
            output.kv_connector_worker_meta = multi_meta
        output.finished_recving = final_recv or None
        if has_failed:
            output.failed_recving = final_failed
    freed_by_recv = output.finished_recving
    if freed_by_recv and ledger.entries:
        for req_id in freed_by_recv:
            if req_id in ledger.entries:
                # vLLM frees a finished request through its recv path: it must not come
                # back through finished_sending (that would be a second free).
                ledger.release(req_id)
    output.finished_sending = ledger.surface() if ledger.done or ledger.ready else None
