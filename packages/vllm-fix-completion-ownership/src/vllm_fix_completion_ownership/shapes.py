"""Which MultiConnector the installed vLLM has: fingerprints and structure checks.

All release-specific knowledge of this fix is here. ``recognize()`` returns the shape: the
worker side, plus "+"-joined scheduler-side parts where the MultiConnector is older than
0.21.0:

  vLLM            shape                                        replaced on top of the common set
  0.30.0-0.33.0   transfer-results                             get_transfer_results, register_..._tail
  0.21.0-0.29.0   get-finished                                 get_finished
  0.18.1-0.20.2   get-finished+request-finished                get_finished, request_finished
  0.14.1-0.17.1   get-finished+request-finished+shared-output  the same; update_connector_output
                                                               without per-child worker metadata

(common set: update_connector_output, build_connector_meta, bind_connector_metadata,
get_num_new_matched_tokens, and _aggregate_request_finished where it exists.)
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from vllm_fix_core import UnknownShape, ast_fingerprint, original_of, unwrap

MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.multi_connector"

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
TRANSFER_RESULTS = "transfer-results"  # 0.30.0+: get_finished delegates to get_transfer_results
GET_FINISHED = "get-finished"  # 0.14.1-0.29.0: get_finished aggregates the children's get_finished
REQUEST_FINISHED = "request-finished"  # 0.14.1-0.20.2: request_finished counts the children itself
SHARED_OUTPUT = "shared-output"  # 0.14.1-0.17.1: one output for all children, no worker metadata
META_FIELDS = ["metadata", "extra_async_saves"]

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


def multi_connector_module() -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1 import multi_connector

    return multi_connector


def _params(func: Any) -> list[str]:
    return list(inspect.signature(func).parameters)


def _source(func: Any) -> str:
    return inspect.getsource(unwrap(func))


def _require_known(cls: Any, name: str) -> None:
    found = ast_fingerprint(cls.__dict__[name])
    if found not in REPLACED_KNOWN[name]:
        raise UnknownShape(
            f"MultiConnector.{name} changed (fingerprint {found}, known {sorted(REPLACED_KNOWN[name])}); "
            "its body would be replaced, so only a known shape is accepted"
        )


def per_step_known(cls: Any, name: str) -> bool:
    """A per-step method whose body is known: replaced (otherwise wrapped)."""
    # vLLM's own object, not what is installed now (applying twice must decide the same way).
    return ast_fingerprint(original_of(cls, name)) in PER_STEP_KNOWN[name]


def recognize() -> str:
    """The shape (see the table above: the worker side, plus the older scheduler-side parts),
    or UnknownShape."""
    mod = multi_connector_module()
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
