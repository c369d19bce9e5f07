"""Scheduler side (engine-core process): the owner set and the loader of each request, and
the per-step update for the workers.

* ``_aggregate_request_finished`` (vLLM 0.21.0+; re-implemented or wrapped) records which
  children asked to hold R's blocks; on older MultiConnectors (0.14.1-0.20.2), where
  ``request_finished`` counts the children itself, that body is replaced for its
  fingerprint instead. Together with ``register_finished_partial_tail`` acceptors (body
  replaced for the fingerprinted shape: the original only returns ``any(...)``) that is O(R).
* ``get_num_new_matched_tokens`` (re-implemented or wrapped) records R's loader child.
* ``build_connector_meta`` (re-implemented or wrapped) attaches the per-step update for the
  workers to the MultiKVConnectorMetadata as a plain-builtins instance attribute. vLLM's own
  ``extra_async_saves`` is still filled exactly as before, so an unpatched worker reads a
  normal metadata object and behaves as unpatched vLLM does.

The connector-output side of the scheduler (``update_connector_output``) is ``output.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from vllm_fix_completion_ownership.rule import EMPTY_UPDATE, META_ATTR
from vllm_fix_completion_ownership.state import LEDGER_ATTR, VLLM, ledger_of


def _record_owners(self: Any, request_id: str, owners: int) -> None:
    ledger = self.__dict__.get(LEDGER_ATTR)
    if ledger is None:
        ledger = ledger_of(self)
    ledger.record_finished(request_id, owners)


def aggregate_wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
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
    _record_owners(instance, request.request_id, owners[0])
    return outcome


def aggregate_request_finished(self: Any, request: Any, per_connector_fn: Any) -> Any:
    """vLLM's body (0.25.1-0.33.0), plus the owner set: the children that said True."""
    return _count_finished(self, request, map(per_connector_fn, self._connectors), _merge_params)


def request_finished_counting(self: Any, request: Any, blocks: list[int]) -> Any:
    """vLLM's request_finished (0.14.1-0.20.2, where it counts the children itself), plus the
    owner set: the children that said True."""
    answers = (c.request_finished(request, blocks) for c in self._connectors)
    return _count_finished(self, request, answers, _only_one_params)


def _merge_params(kv_txfer_params: dict[str, Any], txfer_params: dict[str, Any]) -> dict[str, Any]:
    clashes = set(kv_txfer_params) & set(txfer_params)
    if clashes:
        raise RuntimeError(f"Key clash in kv_transfer_params from multiple connectors: {clashes}")
    kv_txfer_params.update(txfer_params)
    return kv_txfer_params


def _only_one_params(kv_txfer_params: dict[str, Any], txfer_params: dict[str, Any]) -> dict[str, Any]:
    raise RuntimeError("Only one connector can produce KV transfer params")  # as vLLM 0.14.1-0.20.2


def _count_finished(
    self: Any,
    request: Any,
    answers: Iterable[tuple[bool, dict[str, Any] | None]],
    merge: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]],
) -> tuple[bool, dict[str, Any] | None]:
    """vLLM's count of the children's answers (each child asked in turn), what it does once
    they have answered (extra async saves, the loader forgotten), plus the owner set on the
    ledger: the children that said True."""
    async_saves = 0
    kv_txfer_params = None
    owners = 0  # a mask: child i is bit 1 << i
    bit = 1
    for async_save, txfer_params in answers:
        if async_save:
            async_saves += 1
            owners |= bit
        bit <<= 1
        if txfer_params is not None:
            kv_txfer_params = (
                txfer_params if kv_txfer_params is None else merge(kv_txfer_params, txfer_params)
            )
    request_id = request.request_id
    if async_saves > 1:
        self._extra_async_saves[request_id] = async_saves - 1
    self._requests_to_connector.pop(request_id, None)
    _record_owners(self, request_id, owners)
    return async_saves > 0, kv_txfer_params


def get_num_new_matched_tokens(self: Any, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
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


def match_wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
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


def register_finished_partial_tail(
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


def build_meta_wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    metadata = wrapped(*args, **kwargs)
    if instance is not None:
        ledger = instance.__dict__.get(LEDGER_ATTR)
        # Every step carries an update (a shared empty one when there is nothing to ship):
        # that is how a worker knows the scheduler process runs the fix.
        setattr(metadata, META_ATTR, ledger.take_update() if ledger is not None else EMPTY_UPDATE)
    return metadata


def build_connector_meta(self: Any, scheduler_output: Any) -> Any:
    """vLLM's body (identical 0.24.0-0.33.0), plus this step's owner-set update."""
    metadata = VLLM.metadata(
        metadata=tuple(c.build_connector_meta(scheduler_output) for c in self._connectors)
    )
    if self._extra_async_saves:
        metadata.extra_async_saves = self._extra_async_saves
        self._extra_async_saves = {}
    ledger = self.__dict__.get(LEDGER_ATTR)
    # = META_ATTR, as a plain attribute store (metadata.__dict__ would build the instance dict)
    metadata.vllm_fix_completion_ownership = ledger.take_update() if ledger is not None else EMPTY_UPDATE
    return metadata
