"""Worker side: each worker's gate over the children's reports.

* ``bind_connector_metadata`` (re-implemented or wrapped) feeds the scheduler's update into
  this worker's gate.
* ``get_transfer_results`` (vLLM 0.30.0+; ``get_finished`` delegates to it) or
  ``get_finished`` (0.14.1-0.29.0), bodies replaced for the fingerprinted shapes, gate the
  children's reports. Without an update in the metadata (the scheduler process is not
  patched) they call vLLM's original and warn once.
"""

from __future__ import annotations

from typing import Any

from vllm_fix_completion_ownership.gate import WorkerGate
from vllm_fix_completion_ownership.rule import META_ATTR, WireError
from vllm_fix_completion_ownership.state import GATE_ATTR, VLLM, WARNED_ATTR, logger, new_gate

_NO_DICT: dict[str, Any] = {}


def bind_wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
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


def bind_connector_metadata(self: Any, connector_metadata: Any) -> None:
    """vLLM's body (identical 0.24.0-0.33.0), with the owner-set update fed to the gate;
    vLLM's anonymous extra_async_saves count is kept only where no update arrives."""
    assert isinstance(connector_metadata, VLLM.metadata)
    if not _feed_gate(self, connector_metadata) and connector_metadata.extra_async_saves:
        self._extra_async_saves.update(connector_metadata.extra_async_saves)
    for c, cm in zip(self._connectors, connector_metadata.metadata, strict=False):  # as vLLM
        c.bind_connector_metadata(cm)
    super(VLLM.multi_connector, self).bind_connector_metadata(connector_metadata)


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
    gate = instance.__dict__.get(GATE_ATTR)
    if gate is None:
        gate = new_gate(instance)
    try:
        gate.apply_update(update)
    except (WireError, KeyError, TypeError, AttributeError) as exc:
        _fallback(instance, f"the owner-set update cannot be read ({exc!r})")
        return False
    return True


def _fallback(instance: Any, why: str) -> None:
    state = instance.__dict__
    state[GATE_ATTR] = None
    if not state.get(WARNED_ATTR):
        state[WARNED_ATTR] = True
        logger.warning(
            "vllm-fix completion-ownership: %s; this worker falls back to vLLM's own "
            "MultiConnector completion counting (the bug of vllm-project/vllm#60635 is "
            "present). Load the plugin in every vLLM process.",
            why,
        )


def get_transfer_results(self: Any, finished_req_ids: set[str]) -> Any:
    """Owner-gated union of the children's results (vLLM's original without owner sets)."""
    gate: WorkerGate | None = self.__dict__.get(GATE_ATTR)
    if gate is None:
        return VLLM.get_transfer_results(self, finished_req_ids)
    results = VLLM.transfer_results()
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


def get_finished(self: Any, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
    """vLLM 0.14-0.29 shape: owner-gated union of the children's get_finished."""
    gate: WorkerGate | None = self.__dict__.get(GATE_ATTR)
    if gate is None:
        return VLLM.get_finished(self, finished_req_ids)  # type: ignore[no-any-return]
    finished_recving: set[str] = set()
    for index, child in enumerate(self._connectors):
        sending, recving = child.get_finished(finished_req_ids)
        if sending:
            gate.report_all(index, sending)
        if recving:
            finished_recving.update(gate.accepted_recv(index, recving))
    sent = gate.take_ready() if gate.ready else None
    return sent or None, finished_recving or None
