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

What the probes build their vLLM objects from is here too, one copy for every MoRIIO probe
(and for the test support package, which extends it): :func:`extra_config` /
:func:`vllm_config` / :func:`with_worker_configs` (vLLM's own ``KVTransferConfig`` and, by
default, ``ParallelConfig``), :func:`kv_cache_config` / :func:`kv_caches` (vLLM's
``KVCacheConfig``, a page-aligned CPU cache), :func:`scheduler_without_requests` (vLLM's
``MoRIIOConnectorScheduler`` holding no requests), and, for driving ``MoRIIOWriter``'s notify
path, :class:`NotifyTransportStandIn` and :class:`WriterWorkerStandIn`.
"""

from __future__ import annotations

import inspect
import mmap
import socket
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import ModuleType, SimpleNamespace
from typing import Any, ClassVar

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

    A subclass with ``any_port_when_taken = True`` listens on a free port instead when the
    configured one is taken (for a probe that does not look at the KV listener's port).
    Every engine whose listener is open is in :attr:`engines` (closed when a probe ends).
    """

    any_port_when_taken: ClassVar[bool] = False
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


def mori_stand_ins(
    connector: ModuleType, engine: ModuleType, engine_class: type[EngineStandIn] = EngineStandIn
) -> list[tuple[Any, str, Any]]:
    """(module, name, value): MORI's names in vLLM's MoRIIO modules, and the attention-backend
    lookup, as the stand-ins have them (the caller sets them and puts them back)."""
    backend_type = SimpleNamespace(RDMA="rdma", XGMI="xgmi")
    return [
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


def _stand_ins(
    connector: ModuleType, engine: ModuleType, engine_class: type[EngineStandIn]
) -> list[tuple[Any, str, Any]]:
    from vllm.distributed import parallel_state

    changes = mori_stand_ins(connector, engine, engine_class)
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


def parallel_config(dp_rank: int, dp_local: int, tp_size: int | None = None) -> SimpleNamespace:
    """The parallel-config fields MoRIIO reads for DP rank `dp_rank` of `dp_local` local DP ranks
    (one host), with ``tensor_parallel_size`` where `tp_size` is given."""
    config = SimpleNamespace(
        data_parallel_rank=dp_rank, data_parallel_size_local=dp_local, data_parallel_size=dp_local
    )
    if tp_size is not None:
        config.tensor_parallel_size = tp_size
    return config


def vllm_config(extra: Mapping[str, str], *, parallel: Any = None, producer: bool = True) -> SimpleNamespace:
    """What ``MoRIIOConfig.from_vllm_config`` reads of a VllmConfig: vLLM's own
    ``KVTransferConfig`` for the MoRIIO connector (producer or consumer) with a copy of `extra`,
    and `parallel` (vLLM's own ``ParallelConfig()`` unless given)."""
    from vllm.config import KVTransferConfig

    if parallel is None:
        from vllm.config import ParallelConfig

        parallel = ParallelConfig()
    return SimpleNamespace(
        kv_transfer_config=KVTransferConfig(
            kv_connector="MoRIIOConnector",
            kv_role="kv_producer" if producer else "kv_consumer",
            kv_connector_extra_config=dict(extra),
        ),
        parallel_config=parallel,
    )


def with_worker_configs(
    config: SimpleNamespace,
    *,
    dtype: str = "float16",
    head_size: int = HEAD_SIZE,
    num_kv_heads: int = 1,
    model_type: str = "probe",
) -> SimpleNamespace:
    """`config` with what ``MoRIIOConnectorWorker.__init__`` and ``register_kv_caches`` read
    beyond ``from_vllm_config`` (cache, model and scheduler configs; no MLA, no hybrid KV)."""
    config.cache_config = SimpleNamespace(block_size=BLOCK_SIZE, cache_dtype="auto")
    config.model_config = SimpleNamespace(
        use_mla=False,
        dtype=dtype,
        get_head_size=lambda: head_size,
        get_total_num_kv_heads=lambda: num_kv_heads,
        hf_config=SimpleNamespace(model_type=model_type),
    )
    config.scheduler_config = SimpleNamespace(disable_hybrid_kv_cache_manager=True)
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


def scheduler_without_requests(connector: ModuleType) -> Any:
    """vLLM's own ``MoRIIOConnectorScheduler`` (from the installed connector module), built
    without its ``__init__`` (which needs a whole engine's config) and holding no requests: its
    per-request maps are empty; every other attribute a caller's path reads is the caller's to set."""
    sched = connector.MoRIIOConnectorScheduler.__new__(connector.MoRIIOConnectorScheduler)
    for name in _REQUEST_MAPS:
        setattr(sched, name, {})
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
