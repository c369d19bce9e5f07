"""Recognize and apply: a stateless wrapper around
MoRIIOConnectorScheduler.get_num_new_matched_tokens.

The wrapper only answers for the READ consumer, from the request's own
``kv_transfer_params``; everything else (the producer, WRITE mode, an eligible
remote prefill) is vLLM's own answer. It needs from vLLM exactly what it reads:

* the call ``get_num_new_matched_tokens(self, request, num_computed_tokens)``;
* the two attributes vLLM's own body decides by, ``self.is_producer`` and ``self.mode``
  (compared with ``MoRIIOMode.READ``);
* ``request.kv_transfer_params``, ``request.request_id``, ``request.num_prompt_tokens``;
* the block-id layout the connector exchanges (per KV cache group where the connector
  supports the hybrid KV cache manager, flat before);
* what this engine reads per KV cache group (asked of the connector itself: its
  ``get_exchange_clipped_blocks`` / hybrid group ids / ``block_size``), and where
  MoRIIO's own ``MoRIIOConnectorMetadata.add_new_req`` would route the READ (run on a
  throwaway metadata object). Where the engine's groups cannot be read, only the
  per-group checks that need no engine facts apply.

``recognize`` checks those on the installed method (a known fingerprint only names the
shape), so a body that decides by something else is refused, not wrapped.
"""

from __future__ import annotations

import ast
import threading
import time
from collections.abc import MutableMapping, Sequence
from typing import Any

from vllm_fix_core import PatchSet, UnknownShape, ast_fingerprint, function_ast, get_logger, original_of
from vllm_fix_core.fingerprint import call_params
from vllm_fix_core.log import is_probing
from vllm_fix_read_eligibility.releases import block_layout
from vllm_fix_read_eligibility.rule import (
    BlockLayout,
    malformed_reason,
    params_route_reason,
    route_reason,
    wants_remote_prefill,
)

TARGET = "get_num_new_matched_tokens"
# Normalized-AST fingerprints (vllm_fix_core.ast_fingerprint) of the bodies seen in
# releases; they name the shape in the log line. The structural checks run for all.
KNOWN_SHAPES = {
    "7013444d3022e8f6": "vllm-0.29.0",  # also 0.14.0 to 0.30.0 (the same body)
    "c4f8bf2a6d61a883": "vllm-0.31.0",
    "c98f56e1ca0f0001": "vllm-0.32.0",
    "0a8992648f2c81ed": "vllm-0.33.0",  # also 0.34.0 (the same body)
}
_logger = get_logger("read-eligibility")


def _mc() -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector as mc

    return mc


def self_attributes(node: ast.AST) -> set[str]:
    """The ``self.<name>`` attributes a function's AST reads or writes."""
    return {
        sub.attr
        for sub in ast.walk(node)
        if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self"
    }


# A keyword-only parameter with a default that a release adds is passed through by the wrapper.
EXPECTED_PARAMS = ("self", "request", "num_computed_tokens")


def shape_reason(params: Sequence[str], node: ast.AST) -> str | None:
    """Why the method (its parameter names and AST) is not a shape the rule can answer for, or
    None: the runtime patch (recognize) and the native carry (native.py) both ask this."""
    if list(params) != list(EXPECTED_PARAMS):
        return f"unexpected signature {TARGET}{tuple(params)}"
    missing = {"is_producer", "mode"} - self_attributes(node)
    if missing:
        return (
            f"{TARGET} no longer decides by self.{' / self.'.join(sorted(missing))}; the wrapper "
            "answers for the READ consumer by exactly those"
        )
    return None


def recognize() -> str:
    mc = _mc()
    cls = mc.MoRIIOConnectorScheduler
    if TARGET not in cls.__dict__:
        raise UnknownShape(f"MoRIIOConnectorScheduler.{TARGET} is not defined on the class")
    method = original_of(cls, TARGET)  # what vLLM shipped, also under a layer of ours
    reason = shape_reason(call_params(method, EXPECTED_PARAMS), function_ast(method))
    if reason:
        raise UnknownShape(reason)
    if not hasattr(mc.MoRIIOMode, "READ"):
        raise UnknownShape("MoRIIOMode has no READ member")
    name = KNOWN_SHAPES.get(ast_fingerprint(method), "structural")
    return f"{name}/{block_layout().value}"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _dcp_size(instance: Any) -> int:
    """Decode context parallel ranks (1 where the connector has no config): a DCP-sharded
    group's block holds ``block_size * dcp`` tokens (vLLM's single-type KV cache managers)."""
    try:
        return max(int(instance.vllm_config.parallel_config.decode_context_parallel_size), 1)
    except Exception:
        return 1


def _held_blocks(spec: Any, end: int, dcp: int) -> int:
    """The blocks a request holding tokens ``[0, end)`` has in a KV cache group: one for a
    state group vLLM never prefix-caches (a circular buffer: one block per request), else
    one per block of tokens (a Mamba group's slots are clipped to one by the connector)."""
    if getattr(spec, "prefix_cacheable", True) is False:
        return 1
    size = int(spec.block_size) * (dcp if getattr(spec, "dcp_sharded", False) else 1)
    return _cdiv(end, size)


