"""Apply: a stateless wrapper around MoRIIOConnectorScheduler.get_num_new_matched_tokens."""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

from vllm_fix_core import PatchSet, UnknownShape, ast_fingerprint, get_logger
from vllm_fix_read_eligibility.rule import malformed_reason, wants_remote_prefill

# Normalized-AST fingerprints (vllm_fix_core.ast_fingerprint) of the known targets.
KNOWN_SHAPES = {
    "c98f56e1ca0f0001": "vllm-0.32.0",
    "0a8992648f2c81ed": "vllm-0.33.0",
}
_logger = get_logger("read-eligibility")


def _classes() -> tuple[Any, Any]:
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector as mc

    return mc.MoRIIOConnectorScheduler, mc.MoRIIOMode


def recognize() -> str:
    cls, mode = _classes()
    method = cls.__dict__.get("get_num_new_matched_tokens")
    if method is None:
        raise UnknownShape("MoRIIOConnectorScheduler.get_num_new_matched_tokens is not defined on the class")
    shape = KNOWN_SHAPES.get(ast_fingerprint(method))
    if shape:
        return shape
    # A wrapper only needs the call signature and the two attributes it reads.
    params = list(inspect.signature(method).parameters)
    if params[:3] != ["self", "request", "num_computed_tokens"] or len(params) != 3:
        raise UnknownShape(f"unexpected signature get_num_new_matched_tokens{tuple(params)}")
    source = inspect.getsource(method)
    if "self.is_producer" not in source or "self.mode" not in source or not hasattr(mode, "READ"):
        raise UnknownShape("get_num_new_matched_tokens no longer reads self.is_producer / self.mode")
    return "structural"


def _make_wrapper(read_mode: Any) -> Any:
    def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # Producer, WRITE mode, or a class-level call: vLLM's own rule, untouched.
        if instance is None or instance.is_producer or instance.mode is not read_mode:
            return wrapped(*args, **kwargs)
        request = args[0] if args else kwargs["request"]
        params = request.kv_transfer_params
        if not wants_remote_prefill(params):
            return 0, False
        reason = malformed_reason(params)
        if reason is None:
            return wrapped(*args, **kwargs)
        _logger.warning(
            "MoRIIO READ: request %s asked for a remote prefill but its kv_transfer_params "
            "cannot drive a READ (%s); recomputing its prompt locally instead",
            getattr(request, "request_id", "?"),
            reason,
        )
        # vLLM clears the flag once a READ is queued; do the same so nothing is queued.
        with contextlib.suppress(TypeError):
            params["do_remote_prefill"] = False
        return 0, False

    return wrapper


def apply(patch: PatchSet, shape: str) -> None:
    cls, mode = _classes()
    patch.wrap(cls, "get_num_new_matched_tokens", _make_wrapper(mode.READ))
