"""Apply: owner-set completion tracking on vLLM's MultiConnector.

Scheduler side (engine-core process):

* ``_aggregate_request_finished`` (vLLM 0.21.0+; re-implemented or wrapped) records which
  children asked to hold R's blocks; on older MultiConnectors (0.14.1-0.20.2), where
  ``request_finished`` counts the children itself, that body is replaced for its
  fingerprint instead. Together with ``register_finished_partial_tail`` acceptors (body
  replaced for the fingerprinted shape: the original only returns ``any(...)``) that is O(R).
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
    EMPTY_UPDATE,
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

# Normalized-AST fingerprints (vllm_fix_core.ast_fingerprint) of the bodies this fix replaces.
# A body is replaced only when its fingerprint is one of these: replacing code we have not
# read could drop whatever a newer vLLM added there. The methods the fix only wraps are
# checked structurally (signature plus the one statement the wrapper relies on).
REPLACED_KNOWN: dict[str, frozenset[str]] = {
    # 0.18.1-0.33.0 (each child gets its own worker metadata); 0.14.1-0.17.1 (SHARED_OUTPUT)
    "update_connector_output": frozenset({"de11883c83c8f2f0", "79dbaa4afe65ad68"}),
    # 0.14.1-0.20.2: request_finished counts the children itself (no _aggregate_request_finished)
    "request_finished": frozenset({"37d9b9269e5279c1"}),
    # vLLM 0.30.0-0.33.0
    "register_finished_partial_tail": frozenset({"426193006a217f78"}),
    "get_transfer_results": frozenset({"7123931bde7366b2"}),
    # vLLM 0.14.1-0.29.0: get_finished counts the children's reports itself
    "get_finished": frozenset({"6ac38285a88fad53"}),
}
# update_connector_output bodies that hand every child the same output, with no per-child
# worker metadata (vLLM 0.14.1-0.17.1, whose KVConnectorOutput has no kv_connector_worker_meta).
SHARED_OUTPUT_KNOWN = frozenset({"79dbaa4afe65ad68"})
# Called every step (scheduler / each worker): their bodies are replaced where the
# fingerprint is known (identical in 0.24.0-0.33.0), which saves a wrapper call per step;
# any other shape that passes the structural check is wrapped instead.
PER_STEP_KNOWN: dict[str, frozenset[str]] = {
    "build_connector_meta": frozenset({"470e5419a221ef57"}),
    "bind_connector_metadata": frozenset({"8be0274e5521afa2"}),
    # per finished / newly scheduled request; 0.25.1-0.33.0 (0.21.0-0.24.0's
    # _aggregate_request_finished refuses a second kv_transfer_params: wrapped there)
    "_aggregate_request_finished": frozenset({"b2cef0b6d02a5514"}),
    "get_num_new_matched_tokens": frozenset({"c843512372e3d720"}),
}
# The shape recognize() returns is the worker side, plus "+"-joined scheduler-side parts where
# the MultiConnector is older than 0.21.0. All release-specific knowledge of this fix is here:
#
#   vLLM            shape                                        replaced on top of the common set
#   0.30.0-0.33.0   transfer-results                             get_transfer_results, register_..._tail
#   0.21.0-0.29.0   get-finished                                 get_finished
#   0.18.1-0.20.2   get-finished+request-finished                get_finished, request_finished
#   0.14.1-0.17.1   get-finished+request-finished+shared-output  the same; update_connector_output
#                                                                without per-child worker metadata
#
# (common set: update_connector_output, build_connector_meta, bind_connector_metadata,
# get_num_new_matched_tokens, and _aggregate_request_finished where it exists.)
TRANSFER_RESULTS = "transfer-results"  # 0.30.0+: get_finished delegates to get_transfer_results
GET_FINISHED = "get-finished"  # 0.14.1-0.29.0: get_finished aggregates the children's get_finished
REQUEST_FINISHED = "request-finished"  # 0.14.1-0.20.2: request_finished counts the children itself
SHARED_OUTPUT = "shared-output"  # 0.14.1-0.17.1: one output for all children, no worker metadata
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
        ledger = state[LEDGER_ATTR] = SchedulerLedger(len(connector._connectors))
    return ledger  # type: ignore[no-any-return]


def gate_of(connector: Any) -> WorkerGate | None:
    return connector.__dict__.get(GATE_ATTR)  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------- shapes
def _params(func: Any) -> list[str]:
    return list(inspect.signature(func).parameters)


def _source(func: Any) -> str:
    return inspect.getsource(inspect.unwrap(func))


def _require_known(cls: Any, name: str) -> None:
    found = ast_fingerprint(cls.__dict__[name])
    if found not in REPLACED_KNOWN[name]:
        raise UnknownShape(
            f"MultiConnector.{name} changed (fingerprint {found}, known {sorted(REPLACED_KNOWN[name])}); "
            "its body would be replaced, so only a known shape is accepted"
        )


# Wrapped methods: signature and the statement the wrapper relies on.
_STRUCTURE = {
    "build_connector_meta": (["self", "scheduler_output"], "MultiKVConnectorMetadata("),
    "bind_connector_metadata": (["self", "connector_metadata"], "c.bind_connector_metadata("),
    "get_num_new_matched_tokens": (
        ["self", "request", "num_computed_tokens"],
        "self._requests_to_connector[request.request_id] = i",
    ),
    "_aggregate_request_finished": (["self", "request", "per_connector_fn"], "per_connector_fn(c)"),
}


def recognize() -> str:
    """The shape (see the table above: the worker side, plus the older scheduler-side parts),
    or UnknownShape."""
    mod = _module()
    cls = mod.MultiConnector
    meta_cls = mod.MultiKVConnectorMetadata
    fields = [f.name for f in dataclasses.fields(meta_cls)] if dataclasses.is_dataclass(meta_cls) else None
    if fields != META_FIELDS or "__slots__" in meta_cls.__dict__:
        raise UnknownShape(f"MultiKVConnectorMetadata fields are {fields}, expected {META_FIELDS}")
    older: list[str] = []
    if "_aggregate_request_finished" not in cls.__dict__:
        # vLLM 0.14.1-0.20.2: request_finished is where the children's answers are counted.
        if "request_finished_all_groups" in cls.__dict__:
            raise UnknownShape(
                "MultiConnector has request_finished_all_groups but no _aggregate_request_finished"
            )
        _require_known(cls, "request_finished")
        older.append(REQUEST_FINISHED)
    for name, (params, needle) in _STRUCTURE.items():
        method = cls.__dict__.get(name)
        if method is None:
            if name == "_aggregate_request_finished":
                continue
            raise UnknownShape(f"MultiConnector.{name} is not defined on the class")
        if _params(method) != params or needle not in _source(method):
            raise UnknownShape(f"MultiConnector.{name} no longer has the expected structure ({needle!r})")
    _require_known(cls, "update_connector_output")
    if ast_fingerprint(cls.__dict__["update_connector_output"]) in SHARED_OUTPUT_KNOWN:
        older.append(SHARED_OUTPUT)
    if "register_finished_partial_tail" in cls.__dict__:
        _require_known(cls, "register_finished_partial_tail")
    if "get_transfer_results" in cls.__dict__:
        _require_known(cls, "get_transfer_results")
        finished = cls.__dict__["get_finished"]
        if "self.get_transfer_results(" not in _source(finished):
            raise UnknownShape("MultiConnector.get_finished does not delegate to get_transfer_results")
        return "+".join([TRANSFER_RESULTS, *older])
    _require_known(cls, "get_finished")
    return "+".join([GET_FINISHED, *older])


# ---------------------------------------------------------------------------- scheduler side
def _aggregate_wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if instance is None:
        return wrapped(*args, **kwargs)
    request = args[0] if args else kwargs["request"]
    per_connector_fn = args[1] if len(args) > 1 else kwargs["per_connector_fn"]
    children = instance._connectors
    owners = [0]

    def recording(child: Any) -> Any:
        result = per_connector_fn(child)
        if result[0]:
            for index, candidate in enumerate(children):
                if candidate is child:
                    owners[0] |= 1 << index
                    break
        return result

    outcome = wrapped(request, recording)
    ledger = instance.__dict__.get(LEDGER_ATTR)
    if ledger is None:
        ledger = ledger_of(instance)
    ledger.record_finished(request.request_id, owners[0])
    return outcome


def _aggregate_request_finished(self: Any, request: Any, per_connector_fn: Any) -> Any:
    """vLLM's body (0.25.1-0.33.0), plus the owner set: the children that said True."""
    async_saves = 0
    kv_txfer_params = None
    owners = 0  # a mask: child i is bit 1 << i
    bit = 1
    for c in self._connectors:
        async_save, txfer_params = per_connector_fn(c)
        if async_save:
            async_saves += 1
            owners |= bit
        bit <<= 1
        if txfer_params is not None:
            if kv_txfer_params is not None:
                clashes = set(kv_txfer_params) & set(txfer_params)
                if clashes:
                    raise RuntimeError(f"Key clash in kv_transfer_params from multiple connectors: {clashes}")
                kv_txfer_params.update(txfer_params)
            else:
                kv_txfer_params = txfer_params
    _settle_finished(self, request.request_id, async_saves, owners)
    return async_saves > 0, kv_txfer_params


