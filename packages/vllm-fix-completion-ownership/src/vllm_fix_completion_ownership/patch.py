"""Apply: owner-set completion tracking on vLLM's MultiConnector.

``recognize()`` (``shapes.py``) says which MultiConnector the installed vLLM has;
``apply(patch, shape)`` installs, for that shape, the scheduler-side bodies
(``scheduler.py``; ``output.py`` for the connector output) and the worker-side ones
(``worker.py``). A per-step method of known body (``shapes.PER_STEP_KNOWN``) is
re-implemented; one of unknown body that passed the structure check is wrapped. What apply
learns about the installed vLLM goes to ``state.VLLM``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm_fix_completion_ownership import output, scheduler, worker
from vllm_fix_completion_ownership.shapes import (
    REQUEST_FINISHED,
    SHARED_OUTPUT,
    TRANSFER_RESULTS,
    multi_connector_module,
    per_step_known,
    recognize,
)
from vllm_fix_completion_ownership.state import VLLM
from vllm_fix_core import PatchSet, original_of

__all__ = ["apply", "recognize"]


def _per_step(patch: PatchSet, cls: Any, name: str, body: Any, wrapper: Any) -> None:
    if per_step_known(cls, name):
        patch.replace(cls, name, body)
    else:
        patch.wrap(cls, name, wrapper)


def apply(patch: PatchSet, shape: str) -> None:
    from vllm.v1.outputs import KVConnectorOutput

    mod = multi_connector_module()
    cls = mod.MultiConnector
    parts = shape.split("+")
    output_fields = {f.name for f in dataclasses.fields(KVConnectorOutput)}
    VLLM.has_failed = "failed_recving" in output_fields
    VLLM.has_worker_meta = "kv_connector_worker_meta" in output_fields
    VLLM.shared_output = SHARED_OUTPUT in parts
    VLLM.worker_metadata = getattr(mod, "MultiKVConnectorWorkerMetadata", None)
    VLLM.metadata = mod.MultiKVConnectorMetadata
    VLLM.multi_connector = cls
    if REQUEST_FINISHED in parts:
        patch.replace(cls, "request_finished", scheduler.request_finished_counting)
    else:
        _per_step(
            patch,
            cls,
            "_aggregate_request_finished",
            scheduler.aggregate_request_finished,
            scheduler.aggregate_wrapper,
        )
    _per_step(
        patch,
        cls,
        "get_num_new_matched_tokens",
        scheduler.get_num_new_matched_tokens,
        scheduler.match_wrapper,
    )
    _per_step(
        patch, cls, "build_connector_meta", scheduler.build_connector_meta, scheduler.build_meta_wrapper
    )
    patch.replace(cls, "update_connector_output", output.update_connector_output)
    _per_step(patch, cls, "bind_connector_metadata", worker.bind_connector_metadata, worker.bind_wrapper)
    if "register_finished_partial_tail" in cls.__dict__:
        patch.replace(cls, "register_finished_partial_tail", scheduler.register_finished_partial_tail)
    if parts[0] == TRANSFER_RESULTS:
        VLLM.transfer_results = mod.KVConnectorTransferResults
        VLLM.get_transfer_results = original_of(cls, "get_transfer_results")
        patch.replace(cls, "get_transfer_results", worker.get_transfer_results)
    else:
        VLLM.get_finished = original_of(cls, "get_finished")
        patch.replace(cls, "get_finished", worker.get_finished)
