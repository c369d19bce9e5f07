"""Apply: the exclusion rule at the attach point this vLLM has.

* ``MoRIIOConnector.get_sync_load_block_ids`` (the #59164 API): its layout guard is replaced by
  the computed coverage (a wrapper returns the rule's blocks);
* otherwise ``MoRIIOConnectorScheduler.build_connector_meta``: a wrapper snapshots the pending
  READ destinations and this step's zeroing list *before* delegating (vLLM clears
  ``_reqs_need_recv`` inside), then leaves in ``new_block_ids_to_zero`` exactly what the rule
  says must be zeroed.
"""

from __future__ import annotations

import inspect
from typing import Any

from vllm_fix_core import PatchSet, UnknownShape
from vllm_fix_sync_load_zeroing.rule import (
    Situation,
    excluded_blocks,
    filter_zeroing,
    read_destinations,
    scheduler_situation,
)

FORK_API = "fork-api"
BUILD_META = "build-connector-meta"


def _module() -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector as mc

    return mc


def _params(func: Any) -> list[str]:
    return list(inspect.signature(func).parameters)


def recognize() -> str:
    mc = _module()
    fork = getattr(mc.MoRIIOConnector, "get_sync_load_block_ids", None)
    if fork is not None:
        if not callable(fork) or _params(fork) != ["self"]:
            raise UnknownShape("MoRIIOConnector.get_sync_load_block_ids has an unexpected signature")
        return FORK_API
    method = mc.MoRIIOConnectorScheduler.__dict__.get("build_connector_meta")
    if method is None:
        raise UnknownShape("MoRIIOConnectorScheduler.build_connector_meta is not defined on the class")
    if _params(method) != ["self", "scheduler_output"]:
        raise UnknownShape(f"unexpected signature build_connector_meta{tuple(_params(method))}")
    source = inspect.getsource(method)
    if "_reqs_need_recv" not in source:
        raise UnknownShape("build_connector_meta no longer drains _reqs_need_recv")
    return BUILD_META


def _meta_wrapper(read_mode: Any) -> Any:
    def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        output = args[0] if args else kwargs.get("scheduler_output")
        if instance is None or output is None:
            return wrapped(*args, **kwargs)
        pending = getattr(instance, "_reqs_need_recv", None)
        zero = getattr(output, "new_block_ids_to_zero", None)
        if not pending or not zero:  # the common step: nothing to decide
            return wrapped(*args, **kwargs)
        # Before delegating: vLLM drains _reqs_need_recv into the metadata and clears it.
        excluded = excluded_blocks(scheduler_situation(instance, read_mode), pending)
        before = list(zero)
        meta = wrapped(*args, **kwargs)
        output.new_block_ids_to_zero = filter_zeroing(before, excluded)
        return meta

    return wrapper


def fork_situation(connector: Any, read_mode: Any) -> Situation:
    """The situation as the #59164 API reads it: the connector's mode, role and resolved layout."""
    sched = connector.connector_scheduler
    try:
        layout = connector._vllm_config.cache_config.get_resolved_kv_cache_layout().name
    except Exception:  # unresolved or unreadable: keep zeroing
        layout = None
    base = scheduler_situation(sched, read_mode)
    transfer = getattr(connector, "kv_transfer_config", None)
    return Situation(
        read=getattr(connector, "mode", None) is read_mode,
        consumer=getattr(transfer, "is_kv_consumer", False) is True,
        hybrid=base.hybrid,
        layout=layout,
        spec=base.spec,
        more_specs=base.more_specs,
    )


def _fork_wrapper(read_mode: Any) -> Any:
    def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        result = wrapped(*args, **kwargs)
        sched = getattr(instance, "connector_scheduler", None)
        if instance is None or sched is None:
            return result
        pending = getattr(sched, "_reqs_need_recv", None) or {}
        situation = fork_situation(instance, read_mode)
        excluded = excluded_blocks(situation, pending)
        destinations = read_destinations(pending, situation.attention_groups)
        return [b for b in dict.fromkeys(destinations) if b in excluded]

    return wrapper


def apply(patch: PatchSet, shape: str) -> None:
    mc = _module()
    # Nothing else is imported: the patched method's coverage computation asks vLLM's
    # KVBlockZeroer only where vllm.v1.worker.utils is loaded already, and takes the
    # specification's answer elsewhere (coverage.py), so no serving step imports it either.
    if shape == FORK_API:
        patch.wrap(mc.MoRIIOConnector, "get_sync_load_block_ids", _fork_wrapper(mc.MoRIIOMode.READ))
    else:
        patch.wrap(mc.MoRIIOConnectorScheduler, "build_connector_meta", _meta_wrapper(mc.MoRIIOMode.READ))
