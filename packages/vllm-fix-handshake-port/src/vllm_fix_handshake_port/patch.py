"""Apply: one injective port offset at every MoRIIO bind and dial site, and a port-layout check.

Wrappers only (nothing replaced):

* ``get_port_offset`` as every caller reaches it (the module globals of moriio_common,
  moriio_connector and moriio_engine: ``from x import get_port_offset`` keeps its own
  reference, so each is wrapped). A call that names a TP size keeps vLLM's formula (0,
  vLLM's "unknown", means this engine's TP size, as vLLM's ``_remote_tp_rank`` assumes).
  A call without one uses the TP size of the engine that listens on the port:

  - inside a sender (a ``MoRIIOConnectorScheduler`` or ``MoRIIOWriter`` method that calls
    it), the peer's TP size, set by the sender's wrapper (``rule.listening_tp_size``);
  - anywhere else (the listener sites ``MoRIIOConfig.from_vllm_config`` and
    ``MoRIIOConnectorWorker.__init__``), this engine's TP size, read where vLLM's own
    ``from_vllm_config`` reads it (``get_tensor_model_parallel_world_size``).

  Where that state is missing (no TP group in this process, a worker without
  ``world_size``), the call keeps vLLM's formula: the fix never raises into vLLM.
* ``MoRIIOConfig.from_vllm_config``: rejects handshake/notify bases whose blocks of
  ``DP_local x TP`` ports overlap or run past 65535 (``rule.PortLayoutError``).

``recognize`` finds the callers of ``get_port_offset`` from the functions' code objects
(names they load), not by parsing modules, and classifies each by where it sits; only a
caller it cannot classify is parsed (its own source only), and refused if it omits the TP
size. See the README, "Supported releases".
"""

from __future__ import annotations

import ast
import importlib
import inspect
import threading
import types
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from vllm_fix_core import PatchSet, UnknownShape, function_ast, get_logger, original_of
from vllm_fix_handshake_port.rule import (
    check_layout,
    current_listening_tp_size,
    listening_tp_size,
)

PACKAGE = "vllm.distributed.kv_transfer.kv_connector.v1.moriio"
COMMON = f"{PACKAGE}.moriio_common"
CONNECTOR = f"{PACKAGE}.moriio_connector"
ENGINE = f"{PACKAGE}.moriio_engine"
MODULES = {"moriio_common": COMMON, "moriio_connector": CONNECTOR, "moriio_engine": ENGINE}

SENDER_CLASS = "MoRIIOConnectorScheduler"  # sends to the peer engine's notify listeners
WRITER_CLASS = "MoRIIOWriter"  # sends WRITE completion to the decode engine's listeners
# Callers that bind a port of this engine (the TP size is this engine's).
LISTENER_SITES = frozenset(
    {
        ("moriio_common", "MoRIIOConfig.from_vllm_config"),
        ("moriio_connector", "MoRIIOConnectorWorker.__init__"),
    }
)

_logger = get_logger("handshake-port")

Site = tuple[str, str]  # (module short name, qualname of the calling function)

# The caller inventories seen in releases (pinned by test_recognized_shape_is_this_release on
# the session releases; 0.14.1-0.23.0 checked by the release matrix).
# Every release since MoRIIO entered vLLM (0.14) has these callers.
_FIRST_SITES: frozenset[Site] = frozenset(
    {
        ("moriio_common", "MoRIIOConfig.from_vllm_config"),
        ("moriio_connector", "MoRIIOConnectorScheduler.update_state_after_alloc"),
        ("moriio_connector", "MoRIIOConnectorWorker.__init__"),
        ("moriio_connector", "MoRIIOConnectorWorker._moriio_handshake"),
    }
)
# 0.24 added the WRITE prefill-block release sender.
_RELEASE = ("moriio_connector", "MoRIIOConnectorScheduler._release_write_prefill_blocks")
_SHARED_SITES = _FIRST_SITES | {_RELEASE}
_READ = ("moriio_connector", "MoRIIOConnectorWorker._read_blocks")
_FINALIZE = ("moriio_engine", "MoRIIOWriter._finalize_if_complete")
KNOWN_SITES: dict[str, frozenset[Site]] = {
    # no release sender; the handshake dial omits the TP size; no READ release; WRITE port in
    # finalize (finalize takes the task up to 0.23, the transfer id from 0.24)
    "vllm-0.14-0.23": _FIRST_SITES | {_FINALIZE},
    # the handshake dial omits the TP size; no READ release; WRITE port in finalize
    "vllm-0.24-0.26": _SHARED_SITES | {_FINALIZE},
    "vllm-0.27-0.30": _SHARED_SITES | {_READ, _FINALIZE},
    "vllm-0.31-0.32": _SHARED_SITES | {_READ, ("moriio_engine", "MoRIIOWriter._execute_write_task")},
    "vllm-0.33": _SHARED_SITES | {_READ, ("moriio_engine", "MoRIIOWriter._resolve_notify_endpoint")},
}
WORKER_CLASS = "MoRIIOConnectorWorker"


