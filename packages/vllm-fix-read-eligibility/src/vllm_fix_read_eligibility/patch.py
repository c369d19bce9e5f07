"""Recognize and apply: a stateless wrapper around
MoRIIOConnectorScheduler.get_num_new_matched_tokens.

The wrapper only answers for the READ consumer, from the request's own
``kv_transfer_params``; everything else (the producer, WRITE mode, an eligible
remote prefill) is vLLM's own answer. It needs from vLLM exactly what it reads:

* the call ``get_num_new_matched_tokens(self, request, num_computed_tokens)``;
* the two attributes vLLM's own body decides by, ``self.is_producer`` and ``self.mode``
  (compared with ``MoRIIOMode.READ``);
* ``request.kv_transfer_params``;
* the block-id layout the connector exchanges (per KV cache group where the connector
  supports the hybrid KV cache manager, flat before).

``recognize`` checks those on the installed method (a known fingerprint only names the
shape), so a body that decides by something else is refused, not wrapped.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import MutableMapping
from typing import Any

from vllm_fix_core import PatchSet, UnknownShape, ast_fingerprint, function_ast, get_logger, original_of
from vllm_fix_read_eligibility.rule import BlockLayout, malformed_reason, wants_remote_prefill

TARGET = "get_num_new_matched_tokens"
# Normalized-AST fingerprints (vllm_fix_core.ast_fingerprint) of the bodies seen in
# releases; they name the shape in the log line. The structural checks run for all.
KNOWN_SHAPES = {
    "7013444d3022e8f6": "vllm-0.29.0",  # also 0.30.0 (same body)
    "c4f8bf2a6d61a883": "vllm-0.31.0",
    "c98f56e1ca0f0001": "vllm-0.32.0",
    "0a8992648f2c81ed": "vllm-0.33.0",
}
_logger = get_logger("read-eligibility")


def _mc() -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector as mc

    return mc


def block_layout() -> BlockLayout:
    """The layout of ``remote_block_ids`` this vLLM's MoRIIO exchanges: per KV cache
    group for a connector that supports the hybrid KV cache manager (SupportsHMA: its
    request_finished hands out one block list per group), flat otherwise."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import base

    hma = getattr(base, "SupportsHMA", None)
    if isinstance(hma, type) and issubclass(_mc().MoRIIOConnector, hma):
        return BlockLayout.PER_GROUP
    return BlockLayout.FLAT


def _self_attributes(method: Any) -> set[str]:
    node = function_ast(method)
    return {
        sub.attr
        for sub in ast.walk(node)
        if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self"
    }


def recognize() -> str:
    mc = _mc()
    cls = mc.MoRIIOConnectorScheduler
    if TARGET not in cls.__dict__:
        raise UnknownShape(f"MoRIIOConnectorScheduler.{TARGET} is not defined on the class")
    method = original_of(cls, TARGET)  # what vLLM shipped, also under a layer of ours
    params = list(inspect.signature(method).parameters)
    if params != ["self", "request", "num_computed_tokens"]:
        raise UnknownShape(f"unexpected signature {TARGET}{tuple(params)}")
    missing = {"is_producer", "mode"} - _self_attributes(method)
    if missing:
        raise UnknownShape(
            f"{TARGET} no longer decides by self.{' / self.'.join(sorted(missing))}; the wrapper "
            "answers for the READ consumer by exactly those"
        )
    if not hasattr(mc.MoRIIOMode, "READ"):
        raise UnknownShape("MoRIIOMode has no READ member")
    name = KNOWN_SHAPES.get(ast_fingerprint(method), "structural")
    return f"{name}/{block_layout().value}"


def _make_wrapper(read_mode: Any, layout: BlockLayout) -> Any:
    def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # Producer, WRITE mode, or a class-level call: vLLM's own rule, untouched.
        if instance is None or instance.is_producer or instance.mode != read_mode:
            return wrapped(*args, **kwargs)
        request = args[0] if args else kwargs["request"]
        params = request.kv_transfer_params
        if not wants_remote_prefill(params):
            # Plain, preempted-and-resumed, already loaded, load-failure retry.
            return 0, False
        reason = malformed_reason(params, layout)
        if reason is None:
            return wrapped(*args, **kwargs)
        _logger.warning(
            "MoRIIO READ: request %s asked for a remote prefill but its kv_transfer_params "
            "cannot drive a READ (%s); recomputing its prompt locally instead",
            getattr(request, "request_id", "?"),
            reason,
        )
        # vLLM clears the flag once it has handled the request's one READ; do it now, so
        # update_state_after_alloc queues nothing from these params and a later query
        # (after preemption, say) does not warn again.
        if isinstance(params, MutableMapping):
            params["do_remote_prefill"] = False
        return 0, False

    return wrapper


def apply(patch: PatchSet, shape: str) -> None:
    layout = BlockLayout(shape.rpartition("/")[2]) if "/" in shape else block_layout()
    mc = _mc()
    patch.wrap(mc.MoRIIOConnectorScheduler, TARGET, _make_wrapper(mc.MoRIIOMode.READ, layout))
