"""A MoRIIO worker built by vLLM's own (installed) ``MoRIIOConnectorWorker.__init__``, for probes.

Shared by the MoRIIO fixes whose probes must drive the worker's own start-up path (its
``__init__``, its ``register_kv_caches``) as installed: vLLM's body with whatever is layered on
it. What is stood in for is only what a probing process lacks, for the duration of one block:

* MORI's names, which vLLM's MoRIIO modules import from ``mori.io`` (absent on a CPU
  machine; on a real host the probe must not open the native engine either):
  :class:`EngineStandIn` registers no memory and opens no RDMA queue; for the RDMA backend
  it binds its control-plane listener as MORI's ``TCPContext::Listen`` does
  (``SO_REUSEADDR``, ``bind`` on the configured host and port, ``listen``; a failed bind
  raises the ``OSError`` where MORI would ``exit(-1)``) and reports the port it is bound to
  (MORI from v0.1.0; for a non-zero port every MORI does);
* the attention-backend lookup in ``__init__`` (platform-specific);
* the world and tensor-parallel groups, only where this process has none yet (a real group
  is used as it is).

Each stood-in module attribute is put back when the block ends only if it still holds the
stand-in (a real value another thread installed meanwhile, say ``parallel_state._TP``, is
kept); an attribute that was absent is removed again. The moriio role that ``__init__`` sets
is put back too. No fix's patch calls anything here.

**Ports**: the probes bind only ports the kernel picks. vLLM's ``from_vllm_config`` takes
``local_kv_port`` / ``local_ping_port`` from ``get_open_port()``, which scans from
``VLLM_PORT`` when it is set; a probe calls it (and the worker's ``__init__``, which calls it)
through :func:`installed`: the installed object with every wrapt layer on it kept (the fixes'
wrappers, anything else layered the same way), vLLM's own function at the bottom run with a
*private copy* of its module's globals in which ``get_open_port`` is :func:`kernel_port`.
Nothing module-wide changes, so another thread calling the same vLLM code meanwhile gets
vLLM's own behaviour.

**Threads**: a thread vLLM's code starts for the probe's objects (a handshake or notify
listener) is a :class:`GuestThread` (the same private-globals call gives vLLM's code a
``threading`` whose ``Thread`` it is): quiet from its first line (``guest.quiet_thread``),
its uncaught exception kept on the thread instead of going to ``threading.excepthook``, and
:func:`guest_threads` waits for every one of them to end.

What the probes build their vLLM objects from is here too, one copy for every MoRIIO probe
(and for the test support package, which extends it): :func:`extra_config` /
:func:`parallel_config` / :func:`vllm_config` / :func:`with_worker_configs` (vLLM's own
``VllmConfig``, ``KVTransferConfig``, ``ParallelConfig``, ``CacheConfig``, ``SchedulerConfig``
and ``ModelConfig``, built by ``guest.build``: every other field at vLLM's default, no
``__post_init__``, so no platform hook), :func:`kv_cache_config` / :func:`kv_caches` (vLLM's
``KVCacheConfig``, a page-aligned CPU cache), :func:`scheduler_without_requests` (vLLM's
``MoRIIOConnectorScheduler`` holding no requests), and, for driving ``MoRIIOWriter``'s notify
path, :class:`NotifyTransportStandIn` and :class:`WriterWorkerStandIn`.
"""

from __future__ import annotations

import dataclasses
import inspect
import mmap
import socket
import threading
import time
import types
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from types import ModuleType, SimpleNamespace
from typing import Any, ClassVar

from vllm_fix_core.guest import build, quiet_thread

HOST = "127.0.0.1"
LAYER = "model.layers.0.self_attn.attn"
BLOCK_SIZE = 16
HEAD_SIZE = 64

_MISSING = object()
_LOCK = threading.Lock()


class _Packed:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def pack(self) -> bytes:
        return self.data


class _Desc(_Packed):
    def __init__(self, key: str, host: str, port: int) -> None:
        super().__init__(key.encode())
        self.key = key
        self.host = host
        self.port = port