# --------------------------------------------------------------------------- modules


def _modules() -> dict[str, ModuleType]:
    return {short: importlib.import_module(name) for short, name in MODULES.items()}


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str, default: Any = None) -> Any:
    if len(args) > index:
        return args[index]
    return kwargs.get(name, default)


# --------------------------------------------------------------------------- the offset


def _local_tp_size(module: ModuleType) -> int | None:
    """This engine's TP size as vLLM's from_vllm_config reads it; None where no TP group exists."""
    getter = getattr(module, "get_tensor_model_parallel_world_size", None)
    if getter is None:
        getter = getattr(importlib.import_module(COMMON), "get_tensor_model_parallel_world_size", None)
    if getter is None:
        return None
    try:
        size = int(getter())
    except Exception:  # no initialized TP group here: keep vLLM's formula
        return None
    return size if size > 0 else None


_warned = threading.Event()


def _offset_wrapper_for(module: ModuleType) -> Callable[..., Any]:
    def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        explicit = len(args) > 2 or "tp_size" in kwargs
        size: int | None
        if explicit:
            named = _arg(args, kwargs, 2, "tp_size")
            if not isinstance(named, int) or named != 0:
                return wrapped(*args, **kwargs)  # names the listener's TP size: vLLM's formula
            # vLLM's "unknown remote TP" (0): homogeneous, as its _remote_tp_rank assumes
            size = current_listening_tp_size() or _local_tp_size(module)
        else:
            size = current_listening_tp_size()
            if size is None:
                size = _local_tp_size(module)  # a listener site: this engine listens
        dp, tp = _arg(args, kwargs, 0, "dp_rank"), _arg(args, kwargs, 1, "tp_rank")
        if size is None or not isinstance(dp, int) or not isinstance(tp, int):
            return wrapped(*args, **kwargs)
        if dp < 0 or not 0 <= tp < size:
            if not _warned.is_set():
                _warned.set()
                _logger.warning(
                    "get_port_offset(%s, %s) with a listening TP size of %s: the rank is outside "
                    "the listening engine; using vLLM's offset for it",
                    dp,
                    tp,
                    size,
                )
            return wrapped(*args, **kwargs)
        return dp * size + tp

    return wrapper


# --------------------------------------------------------------------------- senders


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