def _settle_finished(self: Any, request_id: str, async_saves: int, owners: int) -> None:
    """What vLLM does once a request's children have answered (extra async saves, the loader
    forgotten), plus the owner set on the ledger."""
    if async_saves > 1:
        self._extra_async_saves[request_id] = async_saves - 1
    self._requests_to_connector.pop(request_id, None)
    ledger = self.__dict__.get(LEDGER_ATTR)
    if ledger is None:
        ledger = ledger_of(self)
    ledger.record_finished(request_id, owners)


def _request_finished_counting(self: Any, request: Any, blocks: list[int]) -> Any:
    """vLLM's request_finished (0.14.1-0.20.2, where it counts the children itself), plus the
    owner set: the children that said True."""
    async_saves = 0
    kv_txfer_params = None
    owners = 0  # a mask: child i is bit 1 << i
    bit = 1
    for c in self._connectors:
        async_save, txfer_params = c.request_finished(request, blocks)
        if async_save:
            async_saves += 1
            owners |= bit
        bit <<= 1
        if txfer_params is not None:
            if kv_txfer_params is not None:
                raise RuntimeError("Only one connector can produce KV transfer params")  # as vLLM
            kv_txfer_params = txfer_params
    _settle_finished(self, request.request_id, async_saves, owners)
    return async_saves > 0, kv_txfer_params


