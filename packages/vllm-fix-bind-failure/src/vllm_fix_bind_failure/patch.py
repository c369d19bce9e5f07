"""Apply: a listener bind failure reaches the initializing thread as ListenerBindError.

Wrappers only (nothing replaced):

* ``MoRIIOConnectorWorker._moriio_handshake_listener``: a failure before the ready event
  is set is recorded for the listener thread and the event set, so the initializing thread
  wakes up; the wrapped ``register_kv_caches`` then raises.
* ``moriio_engine.zmq_ctx`` (ROUTER sockets only, i.e. the notify listener) reports the
  bind outcome of the thread that opens it; the wrapped ``MoRIIOWrapper.async_wait_reqid``
  waits for it (``NOTIFY_BIND_TIMEOUT_S`` at most) and raises on failure. If the handshake
  listener already failed, it starts nothing more.
"""

from __future__ import annotations

import importlib
import inspect
import threading
from contextvars import ContextVar
from types import ModuleType
from typing import Any

from vllm_fix_bind_failure import watch
from vllm_fix_bind_failure.rule import ListenerBindError, bind_error_message
from vllm_fix_core import PatchSet, UnknownShape, get_logger, original_of
from vllm_fix_core.fingerprint import call_params

PACKAGE = "vllm.distributed.kv_transfer.kv_connector.v1.moriio"
CONNECTOR = f"{PACKAGE}.moriio_connector"
ENGINE = f"{PACKAGE}.moriio_engine"

# Seconds the initializing thread waits for the notify listener to report its bind.
NOTIFY_BIND_TIMEOUT_S = 10.0

_logger = get_logger("bind-failure")

__all__ = ["NOTIFY_BIND_TIMEOUT_S", "ListenerBindError", "apply", "recognize"]


def _modules() -> tuple[ModuleType, ModuleType]:
    return importlib.import_module(CONNECTOR), importlib.import_module(ENGINE)


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str, default: Any = None) -> Any:
    if len(args) > index:
        return args[index]
    return kwargs.get(name, default)


# --------------------------------------------------------------------------- handshake listener


def _listener_wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    ready = _arg(args, kwargs, 1, "ready_event")
    port = _arg(args, kwargs, 2, "base_port")
    try:
        return wrapped(*args, **kwargs)
    except BaseException as exc:
        if not isinstance(ready, threading.Event) or ready.is_set():
            raise  # failed after it was listening: vLLM's own behaviour
        watch.report(watch.Outcome(f"tcp://*:{port}", exc))
        ready.set()  # wake register_kv_caches; its wrapper raises the error
        return None


def _rank(obj: Any, name: str) -> int:
    value = getattr(obj, name, -1)
    return value if isinstance(value, int) else -1


def _raise_if_failed(worker: Any) -> None:
    outcome = watch.outcome_of(getattr(worker, "_moriio_handshake_listener_t", None))
    if outcome is None or outcome.ok:
        return
    config = getattr(worker, "moriio_config", None)
    dp, tp = _rank(worker, "dp_rank"), _rank(worker, "tp_rank")
    port = getattr(worker, "side_channel_port", None)
    raise ListenerBindError(
        bind_error_message(
            "handshake",
            port or 0,
            dp,
            tp,
            "handshake_port",
            getattr(config, "handshake_port", None),
            outcome.error,
        ),
        role="handshake",
        port=port,
        dp_rank=dp,
        tp_rank=tp,
    ) from outcome.error


_REGISTERING: ContextVar[Any] = ContextVar("vllm_fix_bind_failure_registering", default=None)


def _register_wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    token = _REGISTERING.set(instance)
    try:
        result = wrapped(*args, **kwargs)
    finally:
        _REGISTERING.reset(token)
    _raise_if_failed(instance)
    return result


# --------------------------------------------------------------------------- notify listener


def _notify_base(worker: Any) -> int | None:
    try:
        return int(worker.kv_transfer_config.kv_connector_extra_config["notify_port"])
    except Exception:
        return None


def _async_wait_wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    worker = _REGISTERING.get()
    if worker is not None:
        _raise_if_failed(worker)  # the handshake listener is dead: start nothing more
    before = getattr(instance, "notify_thread", None)
    result = wrapped(*args, **kwargs)
    thread = getattr(instance, "notify_thread", None)
    if not isinstance(thread, threading.Thread) or thread is before:
        return result
    outcome = watch.wait_for(thread, NOTIFY_BIND_TIMEOUT_S)
    if outcome is None:
        _logger.warning(
            "MoRIIO notify listener on port %s did not report a bind within %.0f s; continuing",
            getattr(instance, "notify_port", "?"),
            NOTIFY_BIND_TIMEOUT_S,
        )
    elif not outcome.ok:
        dp, tp = _rank(instance, "dp_rank"), _rank(instance, "tp_rank")
        port = getattr(instance, "notify_port", None)
        raise ListenerBindError(
            bind_error_message(
                "notify", port or 0, dp, tp, "notify_port", _notify_base(worker), outcome.error
            ),
            role="notify",
            port=port,
            dp_rank=dp,
            tp_rank=tp,
        ) from outcome.error
    return result


class _ReportingContext:
    """zmq_ctx(ROUTER, addr) that reports its bind outcome for the current thread."""

    def __init__(self, inner: Any, address: str) -> None:
        self._inner = inner
        self._address = address

    def __enter__(self) -> Any:
        try:
            sock = self._inner.__enter__()
        except BaseException as exc:
            watch.report(watch.Outcome(self._address, exc))
            raise
        watch.report(watch.Outcome(self._address))
        return sock

    def __exit__(self, *exc_info: Any) -> Any:
        return self._inner.__exit__(*exc_info)


def _zmq_ctx_wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    import zmq

    inner = wrapped(*args, **kwargs)
    if _arg(args, kwargs, 0, "socket_type") != zmq.ROUTER:
        return inner
    return _ReportingContext(inner, str(_arg(args, kwargs, 1, "addr", "")))


# --------------------------------------------------------------------------- recognize / apply


def _params(func: Any) -> list[str]:
    if isinstance(func, (staticmethod, classmethod)):
        func = func.__func__
    return list(inspect.signature(func).parameters)


def recognize() -> str:
    connector, engine = _modules()
    worker = connector.MoRIIOConnectorWorker
    listener = original_of(worker, "_moriio_handshake_listener")
    if not isinstance(listener, staticmethod) or _params(listener)[:3] != [
        "metadata",
        "ready_event",
        "base_port",
    ]:
        raise UnknownShape(
            "MoRIIOConnectorWorker._moriio_handshake_listener is not (metadata, ready_event, base_port, ...)"
        )
    if call_params(original_of(engine.MoRIIOWrapper, "async_wait_reqid")) != ["self"]:
        raise UnknownShape("MoRIIOWrapper.async_wait_reqid takes arguments")
    if _params(original_of(engine, "zmq_ctx"))[:2] != ["socket_type", "addr"]:
        raise UnknownShape("moriio_engine.zmq_ctx is not zmq_ctx(socket_type, addr)")
    return "listener-threads"


def apply(patch: PatchSet, shape: str) -> None:
    connector, engine = _modules()
    worker = connector.MoRIIOConnectorWorker
    patch.wrap(worker, "_moriio_handshake_listener", _listener_wrapper)
    patch.wrap(worker, "register_kv_caches", _register_wrapper)
    patch.wrap(engine.MoRIIOWrapper, "async_wait_reqid", _async_wait_wrapper)
    patch.wrap(engine, "zmq_ctx", _zmq_ctx_wrapper)