class EngineStandIn:
    """``mori.io.IOEngine(key, IOEngineConfig(host, port))`` with no native resources.

    A subclass with ``kernel_port = True`` listens on a port the kernel picks whatever the
    configured one is (for a probe that does not look at the KV listener's port).
    Every engine whose listener is open is in :attr:`engines` (closed when a probe ends).
    """

    kernel_port: ClassVar[bool] = False
    engines: ClassVar[list[EngineStandIn]] = []

    def __init__(self, key: str, config: Any) -> None:
        self.key = key
        self.config = config
        self.listener: socket.socket | None = None

    def create_backend(self, backend_type: Any, backend_config: Any = None) -> None:
        if str(getattr(backend_type, "value", backend_type)).lower() != "rdma":
            return
        host, port = str(self.config.host), int(self.config.port)
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, 0 if self.kernel_port else port))
            sock.listen(1)
        except BaseException:
            sock.close()
            raise
        self.listener = sock
        EngineStandIn.engines.append(self)

    def get_engine_desc(self) -> _Desc:
        port = int(self.listener.getsockname()[1]) if self.listener is not None else int(self.config.port)
        return _Desc(self.key, str(self.config.host), port)

    def register_torch_tensor(self, tensor: Any) -> _Packed:
        return _Packed(b"probe-memory")

    def register_remote_engine(self, desc: Any) -> None:
        return None

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None


def _engine_config(host: str, port: int) -> Any:
    return SimpleNamespace(host=host, port=port)


def _backend_config(*args: Any, **kwargs: Any) -> None:
    return None


@contextmanager
def _attributes(changes: list[tuple[Any, str, Any]]) -> Iterator[None]:
    """Set each (owner, name, value) for the block; afterwards put back what was there (or
    remove the name again) only where the name still holds our value: a value someone else
    installed meanwhile (a real TP group, another patch) is theirs and stays."""
    saved: list[tuple[Any, str, Any, Any]] = []
    try:
        for owner, name, value in changes:
            saved.append((owner, name, owner.__dict__.get(name, _MISSING), value))
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, previous, value in reversed(saved):
            if owner.__dict__.get(name, _MISSING) is not value:
                continue
            if previous is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, previous)


def mori_stand_ins(
    connector: ModuleType, engine: ModuleType, engine_class: type[EngineStandIn] = EngineStandIn
) -> list[tuple[Any, str, Any]]:
    """(module, name, value): MORI's names in vLLM's MoRIIO modules, and the attention-backend
    lookup, as the stand-ins have them (the caller sets them and puts them back)."""
    backend_type = SimpleNamespace(RDMA="rdma", XGMI="xgmi")
    backend = SimpleNamespace(get_name=lambda: "PROBE")
    changes: list[tuple[Any, str, Any]] = [
        (connector, "MoRIIO_enabled", True),
        (connector, "IOEngine", engine_class),
        (connector, "IOEngineConfig", _engine_config),
        (connector, "BackendType", backend_type),
        (connector, "get_attn_backend", lambda *a, **k: backend),
    ]
    if hasattr(connector, "get_current_attn_backends"):  # 0.34: the backends of the config's layers
        changes.append((connector, "get_current_attn_backends", lambda *a, **k: [backend]))
    return [
        *changes,
        (engine, "BackendType", backend_type),
        (engine, "RdmaBackendConfig", _backend_config),
        (engine, "XgmiBackendConfig", _backend_config),
        (engine, "PollCqMode", SimpleNamespace(POLLING="polling", EVENT="event")),
    ]


def _group_stand_ins() -> list[tuple[Any, str, Any]]:
    """Rank-0-of-1 world and TP groups, for the ones this process has none of yet."""
    from vllm.distributed import parallel_state

    changes: list[tuple[Any, str, Any]] = []
    if getattr(parallel_state, "_WORLD", None) is None:
        changes.append((parallel_state, "_WORLD", SimpleNamespace(rank=0, local_rank=0, world_size=1)))
    if getattr(parallel_state, "_TP", None) is None:
        changes.append(
            (parallel_state, "_TP", SimpleNamespace(rank=0, local_rank=0, rank_in_group=0, world_size=1))
        )
    return changes