def _get_num_new_matched_tokens(self: Any, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
    """vLLM's body (identical 0.24.0-0.33.0), plus the loader child for the workers."""
    to_return: tuple[int | None, bool] = (0, False)
    for i, c in enumerate(self._connectors):
        toks, load_async = c.get_num_new_matched_tokens(request, num_computed_tokens)
        if toks is None:
            return (None, False)
        if to_return[0] == 0 and toks > 0:
            if self._requests_to_connector.get(request.request_id) != i:
                ledger_of(self).record_loader(request.request_id, i)
            self._requests_to_connector[request.request_id] = i
            to_return = (toks, load_async)
    return to_return


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
        ledger = instance.__dict__.get(LEDGER_ATTR)
        # Every step carries an update (a shared empty one when there is nothing to ship):
        # that is how a worker knows the scheduler process runs the fix.
        setattr(metadata, META_ATTR, ledger.take_update() if ledger is not None else EMPTY_UPDATE)
    return metadata


def _build_connector_meta(self: Any, scheduler_output: Any) -> Any:
    """vLLM's body (identical 0.24.0-0.33.0), plus this step's owner-set update."""
    metadata = _vllm["MultiKVConnectorMetadata"](
        metadata=tuple(c.build_connector_meta(scheduler_output) for c in self._connectors)
    )
    if self._extra_async_saves:
        metadata.extra_async_saves = self._extra_async_saves
        self._extra_async_saves = {}
    ledger = self.__dict__.get(LEDGER_ATTR)
    # = META_ATTR, as a plain attribute store (metadata.__dict__ would build the instance dict)
    metadata.vllm_fix_completion_ownership = ledger.take_update() if ledger is not None else EMPTY_UPDATE
    return metadata


def _bind_connector_metadata(self: Any, connector_metadata: Any) -> None:
    """vLLM's body (identical 0.24.0-0.33.0), with the owner-set update fed to the gate;
    vLLM's anonymous extra_async_saves count is kept only where no update arrives."""
    assert isinstance(connector_metadata, _vllm["MultiKVConnectorMetadata"])
    if not _feed_gate(self, connector_metadata) and connector_metadata.extra_async_saves:
        self._extra_async_saves.update(connector_metadata.extra_async_saves)
    for c, cm in zip(self._connectors, connector_metadata.metadata, strict=False):  # as vLLM
        c.bind_connector_metadata(cm)
    super(_vllm["MultiConnector"], self).bind_connector_metadata(connector_metadata)


def _feed_gate(instance: Any, metadata: Any) -> bool:
    """Apply the metadata's owner-set update to this worker's gate; False: no usable update."""
    update = getattr(metadata, "__dict__", _NO_DICT).get(META_ATTR)
    if update is None:
        _fallback(
            instance,
            "the scheduler process sent MultiKVConnectorMetadata without owner sets "
            "(vllm-fix-completion-ownership is not applied there)",
        )
        return False
    state = instance.__dict__
    gate = state.get(GATE_ATTR)
    if gate is None:
        gate = state[GATE_ATTR] = WorkerGate()
    try:
        gate.apply_update(update)
    except (WireError, KeyError, TypeError, AttributeError) as exc:
        _fallback(instance, f"the owner-set update cannot be read ({exc!r})")
        return False
    return True


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


def _ignored(index: int, child: Any, ignored: list[str]) -> None:
    _logger.debug(
        "completion-ownership: child %d (%s) reported %s, which it does not own; ignored",
        index,
        type(child).__name__,
        sorted(ignored),
    )


def _update_connector_output(self: Any, connector_output: Any) -> None:
    """Each child sees a private view; R is surfaced once all of O(R) completed."""
    ledger = self.__dict__.get(LEDGER_ATTR)
    if ledger is None:
        ledger = ledger_of(self)
    multi_meta = connector_output.kv_connector_worker_meta
    if multi_meta is not None and not isinstance(multi_meta, _vllm["MultiKVConnectorWorkerMetadata"]):
        raise AssertionError(f"expected MultiKVConnectorWorkerMetadata, got {type(multi_meta).__name__}")
    incoming = connector_output.finished_sending
    if incoming:
        ledger.note_workers_done(incoming)
    recv = connector_output.finished_recving
    failed = connector_output.failed_recving if _HAS_FAILED else None
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
                ignored = ledger.let_go(index, returned)
                if ignored:
                    _ignored(index, child, ignored)
            if connector_output.finished_recving or (_HAS_FAILED and connector_output.failed_recving):
                _own_recv_only(self, connector_output, index)
            index += 1
    finally:
        connector_output.kv_connector_worker_meta = multi_meta
    connector_output.finished_sending = ledger.surface() if ledger.done or ledger.ready else None


def _update_connector_output_shared(self: Any, connector_output: Any) -> None:
    """vLLM 0.14.1-0.17.1 shape (every child gets the same output, no per-child worker
    metadata): each child sees a private view; R is surfaced once all of O(R) completed."""
    ledger = self.__dict__.get(LEDGER_ATTR)
    if ledger is None:
        ledger = ledger_of(self)
    incoming = connector_output.finished_sending
    if incoming:
        ledger.note_workers_done(incoming)
    recv = connector_output.finished_recving
    failed = connector_output.failed_recving if _HAS_FAILED else None
    if recv or failed:
        _update_routed(self, ledger, connector_output, None, recv, failed)
        return
    held = ledger.held
    for index, child in enumerate(self._connectors):
        connector_output.finished_sending = set(held[index]) if held[index] else None
        child.update_connector_output(connector_output)
        returned = connector_output.finished_sending
        if returned:
            ignored = ledger.let_go(index, returned)
            if ignored:
                _ignored(index, child, ignored)
        if connector_output.finished_recving or (_HAS_FAILED and connector_output.failed_recving):
            _own_recv_only(self, connector_output, index)
    connector_output.finished_sending = ledger.surface() if ledger.done or ledger.ready else None


def _own_recv_only(self: Any, output: Any, index: int) -> None:
    """A child added recv ids of its own: keep the ones it may report (its own loads, or an
    unknown loader); the children after it see them as vLLM shows them."""
    loaders = self._requests_to_connector
    recv = output.finished_recving
    if recv:
        output.finished_recving = {r for r in recv if loaders.get(r, index) == index} or None
    if _HAS_FAILED and output.failed_recving:
        output.failed_recving = {r for r in output.failed_recving if loaders.get(r, index) == index}


def _update_routed(
    self: Any, ledger: SchedulerLedger, output: Any, multi_meta: Any, recv: Any, failed: Any
) -> None:
    """Recv ids this step: each child also sees only the recv ids it loads (or unknown)."""
    loaders: dict[str, int] = self._requests_to_connector
    final_recv: set[str] = set(recv) if recv else set()
    final_failed: set[str] = set(failed) if failed else set()
    try:
        for index, child in enumerate(self._connectors):
            if multi_meta is not None:
                output.kv_connector_worker_meta = multi_meta.metadata[index]
            output.finished_sending = ledger.view(index)
            view_recv = _view(recv, loaders, index)
            output.finished_recving = view_recv or None
            if _HAS_FAILED:
                view_failed = _view(failed, loaders, index)
                output.failed_recving = view_failed
            child.update_connector_output(output)
            returned = output.finished_sending
            if returned:
                ignored = ledger.let_go(index, returned)
                if ignored:
                    _ignored(index, child, ignored)
            _apply_view_edits(final_recv, view_recv, output.finished_recving, loaders, index)
            if _HAS_FAILED:
                _apply_view_edits(final_failed, view_failed, output.failed_recving, loaders, index)
    finally:
        if _HAS_WORKER_META:
            output.kv_connector_worker_meta = multi_meta
        output.finished_recving = final_recv or None
        if _HAS_FAILED:
            output.failed_recving = final_failed
    freed_by_recv = output.finished_recving
    if freed_by_recv and ledger.entries:
        for req_id in freed_by_recv:
            if req_id in ledger.entries:
                # vLLM frees a finished request through its recv path: it must not come
                # back through finished_sending (that would be a second free).
                ledger.release(req_id)
    output.finished_sending = ledger.surface() if ledger.done or ledger.ready else None


# ---------------------------------------------------------------------------- worker side
def _bind_wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """For a bind_connector_metadata of unknown body (structure checked): vLLM's own, then
    the gate; vLLM's anonymous counting is not used while owner sets arrive."""
    outcome = wrapped(*args, **kwargs)
    if instance is None:
        return outcome
    metadata = args[0] if args else kwargs["connector_metadata"]
    if _feed_gate(instance, metadata):
        saves = instance._extra_async_saves
        if saves:
            saves.clear()
    return outcome


_NO_DICT: dict[str, Any] = {}


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


def _get_finished(self: Any, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
    """vLLM 0.24-0.29 shape: owner-gated union of the children's get_finished."""
    gate: WorkerGate | None = self.__dict__.get(GATE_ATTR)
    if gate is None:
        return _originals["get_finished"](self, finished_req_ids)  # type: ignore[no-any-return]
    finished_recving: set[str] = set()
    for index, child in enumerate(self._connectors):
        sending, recving = child.get_finished(finished_req_ids)
        if sending:
            gate.report_all(index, sending)
        if recving:
            finished_recving.update(gate.accepted_recv(index, recving))
    sent = gate.take_ready() if gate.ready else None
    return sent or None, finished_recving or None


# ---------------------------------------------------------------------------- apply
def _per_step_known(cls: Any, name: str) -> bool:
    # vLLM's own object, not what is installed now (applying twice must decide the same way).
    return ast_fingerprint(original_of(cls, name)) in PER_STEP_KNOWN[name]


_HAS_FAILED = True  # KVConnectorOutput.failed_recving exists (vLLM 0.30.0+)
_HAS_WORKER_META = True  # KVConnectorOutput.kv_connector_worker_meta exists (vLLM 0.18.1+)


def apply(patch: PatchSet, shape: str) -> None:
    global _HAS_FAILED, _HAS_WORKER_META
    mod = _module()
    cls = mod.MultiConnector
    from vllm.v1.outputs import KVConnectorOutput

    parts = shape.split("+")
    output_fields = {f.name for f in dataclasses.fields(KVConnectorOutput)}
    _HAS_FAILED = "failed_recving" in output_fields
    _HAS_WORKER_META = "kv_connector_worker_meta" in output_fields
    _vllm["MultiKVConnectorWorkerMetadata"] = getattr(mod, "MultiKVConnectorWorkerMetadata", None)
    _vllm["MultiKVConnectorMetadata"] = mod.MultiKVConnectorMetadata
    _vllm["MultiConnector"] = cls
    if REQUEST_FINISHED in parts:
        patch.replace(cls, "request_finished", _request_finished_counting)
    elif _per_step_known(cls, "_aggregate_request_finished"):
        patch.replace(cls, "_aggregate_request_finished", _aggregate_request_finished)
    else:
        patch.wrap(cls, "_aggregate_request_finished", _aggregate_wrapper)
    if _per_step_known(cls, "get_num_new_matched_tokens"):
        patch.replace(cls, "get_num_new_matched_tokens", _get_num_new_matched_tokens)
    else:
        patch.wrap(cls, "get_num_new_matched_tokens", _match_wrapper)
    if _per_step_known(cls, "build_connector_meta"):
        patch.replace(cls, "build_connector_meta", _build_connector_meta)
    else:
        patch.wrap(cls, "build_connector_meta", _build_meta_wrapper)
    if SHARED_OUTPUT in parts:
        patch.replace(cls, "update_connector_output", _update_connector_output_shared)
    else:
        patch.replace(cls, "update_connector_output", _update_connector_output)
    if _per_step_known(cls, "bind_connector_metadata"):
        patch.replace(cls, "bind_connector_metadata", _bind_connector_metadata)
    else:
        patch.wrap(cls, "bind_connector_metadata", _bind_wrapper)
    if "register_finished_partial_tail" in cls.__dict__:
        patch.replace(cls, "register_finished_partial_tail", _register_finished_partial_tail)
    if parts[0] == TRANSFER_RESULTS:
        _vllm["KVConnectorTransferResults"] = mod.KVConnectorTransferResults
        _originals["get_transfer_results"] = original_of(cls, "get_transfer_results")
        patch.replace(cls, "get_transfer_results", _get_transfer_results)
    else:
        _originals["get_finished"] = original_of(cls, "get_finished")
        patch.replace(cls, "get_finished", _get_finished)
