"""What differs between the vLLM releases with MoRIIO (0.14.0 on), in one place.

Everything here is asked of the installed code (signatures, dataclass fields, class
bases), never of a version number, so a fork built from any of these releases gets the
shape its own code has. What the eras are, for the README:

* ``Request.__init__`` takes a required ``eos_token_id`` before vLLM 0.24.0 (0.14 to
  0.23); later releases dropped it. :func:`new_request` fills every required parameter
  the installed constructor has and the engine core's own fields do not name with None.
* Where a READ goes. Before vLLM 0.20.0, ``MoRIIOConnectorMetadata.add_new_req`` reads
  ``remote_host``, ``remote_port``, ``remote_handshake_port`` and ``remote_notify_port``
  from the params (a missing key fails the scheduler step; ``update_state_after_alloc``
  queues no READ without ``remote_host`` / ``remote_port``); 0.20.0 to 0.23.x parse the
  prefill's address from the request id only (the router embeds it:
  :func:`router_request_id`); from 0.24.0 the params' host and ports first, the request id
  where they are missing. :func:`route_fields` adds ``remote_port`` where the installed
  ``add_new_req`` reads that key.
* ``remote_block_ids``: one flat list before vLLM 0.30.0, one list per KV cache group
  from 0.30.0 (MoRIIO a ``SupportsHMA`` connector): :func:`block_layout`.
* vLLM's own READ claim is ``len(prompt_token_ids) - 1 - num_computed_tokens`` before
  vLLM 0.31.0 (unclamped: ``-1`` for ``num_computed_tokens == N``, a value vLLM's
  scheduler never passes for a request still asking for its remote prefill) and
  ``max(num_prompt_tokens - num_computed_tokens - 1, 0)`` from 0.31.0. The fix passes
  vLLM's answer through for eligible requests on every release (see the README).
"""

from __future__ import annotations

import ast
import inspect
from typing import Any

from vllm_fix_core import function_ast
from vllm_fix_read_eligibility.rule import BlockLayout


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


def _keys_read_by_add_new_req() -> set[str]:
    """The params keys MoRIIO's ``add_new_req`` reads by subscript (``params["key"]``)."""
    try:
        node = function_ast(_mc().MoRIIOConnectorMetadata.add_new_req)
    except Exception:  # a build without sources: no key known to be required
        return set()
    return {
        sub.slice.value
        for sub in ast.walk(node)
        if isinstance(sub, ast.Subscript)
        and isinstance(sub.slice, ast.Constant)
        and isinstance(sub.slice.value, str)
    }


def router_request_id(host: str, handshake_port: int, notify_port: int, suffix: str = "0" * 32) -> str:
    """A request id in the form vLLM's MoRIIO router gives it, embedding the prefill's
    (and, here the same, the decode's) zmq address; 0.20.0 to 0.23.x route a READ by it
    alone, later releases where the params carry no host/ports."""
    zmq = f"host:{host},handshake:{handshake_port},notify:{notify_port}"
    return f"cmpl-___prefill_addr_{zmq}___decode_addr_{zmq}_{suffix}"


def route_fields(host: str, handshake_port: int, notify_port: int) -> dict[str, Any]:
    """The routing fields of a READ's params as this vLLM's proxy sends them: host,
    handshake and notify port, and ``remote_port`` (the prefill's handshake port) where
    MoRIIO's ``add_new_req`` reads it from the params (before vLLM 0.20.0)."""
    fields: dict[str, Any] = {
        "remote_host": host,
        "remote_handshake_port": handshake_port,
        "remote_notify_port": notify_port,
    }
    if "remote_port" in _keys_read_by_add_new_req():
        fields["remote_port"] = handshake_port
    return fields


def new_request(request_id: str, prompt_token_ids: list[int], sampling_params: Any, **extra: Any) -> Any:
    """A real vLLM ``Request``, built from the installed constructor's signature: the
    fields every release takes by name, ``extra`` where this release takes them, and None
    for any other required parameter (``eos_token_id`` before vLLM 0.24.0)."""
    from vllm.v1.request import Request

    params = inspect.signature(Request.__init__).parameters
    kwargs: dict[str, Any] = {
        "request_id": request_id,
        "prompt_token_ids": prompt_token_ids,
        "sampling_params": sampling_params,
        "pooling_params": None,
    }
    kwargs.update({k: v for k, v in extra.items() if k in params})
    for name, param in params.items():
        if name == "self" or name in kwargs or param.default is not inspect.Parameter.empty:
            continue
        if param.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        kwargs[name] = None
    return Request(**kwargs)