def needed_blocks(instance: Any, layout: BlockLayout, num_prompt_tokens: Any) -> tuple[int, ...] | None:
    """Per block list this engine reads, the fewest remote blocks covering a claim of
    every prompt token but the last (tokens ``[0, N-1)``), asked of the connector; None
    where the connector's groups cannot be read (never raises).

    The connector itself says what it reads of a request's blocks: the block lists of a
    request holding tokens ``[0, N-1)`` (one per KV cache group) go through its own
    ``split_block_groups`` (hybrid READ: every attention group, sliding-window groups
    trimmed to their window where this vLLM trims them, then one running-state slot per
    Mamba group; vLLM 0.31 to 0.33 read one attention group, untrimmed) or
    ``get_exchange_clipped_blocks`` (transfer groups only, the last window of a
    sliding-window group)."""
    try:
        end = max(int(num_prompt_tokens) - 1, 0)
        if layout is BlockLayout.FLAT:
            return (_cdiv(end, int(instance.block_size)),)
        dcp = _dcp_size(instance)
        groups = instance.kv_cache_config.kv_cache_groups
        local = [list(range(_held_blocks(g.kv_cache_spec, end, dcp))) for g in groups]
        if getattr(instance, "_has_mamba", False):
            attn, mamba = instance.split_block_groups(local)
            # vLLM 0.31 to 0.33 return the one attention group as a flat list.
            attn_groups = attn if attn and isinstance(attn[0], list) else [attn]
            return (*(len(g) for g in attn_groups), *(len(g) for g in mamba))
        return tuple(len(g) for g in instance.get_exchange_clipped_blocks(local))
    except Exception:  # an engine we cannot read: fall back to the checks needing no facts
        return None


def routing_reason(mc: Any, request_id: Any, params: dict[str, Any]) -> str | None:
    """The routing fields, then where MoRIIO's own add_new_req routes this READ; never raises."""
    reason = params_route_reason(params)
    if reason:
        return reason
    trial = dict(params)
    trial["transfer_id"] = params.get("transfer_id") or f"sidecar-{request_id}"  # as vLLM does
    meta = mc.MoRIIOConnectorMetadata()
    try:
        meta.add_new_req(request_id=request_id, local_block_ids=[], kv_transfer_params=trial)
        req = meta.reqs_to_recv[request_id]
    except Exception as exc:  # what would fail vLLM's scheduler step
        return f"MoRIIO cannot route its READ ({type(exc).__name__}: {exc})"
    return route_reason(req.remote_host, req.remote_handshake_port, req.remote_notify_port)


class _WarnLimit:
    """At most `burst` warnings per `window` seconds; the next one says how many were held back."""

    def __init__(self, burst: int = 10, window: float = 60.0) -> None:
        self.burst, self.window = burst, window
        self._lock = threading.Lock()
        self._start = -window
        self._sent = 0
        self.suppressed = 0

    def allow(self) -> tuple[bool, int]:
        with self._lock:
            now = time.monotonic()
            if now - self._start >= self.window:
                self._start, self._sent = now, 0
            if self._sent < self.burst:
                self._sent += 1
                held, self.suppressed = self.suppressed, 0
                return True, held
            self.suppressed += 1
            return False, 0


WARN_LIMIT = _WarnLimit()


def _warn(request_id: Any, reason: str) -> None:
    if is_probing():  # the probe's own requests do not spend the budget (their lines are dropped)
        return
    ok, held = WARN_LIMIT.allow()
    if not ok:
        return
    _logger.warning(
        "MoRIIO READ: request %s asked for a remote prefill but its kv_transfer_params "
        "cannot drive a READ of the tokens it would claim (%s); recomputing its prompt "
        "locally instead%s",
        request_id,
        reason,
        f" ({held} more such requests not logged)" if held else "",
    )


def _make_wrapper(mc: Any, read_mode: Any, layout: BlockLayout) -> Any:
    def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # Producer, WRITE mode, or a class-level call: vLLM's own rule, untouched.
        if instance is None or instance.is_producer or instance.mode != read_mode:
            return wrapped(*args, **kwargs)
        request = args[0] if args else kwargs["request"]
        params = request.kv_transfer_params
        if not wants_remote_prefill(params):
            # Plain, preempted-and-resumed, already loaded, load-failure retry.
            return 0, False
        answer = wrapped(*args, **kwargs)
        try:
            claimed = int(answer[0])
        except Exception:  # not vLLM's (tokens, async) pair: its answer, untouched
            return answer
        # Checked even when nothing is claimed (a full local prefix hit): vLLM still
        # queues a notify-only READ from these params, and routes it.
        num_tokens = getattr(request, "num_prompt_tokens", None)
        needed = needed_blocks(instance, layout, num_tokens)
        reason = malformed_reason(params, layout, needed, claimed)
        request_id = getattr(request, "request_id", "?")
        if reason is None:
            reason = routing_reason(mc, request_id, dict(params))
        if reason is None:
            return answer
        _warn(request_id, reason)
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
    patch.wrap(mc.MoRIIOConnectorScheduler, TARGET, _make_wrapper(mc, mc.MoRIIOMode.READ, layout))
