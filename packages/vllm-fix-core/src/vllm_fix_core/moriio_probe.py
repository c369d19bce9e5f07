"""A MoRIIO worker built by vLLM's own (installed) ``MoRIIOConnectorWorker.__init__``, for probes.

Shared by the MoRIIO fixes whose probes must drive the worker's own start-up path (its
``__init__``, its ``register_kv_caches``) as installed: vLLM's body with whatever is layered on
it. What is stood in for is only what a probing process lacks, for the duration of one block,
put back exactly afterwards (an attribute that was absent is removed again):

* MORI's names, which vLLM's MoRIIO modules import from ``mori.io`` (absent on a CPU
  machine; on a real host the probe must not open the native engine either):
  :class:`EngineStandIn` registers no memory and opens no RDMA queue; for the RDMA backend
  it binds its control-plane listener as MORI's ``TCPContext::Listen`` does
  (``SO_REUSEADDR``, ``bind`` on the configured host and port, ``listen``; a failed bind
  raises the ``OSError`` where MORI would ``exit(-1)``) and reports the port it is bound to
  (MORI from v0.1.0; for a non-zero port every MORI does);
* the attention-backend lookup at the end of ``__init__`` (platform-specific);
* the world and tensor-parallel groups, only where this process has none yet (a real group
  is used as it is).

The moriio role that ``__init__`` sets is put back too. No fix's patch calls anything here.
"""

from __future__ import annotations

import inspect
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType, SimpleNamespace
from typing import Any, ClassVar

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

    A subclass with ``any_port_when_taken = True`` listens on a free port instead when the
    configured one is taken (for a probe that does not look at the KV listener's port).
    """

    any_port_when_taken: ClassVar[bool] = False

    def __init__(self, key: str, config: Any) -> None:
        self.key = key
        self.config = config
        self.listener: socket.socket | None = None
        EngineStandIn.engines.append(self)

    engines: ClassVar[list[EngineStandIn]] = []

    def create_backend(self, backend_type: Any, backend_config: Any = None) -> None:
        if str(getattr(backend_type, "value", backend_type)).lower() != "rdma":
            return
        host, port = str(self.config.host), int(self.config.port)
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError:
                if not self.any_port_when_taken:
                    raise
                sock.bind((host, 0))
            sock.listen(1)
        except BaseException:
            sock.close()
            raise
        self.listener = sock

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
    saved = [(owner, name, owner.__dict__.get(name, _MISSING)) for owner, name, _ in changes]
    try:
        for owner, name, value in changes:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, previous in reversed(saved):
            if previous is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, previous)


def _stand_ins(
    connector: ModuleType, engine: ModuleType, engine_class: type[EngineStandIn]
) -> list[tuple[Any, str, Any]]:
    from vllm.distributed import parallel_state

    backend_type = SimpleNamespace(RDMA="rdma", XGMI="xgmi")
    changes: list[tuple[Any, str, Any]] = [
        (connector, "MoRIIO_enabled", True),
        (connector, "IOEngine", engine_class),
        (connector, "IOEngineConfig", _engine_config),
        (connector, "BackendType", backend_type),
        (connector, "get_attn_backend", lambda *a, **k: SimpleNamespace(get_name=lambda: "PROBE")),
        (engine, "BackendType", backend_type),
        (engine, "RdmaBackendConfig", _backend_config),
        (engine, "XgmiBackendConfig", _backend_config),
        (engine, "PollCqMode", SimpleNamespace(POLLING="polling", EVENT="event")),
    ]
    if getattr(parallel_state, "_WORLD", None) is None:
        changes.append((parallel_state, "_WORLD", SimpleNamespace(rank=0, local_rank=0, world_size=1)))
    if getattr(parallel_state, "_TP", None) is None:
        changes.append(
            (parallel_state, "_TP", SimpleNamespace(rank=0, local_rank=0, rank_in_group=0, world_size=1))
        )
    return changes


def _init_args(connector: ModuleType, vllm_config: Any, name: str, kv_cache_config: Any) -> tuple[Any, ...]:
    """The installed ``__init__``'s arguments: ``(vllm_config, engine_id, kv_cache_config)`` from
    vLLM 0.24.0, ``(vllm_config, engine_id)`` before (no ``kv_cache_config`` parameter)."""
    params = inspect.signature(connector.MoRIIOConnectorWorker.__init__).parameters
    return (vllm_config, name, kv_cache_config) if "kv_cache_config" in params else (vllm_config, name)


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
    """vLLM's worker, built by the installed ``__init__``; shut down with vLLM's own ``shutdown``.

    The stand-ins stay in place for the whole block (the caller may drive the worker's start-up
    in it); every engine stand-in's listener is closed when the block ends.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_common

    with _LOCK:
        role = moriio_common.get_role()
        worker: Any = None
        try:
            with _attributes(_stand_ins(connector, engine, engine_class)):
                args = _init_args(connector, vllm_config, name, kv_cache_config)
                worker = connector.MoRIIOConnectorWorker(*args)
                yield worker
        finally:
            try:
                if worker is not None:
                    worker.shutdown()
            finally:
                moriio_common.set_role(role)
                while EngineStandIn.engines:
                    EngineStandIn.engines.pop().close()
