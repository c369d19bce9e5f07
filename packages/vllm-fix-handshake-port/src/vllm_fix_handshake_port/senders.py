"""The notify and dial side: the TP size of the engine a sender, the WRITE notify writer or a
dialer reaches, set for the duration of its call (``rule.listening_tp_size``) so that every
``get_port_offset`` it makes sizes the offset with the listener's TP size.

* a scheduler sender (``MoRIIOConnectorScheduler``): the peer's TP size, as the sender's own
  loop counts it (``get_moriio_peer_tp_size`` of its params; our TP size before heterogeneous TP);
* the WRITE notify writer (``MoRIIOWriter``): the decode engine's TP size its task names, else
  vLLM's assumption (ours);
* a dialer (``MoRIIOConnectorWorker``): its ``remote_tp_size``, else this worker's world size.

Where that state is missing or unfamiliar, the call runs as vLLM's: never an error of ours.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from vllm_fix_handshake_port.rule import listening_tp_size
from vllm_fix_handshake_port.sites import CONNECTOR


def _bound(func: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments by parameter name (empty when they do not bind)."""
    try:
        signature = inspect.signature(func)
        if instance is not None:
            return dict(signature.bind(instance, *args, **kwargs).arguments)
        return dict(signature.bind(*args, **kwargs).arguments)
    except (TypeError, ValueError):
        return {}


def _peer_tp_size(instance: Any, params: Any) -> int | None:
    """The TP size of the peer a scheduler sends to, as the sender's own loop counts it."""
    local = getattr(instance, "tp_size", None)
    if not isinstance(local, int) or local < 1:
        return None
    connector = importlib.import_module(CONNECTOR)
    peer_tp_size = getattr(connector, "get_moriio_peer_tp_size", None)
    if peer_tp_size is None:  # releases before heterogeneous TP: the senders loop over our TP size
        return local
    return int(peer_tp_size(params if isinstance(params, dict) else None, local))


def sender_tp(func: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    bound = _bound(func, instance, args, kwargs)
    params = bound.get("params")
    if params is None and "request" in bound:
        params = getattr(bound["request"], "kv_transfer_params", None)
    return _peer_tp_size(instance, params)


def writer_tp(func: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """The decode engine's TP size for a WRITE notify: what the task says, else vLLM's assumption."""
    task = _bound(func, instance, args, kwargs).get("task")
    size = getattr(task, "remote_tp_size", None)
    if isinstance(size, int) and size > 0:
        return size
    mapping = getattr(task, "tp_mapping", None)
    size = getattr(mapping, "consumer_tp_size", None)
    if isinstance(size, int) and size > 0:
        return size  # vLLM's own mapping: the peer's size, or ours when unknown
    # Unknown: vLLM's writer assumes the decode TP size equals ours (its world_size).
    size = getattr(getattr(instance, "worker", None), "world_size", None)
    return size if isinstance(size, int) and size > 0 else None


def dialer_tp(func: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """A worker dialing a peer's listener without a TP size: its remote_tp_size argument,
    or, unknown (0, or no such argument), this worker's world_size (vLLM's homogeneous case)."""
    size = _bound(func, instance, args, kwargs).get("remote_tp_size")
    if isinstance(size, int) and size > 0:
        return size
    size = getattr(instance, "world_size", None)
    return size if isinstance(size, int) and size > 0 else None


Resolver = Callable[[Any, Any, tuple[Any, ...], dict[str, Any]], "int | None"]

# What each kind of caller (sites.classify) resolves the listening TP size from.
RESOLVERS: dict[str, Resolver] = {"sender": sender_tp, "writer": writer_tp, "dialer": dialer_tp}


def context_wrapper(func: Any, resolver: Resolver) -> Callable[..., Any]:
    """The wrapper of a caller `func`: its call runs with the TP size `resolver` finds listening."""
    raw = func.__func__ if isinstance(func, (staticmethod, classmethod)) else func

    def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            size = resolver(raw, instance, args, kwargs)
        except Exception:  # state missing or unfamiliar: vLLM's behaviour, never an error of ours
            size = None
        if size is None:
            return wrapped(*args, **kwargs)
        with listening_tp_size(size):
            return wrapped(*args, **kwargs)

    return wrapper
