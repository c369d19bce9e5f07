"""Apply: one injective port offset at every MoRIIO bind and dial site, and no silent listener death.

Wrappers only (nothing replaced):

* ``get_port_offset`` as every caller reaches it (the module globals of moriio_common,
  moriio_connector and moriio_engine: ``from x import get_port_offset`` keeps its own
  reference, so each is wrapped): a call without a TP size uses the TP size of the
  listening engine, set by the wrapper of the calling function (``rule.listening_tp_size``).
  Calls that pass a TP size keep vLLM's formula (0 = unknown = this engine's TP size).
* every vLLM function that calls ``get_port_offset(dp, tp)`` without a TP size (the site
  inventory, checked by ``recognize``): sets the listening engine's TP size.
* ``MoRIIOConnectorWorker._moriio_handshake_listener``: a bind failure before the ready
  event is recorded and the event set, so the initializing thread wakes up; the wrapped
  ``register_kv_caches`` / ``MoRIIOWrapper.async_wait_reqid`` then raise a clear error.
* ``moriio_engine.zmq_ctx`` (ROUTER only) reports the notify listener's bind outcome;
  ``async_wait_reqid`` waits for it (bounded) and raises on failure.
* ``_moriio_handshake`` + ``MoRIIOWrapper.register_remote_engine``: a dial that reaches a
  listener of another rank is refused with a message naming the convention mismatch.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
import threading
from collections.abc import Callable
from contextvars import ContextVar
from types import ModuleType
from typing import Any

from vllm_fix_core import PatchSet, UnknownShape, get_logger, original_of, parse_source
from vllm_fix_handshake_port import watch
from vllm_fix_handshake_port.rule import (
    bind_error_message,
    check_layout,
    current_listening_tp_size,
    listening_tp_size,
    mismatch_message,
    parse_engine_key,
    port_offset,
)

PACKAGE = "vllm.distributed.kv_transfer.kv_connector.v1.moriio"
COMMON = f"{PACKAGE}.moriio_common"
CONNECTOR = f"{PACKAGE}.moriio_connector"
ENGINE = f"{PACKAGE}.moriio_engine"
MODULES = {"moriio_common": COMMON, "moriio_connector": CONNECTOR, "moriio_engine": ENGINE}

# Seconds the initializing thread waits for the notify listener to report its bind.
NOTIFY_BIND_TIMEOUT_S = 10.0

_logger = get_logger("handshake-port")

Site = tuple[str, str, int]  # (module, enclosing qualname, number of arguments)

# Every get_port_offset call in the two releases (pinned by test_recognized_shape_is_this_release).
_SHARED_SITES: frozenset[Site] = frozenset(
    {
        ("moriio_common", "MoRIIOConfig.from_vllm_config", 2),
        ("moriio_connector", "MoRIIOConnectorScheduler._release_write_prefill_blocks", 2),
        ("moriio_connector", "MoRIIOConnectorScheduler.update_state_after_alloc", 2),
        ("moriio_connector", "MoRIIOConnectorWorker.__init__", 2),
        ("moriio_connector", "MoRIIOConnectorWorker._moriio_handshake", 3),
        ("moriio_connector", "MoRIIOConnectorWorker._read_blocks", 3),
    }
)
# The releases differ only in where the WRITE completion notify computes its port.
KNOWN_SITES: dict[str, frozenset[Site]] = {
    "vllm-0.32.0": _SHARED_SITES | {("moriio_engine", "MoRIIOWriter._execute_write_task", 2)},
    "vllm-0.33.0": _SHARED_SITES | {("moriio_engine", "MoRIIOWriter._resolve_notify_endpoint", 2)},
}


class ListenerBindError(RuntimeError):
    """A MoRIIO handshake/notify listener could not bind its port."""

    def __init__(self, message: str, *, role: str, port: int | None, dp_rank: int, tp_rank: int) -> None:
        super().__init__(message)
        self.role = role
        self.port = port
        self.dp_rank = dp_rank
        self.tp_rank = tp_rank


class PeerConventionMismatch(RuntimeError):
    """A handshake dial reached the listener of another rank."""


# --------------------------------------------------------------------------- modules


def _modules() -> dict[str, ModuleType]:
    return {short: importlib.import_module(name) for short, name in MODULES.items()}


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str, default: Any = None) -> Any:
    if len(args) > index:
        return args[index]
    return kwargs.get(name, default)


# --------------------------------------------------------------------------- the offset


def _offset_wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    explicit = len(args) > 2 or "tp_size" in kwargs
    size: int | None
    if explicit:
        size = int(_arg(args, kwargs, 2, "tp_size"))
        if size > 0:
            return wrapped(*args, **kwargs)  # names the listener's TP size: vLLM's formula
        # vLLM's "unknown remote TP" (0): homogeneous, as its _remote_tp_rank assumes
        size = current_listening_tp_size() or _local_tp_size()
    else:
        size = current_listening_tp_size()
    if size is None:
        return wrapped(*args, **kwargs)
    return port_offset(int(_arg(args, kwargs, 0, "dp_rank")), int(_arg(args, kwargs, 1, "tp_rank")), size)


def _local_tp_size() -> int | None:
    try:
        common = importlib.import_module(COMMON)
        return int(common.get_tensor_model_parallel_world_size())
    except Exception:
        return None


Resolver = Callable[[Any, tuple[Any, ...], dict[str, Any]], Callable[[], int]]


def _local_world(instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[[], int]:
    common = importlib.import_module(COMMON)
    return lambda: int(common.get_tensor_model_parallel_world_size())


def _own_config(instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[[], int]:
    # side_channel_port is computed after self.moriio_config exists: its tp_size is the
    # TP size from_vllm_config computed the notify port with.
    return lambda: int(instance.moriio_config.tp_size)


def _peer_tp(instance: Any, params: Any) -> int:
    connector = importlib.import_module(CONNECTOR)
    local = int(instance.tp_size)
    peer_tp_size = getattr(connector, "get_moriio_peer_tp_size", None)
    if peer_tp_size is None:  # 0.32.0: the senders loop over the local TP size
        return local
    return int(peer_tp_size(params if isinstance(params, dict) else None, local))


def _release_params(instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[[], int]:
    params = _arg(args, kwargs, 1, "params")
    return lambda: _peer_tp(instance, params)


def _request_params(instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[[], int]:
    request = _arg(args, kwargs, 0, "request")
    return lambda: _peer_tp(instance, getattr(request, "kv_transfer_params", None))


def _write_task(instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[[], int]:
    task = _arg(args, kwargs, 0, "task")
    # The decode engine listens; WriteTask.remote_tp_size (0.33.0) names its TP size,
    # unknown (and 0.32.0, which has no field) means equal to ours.
    return lambda: int(getattr(task, "remote_tp_size", None) or instance.worker.world_size)


# The listening engine's TP size at each call site that omits it.
CONTEXT_SITES: dict[tuple[str, str], Resolver] = {
    ("moriio_common", "MoRIIOConfig.from_vllm_config"): _local_world,
    ("moriio_connector", "MoRIIOConnectorWorker.__init__"): _own_config,
    ("moriio_connector", "MoRIIOConnectorScheduler._release_write_prefill_blocks"): _release_params,
    ("moriio_connector", "MoRIIOConnectorScheduler.update_state_after_alloc"): _request_params,
    ("moriio_engine", "MoRIIOWriter._execute_write_task"): _write_task,
    ("moriio_engine", "MoRIIOWriter._resolve_notify_endpoint"): _write_task,
}


def _context_wrapper(
    resolver: Resolver, after: Callable[[Any, tuple[Any, ...], dict[str, Any], Any], None] | None = None
) -> Any:
    def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        with listening_tp_size(resolver(instance, args, kwargs)):
            result = wrapped(*args, **kwargs)
        if after is not None:
            after(instance, args, kwargs, result)
        return result

    return wrapper


def _check_config_layout(cls: Any, args: tuple[Any, ...], kwargs: dict[str, Any], config: Any) -> None:
    """After from_vllm_config: the two port blocks of this host must fit and not overlap."""
    vllm_config = _arg(args, kwargs, 0, "vllm_config")
    try:
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        notify_base = int(extra["notify_port"])
        handshake_base = int(config.handshake_port)
        dp_local = int(vllm_config.parallel_config.data_parallel_size_local or 0)
        tp_size = int(config.tp_size)
    except Exception:
        return  # not the shape we check; vLLM's own validation applies
    check_layout(handshake_base, notify_base, dp_local, tp_size)


# --------------------------------------------------------------------------- listeners

_REGISTERING: ContextVar[Any] = ContextVar("vllm_fix_handshake_port_registering", default=None)


def _listener_wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    ready = _arg(args, kwargs, 1, "ready_event")
    port = _arg(args, kwargs, 2, "base_port")
    try:
        return wrapped(*args, **kwargs)
    except BaseException as exc:
        if not isinstance(ready, threading.Event) or ready.is_set():
            raise  # failed after it was listening: vLLM's own behaviour
        watch.report(watch.Outcome(f"tcp://*:{port}", exc))
        ready.set()  # wake register_kv_caches; it raises the error (see _raise_if_failed)
        return None


def _raise_if_failed(worker: Any) -> None:
    outcome = watch.outcome_of(getattr(worker, "_moriio_handshake_listener_t", None))
    if outcome is None or outcome.ok:
        return
    config = getattr(worker, "moriio_config", None)
    dp = int(getattr(worker, "dp_rank", -1))
    tp = int(getattr(worker, "tp_rank", -1))
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


def _register_wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    token = _REGISTERING.set(instance)
    try:
        result = wrapped(*args, **kwargs)
    finally:
        _REGISTERING.reset(token)
    _raise_if_failed(instance)
    return result


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
        dp = int(getattr(instance, "dp_rank", -1))
        tp = int(getattr(instance, "tp_rank", -1))
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


# --------------------------------------------------------------------------- mismatch

# (handshake base, dp, tp, dialed port) of the handshake in progress in this thread.
_DIALING: ContextVar[tuple[int, int, int, int] | None] = ContextVar(
    "vllm_fix_handshake_port_dialing", default=None
)


def _dial_expectation(
    worker: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[int, int, int, int] | None:
    try:
        base = int(_arg(args, kwargs, 1, "port"))
        size = int(_arg(args, kwargs, 2, "remote_tp_size"))
        dp = int(_arg(args, kwargs, 4, "remote_dp_rank", 0))
        tp_arg = _arg(args, kwargs, 5, "remote_tp_rank")
        tp = int(tp_arg) if tp_arg is not None else int(worker._remote_tp_rank(size))
        size = size if size > 0 else int(worker.world_size)
        return base, dp, tp, base + port_offset(dp, tp, size)
    except Exception:
        return None


def _handshake_dial_wrapper(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    token = _DIALING.set(_dial_expectation(instance, args, kwargs))
    try:
        return wrapped(*args, **kwargs)
    finally:
        _DIALING.reset(token)


def _register_remote_wrapper(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    key = wrapped(*args, **kwargs)
    want = _DIALING.get()
    got = parse_engine_key(key)
    if want is not None and got is not None and got[1:] != want[1:3]:
        raise PeerConventionMismatch(mismatch_message(want[3], want[:3], got, str(key)))
    return key


# --------------------------------------------------------------------------- recognize


def _calls(module: ModuleType, short: str) -> set[Site]:
    tree = parse_source(textwrap.dedent(inspect.getsource(module)))
    found: set[Site] = set()

    def visit(node: ast.AST, stack: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, [*stack, child.name])
                continue
            if (
                isinstance(child, ast.Call)
                and isinstance(child.func, (ast.Name, ast.Attribute))
                and (child.func.id if isinstance(child.func, ast.Name) else child.func.attr)
                == "get_port_offset"
            ):
                found.add((short, ".".join(stack), len(child.args) + len(child.keywords)))
            visit(child, stack)

    visit(tree, [])
    return found


def call_sites() -> frozenset[Site]:
    """Every get_port_offset call in the three MoRIIO modules."""
    sites: set[Site] = set()
    for short, module in _modules().items():
        sites |= _calls(module, short)
    return frozenset(sites)


def check_sites(sites: frozenset[Site]) -> None:
    """Every call that omits the TP size must be a site whose listening TP size we know."""
    unknown = sorted(f"{m}:{q}" for m, q, n in sites if n < 3 and (m, q) not in CONTEXT_SITES)
    if unknown:
        raise UnknownShape(
            "get_port_offset(dp, tp) without a TP size in unknown places: " + ", ".join(unknown)
        )


def _resolve(module: ModuleType, qualname: str) -> tuple[Any, str]:
    owner: Any = module
    *parents, attr = qualname.split(".")
    for name in parents:
        owner = getattr(owner, name)
    if not hasattr(owner, attr):
        raise UnknownShape(f"{module.__name__}.{qualname} is missing")
    return owner, attr


def _params(func: Any) -> list[str]:
    if isinstance(func, (staticmethod, classmethod)):
        func = func.__func__
    return list(inspect.signature(func).parameters)


def recognize() -> str:
    mods = _modules()
    common = mods["moriio_common"]
    offset = original_of(common, "get_port_offset")
    sig = inspect.signature(offset)
    if list(sig.parameters) != ["dp_rank", "tp_rank", "tp_size"] or sig.parameters["tp_size"].default != 1:
        raise UnknownShape(f"get_port_offset{sig} is not get_port_offset(dp_rank, tp_rank, tp_size=1)")
    if offset(1, 0, 2) != 2 or offset(3, 1, 4) != 13:
        raise UnknownShape("get_port_offset(dp, tp, tp_size) is no longer dp * tp_size + tp")
    for short, module in mods.items():
        if hasattr(module, "get_port_offset") and original_of(module, "get_port_offset") is not offset:
            raise UnknownShape(f"{short}.get_port_offset is not moriio_common.get_port_offset")
    sites = call_sites()
    check_sites(sites)
    for m, q, _ in sites:
        _resolve(mods[m], q)
    connector, engine = mods["moriio_connector"], mods["moriio_engine"]
    worker = connector.MoRIIOConnectorWorker
    try:
        listener = original_of(worker, "_moriio_handshake_listener")
        dial = original_of(worker, "_moriio_handshake")
    except AttributeError as exc:
        raise UnknownShape(str(exc)) from exc
    if not isinstance(listener, staticmethod) or _params(listener)[:3] != [
        "metadata",
        "ready_event",
        "base_port",
    ]:
        raise UnknownShape("MoRIIOConnectorWorker._moriio_handshake_listener changed shape")
    if _params(dial)[:7] != [
        "self",
        "host",
        "port",
        "remote_tp_size",
        "expected_engine_id",
        "remote_dp_rank",
        "remote_tp_rank",
    ]:
        raise UnknownShape("MoRIIOConnectorWorker._moriio_handshake changed signature")
    for owner, attr in (
        (worker, "register_kv_caches"),
        (engine.MoRIIOWrapper, "async_wait_reqid"),
        (engine.MoRIIOWrapper, "register_remote_engine"),
        (engine, "zmq_ctx"),
    ):
        if not hasattr(owner, attr):
            raise UnknownShape(f"{getattr(owner, '__name__', owner)}.{attr} is missing")
    for name, known in KNOWN_SITES.items():
        if sites == known:
            return name
    return "structural"


# --------------------------------------------------------------------------- apply


def apply(patch: PatchSet, shape: str) -> None:
    mods = _modules()
    for module in mods.values():
        if hasattr(module, "get_port_offset"):
            patch.wrap(module, "get_port_offset", _offset_wrapper)
    sites = KNOWN_SITES.get(shape) or call_sites()
    for m, q, n in sorted(sites):
        if n >= 3:
            continue
        owner, attr = _resolve(mods[m], q)
        after = _check_config_layout if q == "MoRIIOConfig.from_vllm_config" else None
        patch.wrap(owner, attr, _context_wrapper(CONTEXT_SITES[(m, q)], after))
    connector, engine = mods["moriio_connector"], mods["moriio_engine"]
    worker = connector.MoRIIOConnectorWorker
    patch.wrap(worker, "_moriio_handshake_listener", _listener_wrapper)
    patch.wrap(worker, "register_kv_caches", _register_wrapper)
    patch.wrap(worker, "_moriio_handshake", _handshake_dial_wrapper)
    patch.wrap(engine.MoRIIOWrapper, "async_wait_reqid", _async_wait_wrapper)
    patch.wrap(engine.MoRIIOWrapper, "register_remote_engine", _register_remote_wrapper)
    patch.wrap(engine, "zmq_ctx", _zmq_ctx_wrapper)