@contextmanager
def process_groups() -> Iterator[None]:
    """This process's world and TP groups, or rank-0-of-1 stand-ins for the block (then none
    again, unless a real group was installed meanwhile: that one stays)."""
    with _attributes(_group_stand_ins()):
        yield


def _stand_ins(
    connector: ModuleType, engine: ModuleType, engine_class: type[EngineStandIn]
) -> list[tuple[Any, str, Any]]:
    return [*mori_stand_ins(connector, engine, engine_class), *_group_stand_ins()]


def _init_args(connector: ModuleType, vllm_config: Any, name: str, kv_cache_config: Any) -> tuple[Any, ...]:
    """The installed ``__init__``'s arguments: ``(vllm_config, engine_id, kv_cache_config)`` from
    vLLM 0.24.0, ``(vllm_config, engine_id)`` before (no ``kv_cache_config`` parameter)."""
    params = inspect.signature(connector.MoRIIOConnectorWorker.__init__).parameters
    return (vllm_config, name, kv_cache_config) if "kv_cache_config" in params else (vllm_config, name)


# --------------------------------------------------------------------------- ports and threads


def kernel_port() -> int:
    """A port the kernel picks: bound at port 0 on the wildcard address and released again, as
    vLLM's ``get_open_port`` does where ``VLLM_PORT`` is unset. What vLLM's code called by a
    probe gets for ``get_open_port`` (:func:`installed`): never ``VLLM_PORT``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


_threads: threading.local = threading.local()


class GuestThread(threading.Thread):
    """``threading.Thread`` for a thread vLLM's code starts for a probe's object.

    ``start`` returns once the thread is quiet (``guest.quiet_thread``: its records are
    dropped like the probing thread's), and its target runs only then, so even its first
    line ("Node starting to listen ...") stays out of vLLM's log. An exception that ends it
    is kept in :attr:`error` (the probe reads the thread's end, not a traceback) instead of
    going to ``threading.excepthook``, which no probe replaces. Started inside
    :func:`guest_threads`, it is waited for when that block ends.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.error: BaseException | None = None
        self._guest_quiet = threading.Event()
        self._started_for: list[GuestThread] | None = getattr(_threads, "started", None)

    def start(self) -> None:
        if self._started_for is not None:
            self._started_for.append(self)
        super().start()
        try:
            quiet_thread(self)
        finally:
            self._guest_quiet.set()

    def run(self) -> None:
        _threads.started = self._started_for  # the threads it starts belong to the same block
        self._guest_quiet.wait()
        try:
            super().run()
        except BaseException as exc:  # the thread ends of it, as vLLM's would
            self.error = exc


GUEST_THREADING = ModuleType("threading", "threading, with GuestThread for Thread")
GUEST_THREADING.__dict__.update({k: v for k, v in vars(threading).items() if not k.startswith("__")})
GUEST_THREADING.Thread = GuestThread  # type: ignore[attr-defined]


@contextmanager
def guest_threads(timeout: float = 5.0) -> Iterator[list[GuestThread]]:
    """Every :class:`GuestThread` started in the block (by the calling thread or by one of
    them); each is waited for (`timeout` s) when the block ends, and one that is still running
    then is a ``RuntimeError`` (unless the block already raised)."""
    previous = getattr(_threads, "started", None)
    started: list[GuestThread] = []
    _threads.started = started
    try:
        yield started
    finally:
        _threads.started = previous
        deadline = time.monotonic() + timeout
        for thread in list(started):
            if thread.ident is not None:
                thread.join(max(0.0, deadline - time.monotonic()))
    running = [t.name for t in started if t.is_alive()]
    if running:
        raise RuntimeError(f"threads started for the probe still running after {timeout:.0f} s: {running}")


def _private_function(func: types.FunctionType, names: Mapping[str, Any]) -> types.FunctionType:
    scope = dict(func.__globals__)
    scope.update(names)
    copy = types.FunctionType(func.__code__, scope, func.__name__, func.__defaults__, func.__closure__)
    copy.__kwdefaults__ = func.__kwdefaults__
    copy.__qualname__ = func.__qualname__
    copy.__dict__.update(func.__dict__)
    return copy


def _private(obj: Any, names: Mapping[str, Any]) -> Any:
    if isinstance(obj, classmethod):
        return classmethod(_private(obj.__func__, names))
    if isinstance(obj, staticmethod):
        return staticmethod(_private(obj.__func__, names))
    if isinstance(obj, types.FunctionType):
        return _private_function(obj, names)
    return obj  # not a Python function: called as it is


def installed(owner: type, attr: str, names: Mapping[str, Any]) -> Any:
    """``owner.attr`` as installed, for one call of a probe's: every wrapt layer on it (the
    fixes' wrappers, a hostile check's, anyone's) kept in order, the object at the bottom
    (vLLM's function, or a fix's replacement) run with a private copy of its module's globals
    in which `names` are replaced (``get_open_port``, ``threading``, ...), copied at this call.
    Unbound: bind it with ``__get__`` as attribute access on `owner` would."""
    import wrapt

    obj = next((vars(klass)[attr] for klass in owner.__mro__ if attr in vars(klass)), None)
    if obj is None:
        raise AttributeError(f"{owner.__qualname__} has no {attr}")
    layers: list[Callable[..., Any]] = []
    while isinstance(obj, wrapt.FunctionWrapper):
        layers.append(obj._self_wrapper)
        obj = obj.__wrapped__
    built = _private(obj, names)
    for wrapper in reversed(layers):
        built = wrapt.FunctionWrapper(built, wrapper)
    return built


# What vLLM's code run by a probe gets instead: ports the kernel picks, threads that are guests.
PROBE_NAMES: Mapping[str, Any] = {"get_open_port": kernel_port, "threading": GUEST_THREADING}


def bound(owner: type, attr: str, instance: Any = None, names: Mapping[str, Any] = PROBE_NAMES) -> Any:
    """:func:`installed` bound to `instance` (a class- or staticmethod: to `owner`)."""
    return installed(owner, attr, names).__get__(instance, owner)


def from_vllm_config(common: ModuleType, config: Any) -> Any:
    """The installed ``MoRIIOConfig.from_vllm_config(config)``, its ports from the kernel."""
    return bound(common.MoRIIOConfig, "from_vllm_config")(config)


class _ConfigClass:
    """``MoRIIOConfig`` as the probe's worker ``__init__`` sees it: ``from_vllm_config`` is
    :func:`from_vllm_config`; every other attribute is the class's own."""

    def __init__(self, common: ModuleType) -> None:
        self._common = common

    def from_vllm_config(self, config: Any) -> Any:
        return from_vllm_config(self._common, config)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._common.MoRIIOConfig, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._common.MoRIIOConfig(*args, **kwargs)


def new_worker(
    connector: ModuleType, common: ModuleType, vllm_config: Any, name: str, kv_cache_config: Any
) -> Any:
    """A worker built by the installed ``MoRIIOConnectorWorker.__init__`` (:func:`installed`:
    its config's ports from the kernel, its threads guests)."""
    cls = connector.MoRIIOConnectorWorker
    worker = cls.__new__(cls)
    names = {**PROBE_NAMES, "MoRIIOConfig": _ConfigClass(common)}
    bound(cls, "__init__", worker, names)(*_init_args(connector, vllm_config, name, kv_cache_config))
    return worker


@contextmanager
def probe_worker(
    connector: ModuleType,
    engine: ModuleType,
    vllm_config: Any,
    kv_cache_config: Any,
    name: str,
    *,
    engine_class: type[EngineStandIn] = EngineStandIn,
) -> Iterator[Any]:
    """vLLM's worker, built by the installed ``__init__`` (:func:`new_worker`); shut down with
    vLLM's own ``shutdown``.

    The stand-ins stay in place for the whole block (the caller may drive the worker's start-up
    in it); every engine stand-in's listener is closed when the block ends.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_common

    with _LOCK:
        role = moriio_common.get_role()
        worker: Any = None
        try:
            with _attributes(_stand_ins(connector, engine, engine_class)):
                worker = new_worker(connector, moriio_common, vllm_config, name, kv_cache_config)
                yield worker
        finally:
            try:
                if worker is not None:
                    worker.shutdown()
            finally:
                moriio_common.set_role(role)
                while EngineStandIn.engines:
                    EngineStandIn.engines.pop().close()


# --------------------------------------------------------------------------- what probes build


def extra_config(handshake: int, notify: int, **more: str) -> dict[str, str]:
    """A MoRIIO ``kv_connector_extra_config`` on loopback with these port bases (and `more`).

    ``host_ip`` is set so that ``resolve_host_ip`` opens no ``get_ip()`` socket;
    ``proxy_ping_port`` is read unconditionally by releases before 0.28.
    """
    return {
        "host_ip": HOST,
        "http_port": "8000",
        "handshake_port": str(handshake),
        "notify_port": str(notify),
        "proxy_ip": "",
        "proxy_ping_port": "0",
        **more,
    }


def _default_class(field: dataclasses.Field[Any]) -> Any:
    """The config class a field's default is built from (``Field(default_factory=X)`` or
    ``field(default_factory=X)``), or None."""
    factory = field.default_factory if field.default_factory is not dataclasses.MISSING else None
    if factory is None and field.default is not dataclasses.MISSING:
        factory = getattr(field.default, "default_factory", None)
    return factory if isinstance(factory, type) and dataclasses.is_dataclass(factory) else None


def build_config(cls: type, /, **values: Any) -> Any:
    """``guest.build(cls, **values)``, a field left at a default that is itself a vLLM config
    (``VllmConfig.device_config``, ``compilation_config``, ...) built the same way: its
    ``__post_init__`` would run a platform check too (0.14's ``DeviceConfig`` raises on a
    machine it cannot infer a device for)."""
    for field in dataclasses.fields(cls):
        if field.name not in values and (inner := _default_class(field)) is not None:
            values[field.name] = build_config(inner)
    return build(cls, **values)


def parallel_config(dp_rank: int, dp_local: int, tp_size: int | None = None) -> Any:
    """vLLM's ``ParallelConfig`` for DP rank `dp_rank` of `dp_local` local DP ranks (one host),
    with ``tensor_parallel_size`` `tp_size` where given (vLLM's default, 1, otherwise)."""
    from vllm.config import ParallelConfig

    sizes = {} if tp_size is None else {"tensor_parallel_size": tp_size}
    return build_config(
        ParallelConfig,
        data_parallel_rank=dp_rank,
        data_parallel_size_local=dp_local,
        data_parallel_size=dp_local,
        **sizes,
    )


def vllm_config(extra: Mapping[str, str], *, parallel: Any = None, producer: bool = True) -> Any:
    """vLLM's ``VllmConfig`` as ``MoRIIOConfig.from_vllm_config`` reads it: vLLM's own
    ``KVTransferConfig`` for the MoRIIO connector (producer or consumer) with a copy of `extra`,
    and `parallel` (vLLM's default ``ParallelConfig`` unless given)."""
    from vllm.config import KVTransferConfig, ParallelConfig, VllmConfig

    kv_transfer = build_config(
        KVTransferConfig,
        kv_connector="MoRIIOConnector",
        kv_role="kv_producer" if producer else "kv_consumer",
        kv_connector_extra_config=dict(extra),
        engine_id="vllm-fixes-probe",  # what __post_init__ would draw at random
    )
    return build_config(
        VllmConfig,
        kv_transfer_config=kv_transfer,
        parallel_config=build_config(ParallelConfig) if parallel is None else parallel,
    )


def _hf_config(model_type: str, head_size: int, num_kv_heads: int) -> Any:
    """A transformers config of `model_type` (no model on the hub: the fields are given)."""
    import transformers

    cls = getattr(transformers, "PreTrainedConfig", None) or transformers.PretrainedConfig
    hf = cls()
    hf.model_type = model_type
    hf.head_dim = head_size
    hf.num_key_value_heads = num_kv_heads
    hf.num_attention_heads = num_kv_heads
    hf.hidden_size = head_size * num_kv_heads
    return hf


def model_config(dtype: str, head_size: int, num_kv_heads: int, model_type: str) -> Any:
    """vLLM's ``ModelConfig`` for a model with no checkpoint: its transformers configs and its
    ``ModelArchitectureConfig`` (what vLLM's ``get_head_size`` / ``get_total_num_kv_heads`` /
    ``is_deepseek_mla`` read) are given, as ``__post_init__`` would derive them; it is a model
    vLLM implements itself (``using_transformers_backend``, which 0.28+ ``use_mla`` asks and
    which would look the architecture up in vLLM's registry, answers False)."""
    import torch
    from vllm.config import ModelConfig
    from vllm.config.model_arch import ModelArchitectureConfig

    hf = _hf_config(model_type, head_size, num_kv_heads)
    arch = build_config(
        ModelArchitectureConfig,
        architectures=[],
        model_type=model_type,
        text_model_type=model_type,
        hidden_size=head_size * num_kv_heads,
        total_num_hidden_layers=1,
        total_num_attention_heads=num_kv_heads,
        head_size=head_size,
        total_num_kv_heads=num_kv_heads,
        is_deepseek_mla=False,
    )
    model = build_config(
        ModelConfig,
        dtype=getattr(torch, dtype),
        hf_config=hf,
        hf_text_config=hf,
        model_arch_config=arch,
    )
    object.__setattr__(model, "using_transformers_backend", lambda: False)
    return model


def with_worker_configs(
    config: Any,
    *,
    dtype: str = "float16",
    head_size: int = HEAD_SIZE,
    num_kv_heads: int = 1,
    model_type: str = "probe",
) -> Any:
    """`config` (a :func:`vllm_config`) with what ``MoRIIOConnectorWorker.__init__`` and
    ``register_kv_caches`` read beyond ``from_vllm_config``: vLLM's cache, model and scheduler
    configs (no MLA, no hybrid KV cache manager)."""
    from vllm.config import CacheConfig, SchedulerConfig

    object.__setattr__(
        config, "cache_config", build_config(CacheConfig, block_size=BLOCK_SIZE, cache_dtype="auto")
    )
    object.__setattr__(config, "model_config", model_config(dtype, head_size, num_kv_heads, model_type))
    object.__setattr__(
        config, "scheduler_config", build_config(SchedulerConfig, disable_hybrid_kv_cache_manager=True)
    )
    return config


def kv_cache_config(num_blocks: int) -> Any:
    """vLLM's KVCacheConfig: one full-attention layer (:data:`LAYER`) of `num_blocks` blocks."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=HEAD_SIZE, dtype=torch.float16)
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],  # the connector reads the groups only
        kv_cache_groups=[KVCacheGroupSpec(layer_names=[LAYER], kv_cache_spec=spec)],
    )


def kv_caches(num_blocks: int) -> dict[str, Any]:
    """A CPU KV cache shaped like :func:`kv_cache_config`, page-aligned as a device allocation is."""
    import torch

    shape = (2, num_blocks, BLOCK_SIZE, 1, HEAD_SIZE)
    nbytes = 2 * num_blocks * BLOCK_SIZE * HEAD_SIZE * 2
    buf = mmap.mmap(-1, max(nbytes, mmap.PAGESIZE))
    return {LAYER: torch.frombuffer(buf, dtype=torch.float16, count=nbytes // 2).view(shape)}


# The scheduler's per-request bookkeeping, which its __init__ starts empty.
_REQUEST_MAPS = (
    "transfer_id_to_request_id",
    "request_id_to_transfer_id",
    "_reqs_need_recv",
    "_req_kv_params",
    "_reqs_need_save",
    "_reqs_need_send",
    "_reqs_need_pending_save",
)


def scheduler_without_requests(
    connector: ModuleType, config: Any = None, *, kv_cache: Any = None, engine_id: str = "probe-scheduler"
) -> Any:
    """vLLM's own ``MoRIIOConnectorScheduler`` (from the installed connector module), holding no
    requests.

    With `config` (a VllmConfig: :func:`build_config`), it is built by the installed ``__init__``,
    so every attribute a release sets there is the one that release computes (a sender that
    reads one more finds it). `kv_cache` is the KVCacheConfig the ``__init__`` of 0.30+ takes
    (:func:`kv_cache_config` of one block unless given); older ones take none. The ``__init__``
    runs as :func:`bound` runs vLLM's code (a private copy of its module's globals, nothing
    module-wide changed), in which ``set_role`` does nothing (the probe's scheduler is not this
    process's: MoRIIO's process-wide role stays as it is) and ``get_ip`` (0.14-0.23) answers
    :data:`HOST` (no socket); 0.24+ read ``host_ip`` from the extra config.

    Without `config`, it is built without ``__init__`` and only its per-request maps are set
    (empty); every other attribute a caller's path reads is the caller's to set.
    """
    cls = connector.MoRIIOConnectorScheduler
    sched = cls.__new__(cls)
    if config is None:
        for name in _REQUEST_MAPS:
            setattr(sched, name, {})
        return sched
    args: tuple[Any, ...] = (config, engine_id)
    if "kv_cache_config" in inspect.signature(cls.__init__).parameters:
        args = (*args, kv_cache if kv_cache is not None else kv_cache_config(1))

    def keep_role(role: Any) -> None:
        """``set_role`` as this ``__init__`` sees it: the process's role is kept."""

    names = {**PROBE_NAMES, "set_role": keep_role, "get_ip": lambda: HOST}
    bound(cls, "__init__", sched, names)(*args)
    return sched


class NotifyTransportStandIn:
    """What ``MoRIIOWriter`` asks of ``MoRIIOWrapper`` on its notify path; records each notify
    as (transfer id, remote ip, remote port, message type)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done_req_ids: list[Any] = []
        self.done_remote_allocate_req_dict: dict[str, Any] = {}
        self.sent: list[tuple[Any, Any, int, Any]] = []

    @property
    def ports(self) -> list[int]:
        """The remote port of each notify sent, in order."""
        return [port for _, _, port, _ in self.sent]

    def send_notify(
        self, transfer_id: Any, remote_ip: Any, remote_port: Any, message_type: Any = None, *a: Any, **k: Any
    ) -> None:
        self.sent.append((transfer_id, remote_ip, int(remote_port), message_type))

    def waiting_for_transfer_complete(self, *a: Any, **k: Any) -> None:  # statuses: 0.24+ only
        return None

    def _mark_transfer_terminal_locked(self, transfer_id: Any) -> None:
        return None

    def _is_transfer_terminal_locked(self, transfer_id: Any) -> bool:
        return False

    def fail_unallocated_write(self, transfer_id: Any) -> bool:  # 0.33+: a deferred write timed out
        return transfer_id not in self.done_remote_allocate_req_dict


class WriterWorkerStandIn:
    """The worker fields ``MoRIIOWriter`` reads on its notify path (weak-referenceable).

    An argument left as None leaves its attribute out: no ``world_size`` is the fake worker of
    vLLM's own writer tests; ``remote_dp_size_local`` is read with a default (0.30);
    ``num_layers`` is read by 0.14-0.23, whose finalize waits for every layer's write.
    """

    def __init__(
        self,
        tp_rank: int,
        world_size: int | None = None,
        *,
        remote_dp_size_local: int | None = None,
        num_layers: int | None = None,
    ) -> None:
        self.tp_rank = tp_rank
        if world_size is not None:
            self.world_size = world_size
        if remote_dp_size_local is not None:
            self.remote_dp_size_local = remote_dp_size_local
        if num_layers is not None:
            self.num_layers = num_layers
        self.moriio_wrapper = NotifyTransportStandIn()
        self.moriio_config = SimpleNamespace(defer_timeout=60.0)