def _sender_tp(func: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    bound = _bound(func, instance, args, kwargs)
    params = bound.get("params")
    if params is None and "request" in bound:
        params = getattr(bound["request"], "kv_transfer_params", None)
    return _peer_tp_size(instance, params)


def _writer_tp(func: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
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


def _dialer_tp(func: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """A worker dialing a peer's listener without a TP size: its remote_tp_size argument,
    or, unknown (0, or no such argument), this worker's world_size (vLLM's homogeneous case)."""
    size = _bound(func, instance, args, kwargs).get("remote_tp_size")
    if isinstance(size, int) and size > 0:
        return size
    size = getattr(instance, "world_size", None)
    return size if isinstance(size, int) and size > 0 else None


Resolver = Callable[[Any, Any, tuple[Any, ...], dict[str, Any]], "int | None"]


def _context_wrapper(func: Any, resolver: Resolver) -> Callable[..., Any]:
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


def _check_config_layout(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """After from_vllm_config: the two port blocks of this host must fit and not overlap."""
    config = wrapped(*args, **kwargs)
    vllm_config = _arg(args, kwargs, 0, "vllm_config")
    try:
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        notify_base = int(extra["notify_port"])
        handshake_base = int(config.handshake_port)
        dp_local = int(vllm_config.parallel_config.data_parallel_size_local or 0)
        tp_size = int(config.tp_size)
    except Exception:
        return config  # not the shape we check; vLLM's own validation applies
    check_layout(handshake_base, notify_base, dp_local, tp_size)
    return config


# --------------------------------------------------------------------------- recognize


def _unwrap(obj: Any) -> Any:
    if isinstance(obj, (classmethod, staticmethod)):
        obj = obj.__func__
    for _ in range(16):
        inner = getattr(obj, "__wrapped__", None)
        if inner is None:
            break
        obj = inner
        if isinstance(obj, (classmethod, staticmethod)):
            obj = obj.__func__
    return obj


def _loads_name(code: types.CodeType, name: str) -> bool:
    if name in code.co_names:
        return True
    return any(isinstance(c, types.CodeType) and _loads_name(c, name) for c in code.co_consts)


def _functions(module: ModuleType) -> Iterator[tuple[str, Any]]:
    """(qualname, function) of the module's own functions and its classes' methods."""
    for name, obj in list(vars(module).items()):
        if isinstance(obj, type):
            if obj.__module__ != module.__name__:
                continue
            for attr, raw in list(vars(obj).items()):
                if isinstance(raw, property):
                    raw = raw.fget
                elif not isinstance(raw, (types.FunctionType, staticmethod, classmethod)):
                    continue
                func = _unwrap(raw)
                if isinstance(func, types.FunctionType):
                    yield f"{name}.{attr}", func
        elif isinstance(obj, types.FunctionType):
            func = _unwrap(obj)
            if isinstance(func, types.FunctionType) and func.__module__ == module.__name__:
                yield name, func


# The last inventory recognize() found, reused by apply() while every function is unchanged.
_LAST: dict[Site, Any] = {}


def _still_current(found: dict[Site, Any]) -> bool:
    mods = _modules()
    try:
        return bool(found) and all(
            _unwrap(vars(owner)[attr]) is func
            for (m, q), func in found.items()
            for owner, attr in [_owner(mods[m], q)]
        )
    except (AttributeError, KeyError):
        return False


def callers(*, reuse: bool = False) -> dict[Site, Any]:
    """Every function of the three MoRIIO modules that calls get_port_offset (from code objects).

    ``reuse``: take the inventory the last scan found, once, if its functions are unchanged
    (apply right after recognize, in one decision).
    """
    if reuse and _still_current(_LAST):
        last = dict(_LAST)
        _LAST.clear()
        return last
    found: dict[Site, Any] = {}
    for short, module in _modules().items():
        for qualname, func in _functions(module):
            if _loads_name(func.__code__, "get_port_offset"):
                found[(short, qualname)] = func
    _LAST.clear()
    _LAST.update(found)
    return found


_ARITY_CACHE: dict[types.CodeType, bool] = {}


def _names_tp_size(call: ast.expr) -> bool:
    return isinstance(call, ast.Call) and (
        len(call.args) >= 3 or any(k.arg == "tp_size" for k in call.keywords)
    )


def _calls_from_bytecode(func: Any) -> list[ast.expr] | None:
    """The get_port_offset call expressions of `func`, each parsed from its own source span.

    The span comes from the CALL instruction's positions (Python 3.11+); only those few
    characters are parsed. None when that is not possible (then the function is parsed).
    """
    import dis
    import linecache

    lines = linecache.getlines(func.__code__.co_filename)
    if not lines:
        return None
    first = 1
    codes = [func.__code__]
    calls: list[ast.expr] = []
    while codes:
        code = codes.pop()
        codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
        instructions = list(dis.get_instructions(code))
        for load in instructions:
            if load.argval != "get_port_offset" or not load.opname.startswith("LOAD_"):
                continue
            start = getattr(load, "positions", None)
            if start is None or start.lineno is None:
                return None
            span = next(
                (
                    i.positions
                    for i in instructions
                    if i.opname == "CALL"
                    and i.positions is not None
                    and (i.positions.lineno, i.positions.col_offset) == (start.lineno, start.col_offset)
                ),
                None,
            )
            if span is None or None in (span.lineno, span.end_lineno, span.col_offset, span.end_col_offset):
                return None
            assert span.lineno is not None and span.end_lineno is not None  # for the type checker
            chunk = [line.encode() for line in lines[span.lineno - first : span.end_lineno - first + 1]]
            if not chunk:
                return None
            chunk[-1] = chunk[-1][: span.end_col_offset]
            chunk[0] = chunk[0][span.col_offset :]
            try:
                calls.append(ast.parse(b"".join(chunk).decode().strip(), mode="eval").body)
            except (SyntaxError, UnicodeDecodeError):
                return None
    return calls or None  # referenced but no call found here: parse the function


def names_tp_size_everywhere(func: Any) -> bool:
    """Does every get_port_offset call in `func` pass a TP size? (Parses its calls only.)"""
    code = func.__code__
    cached = _ARITY_CACHE.get(code)
    if cached is None:
        calls = _calls_from_bytecode(func)
        if calls is None:
            calls = [
                node
                for node in ast.walk(function_ast(func))
                if isinstance(node, ast.Call)
                and (node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None))
                == "get_port_offset"
            ]
        cached = all(_names_tp_size(c) for c in calls)
        _ARITY_CACHE[code] = cached
    return cached


def classify(site: Site, func: Any) -> str:
    """'listener', 'sender', 'writer', 'dialer' or 'explicit'; UnknownShape for a caller it
    cannot place."""
    _, qualname = site
    owner = qualname.rpartition(".")[0]
    if site in LISTENER_SITES:
        return "listener"
    if owner == SENDER_CLASS:
        return "sender"
    if owner == WRITER_CLASS:
        return "writer"
    if names_tp_size_everywhere(func):
        return "explicit"
    if owner == WORKER_CLASS and (
        "remote_tp_size" in inspect.signature(func).parameters or qualname.endswith("._moriio_handshake")
    ):
        return "dialer"  # dials a peer's listener; the peer's TP size is its remote_tp_size
    raise UnknownShape(
        f"{site[0]}:{qualname} calls get_port_offset without a TP size, and it is neither a "
        "listener site, a scheduler sender, the WRITE notify sender nor a worker dial with a "
        "remote_tp_size: the listening engine's TP size there is unknown"
    )


def _check_sender(site: Site, func: Any) -> None:
    """A scheduler sender must show where the peer's TP size comes from."""
    params = set(inspect.signature(func).parameters)
    connector = importlib.import_module(CONNECTOR)
    if hasattr(connector, "get_moriio_peer_tp_size") and not params & {"params", "request"}:
        raise UnknownShape(
            f"{site[0]}:{site[1]} sends to a peer without 'params' or 'request': its peer TP size is unknown"
        )


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
    found = callers()
    for site, func in found.items():
        if classify(site, func) == "sender":
            _check_sender(site, func)
    if not set(found) >= LISTENER_SITES:
        missing = ", ".join(f"{m}:{q}" for m, q in sorted(LISTENER_SITES - set(found)))
        raise UnknownShape(f"the listener sites moved: {missing} no longer calls get_port_offset")
    for name, known in KNOWN_SITES.items():
        if set(found) == known:
            return name
    return "structural"


# --------------------------------------------------------------------------- apply


def _owner(module: ModuleType, qualname: str) -> tuple[Any, str]:
    owner: Any = module
    *parents, attr = qualname.split(".")
    for name in parents:
        owner = getattr(owner, name)
    return owner, attr


_RESOLVERS: dict[str, Resolver] = {"sender": _sender_tp, "writer": _writer_tp, "dialer": _dialer_tp}


def apply(patch: PatchSet, shape: str) -> None:
    mods = _modules()
    for module in mods.values():
        if hasattr(module, "get_port_offset"):
            patch.wrap(module, "get_port_offset", _offset_wrapper_for(module))
    for site, func in sorted(callers(reuse=True).items()):
        resolver = _RESOLVERS.get(classify(site, func))
        if resolver is None:
            continue
        owner, attr = _owner(mods[site[0]], site[1])
        patch.wrap(owner, attr, _context_wrapper(func, resolver))
    patch.wrap(mods["moriio_common"].MoRIIOConfig, "from_vllm_config", _check_config_layout)
