"""What a real ``MoRIIOConnectorWorker.__init__`` / ``register_kv_caches`` needs on a CPU box.

The worker is vLLM's own class, built by its own ``__init__`` and started by its own
``register_kv_caches`` (real handshake and notify listeners on loopback). Stood in for,
and only these:

* the native MORI engine (``IOEngine`` / ``IOEngineConfig`` / ``BackendType`` /
  ``EngineDesc`` / ``RdmaBackendConfig`` / ``PollCqMode``): :class:`MoriEngineStandIn`
  hands out an engine key shaped like MORI's (``<role>:<ip>:<handshake base>:tp<t>:dp<d>``
  as vLLM builds it);
* the tensor-parallel group getters (one process plays every rank);
* the attention-backend lookup (platform-specific, no GPU).

Use :func:`install_worker_stand_ins` with a pytest ``MonkeyPatch`` (undone at test end).
"""

from __future__ import annotations

import importlib
import mmap
import socket
import threading
import time
from types import ModuleType, SimpleNamespace
from typing import Any

PACKAGE = "vllm.distributed.kv_transfer.kv_connector.v1.moriio"
LAYER = "model.layers.0.self_attn.attn"
NUM_BLOCKS = 4


def moriio_modules() -> SimpleNamespace:
    """vLLM's MoRIIO modules: common, connector, engine."""
    return SimpleNamespace(
        common=importlib.import_module(f"{PACKAGE}.moriio_common"),
        connector=importlib.import_module(f"{PACKAGE}.moriio_connector"),
        engine=importlib.import_module(f"{PACKAGE}.moriio_engine"),
    )


class MoriEngineStandIn:
    """Stands in for ``mori.io.IOEngine``: no native listener, a descriptor key like MORI's."""

    def __init__(self, key: str, config: Any) -> None:
        self.key = key
        self.config = config

    def create_backend(self, *args: Any) -> None:
        return None

    def register_remote_engine(self, desc: Any) -> None:
        return None

    def register_torch_tensor(self, tensor: Any) -> Any:
        return SimpleNamespace(pack=lambda: b"memory-desc")

    def get_engine_desc(self) -> Any:
        return SimpleNamespace(key=self.key, port=12345, pack=lambda: self.key.encode())


class _EngineDesc:
    @staticmethod
    def unpack(data: bytes) -> Any:
        return SimpleNamespace(key=data.decode())


def _config_stand_in(host: str, port: int) -> Any:
    return SimpleNamespace(host=host, port=port)


def _rdma_config_stand_in(*args: Any, **kwargs: Any) -> Any:
    return SimpleNamespace(args=args, kwargs=kwargs)


def install_worker_stand_ins(monkeypatch: Any, mods: SimpleNamespace | None = None) -> SimpleNamespace:
    """MORI, the attention-backend lookup; returns ``mods`` with ``set_ranks(tp_rank, tp_size)``."""
    mods = mods or moriio_modules()
    connector, engine = mods.connector, mods.engine
    monkeypatch.setattr(connector, "MoRIIO_enabled", True, raising=False)
    monkeypatch.setattr(connector, "IOEngine", MoriEngineStandIn, raising=False)
    monkeypatch.setattr(connector, "IOEngineConfig", _config_stand_in, raising=False)
    backend_type = SimpleNamespace(RDMA="rdma", XGMI="xgmi")
    monkeypatch.setattr(connector, "BackendType", backend_type, raising=False)
    for name, value in (
        ("BackendType", backend_type),
        ("PollCqMode", SimpleNamespace(POLLING="polling")),
        ("RdmaBackendConfig", _rdma_config_stand_in),
        ("EngineDesc", _EngineDesc),
    ):
        monkeypatch.setattr(engine, name, value, raising=False)
    backend = SimpleNamespace(get_name=lambda: "FAKE_ATTN")
    monkeypatch.setattr(connector, "get_attn_backend", lambda *a, **k: backend)

    def set_ranks(tp_rank: int, tp_size: int) -> None:
        """This process's (tp_rank, tp_size) as vLLM's TP group would report it."""
        group = SimpleNamespace(rank=tp_rank, local_rank=tp_rank, rank_in_group=tp_rank, world_size=tp_size)
        for module in (mods.common, mods.connector):
            if hasattr(module, "get_tensor_model_parallel_rank"):
                monkeypatch.setattr(module, "get_tensor_model_parallel_rank", lambda: tp_rank)
            if hasattr(module, "get_tensor_model_parallel_world_size"):
                monkeypatch.setattr(module, "get_tensor_model_parallel_world_size", lambda: tp_size)
        monkeypatch.setattr(mods.connector, "get_world_group", lambda: group)
        monkeypatch.setattr(mods.connector, "get_tp_group", lambda: group)

    mods.set_ranks = set_ranks
    return mods


def worker_vllm_config(
    dp_rank: int,
    dp_local: int,
    tp_size: int,
    *,
    handshake: int,
    notify: int,
    producer: bool = True,
) -> Any:
    """The fields MoRIIOConfig.from_vllm_config and the worker read (as vLLM's tests build one)."""
    extra = {
        "handshake_port": str(handshake),
        "notify_port": str(notify),
        "http_port": "8000",
        "host_ip": "127.0.0.1",
        "proxy_ip": "",
    }
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config=extra,
            is_kv_producer=producer,
            kv_role="kv_producer" if producer else "kv_consumer",
        ),
        parallel_config=SimpleNamespace(
            data_parallel_rank=dp_rank,
            data_parallel_size_local=dp_local,
            data_parallel_size=dp_local,
            tensor_parallel_size=tp_size,
        ),
        cache_config=SimpleNamespace(block_size=16, cache_dtype="auto"),
        model_config=SimpleNamespace(
            use_mla=False,
            dtype="float16",
            get_head_size=lambda: 64,
            get_total_num_kv_heads=lambda: 8,
            hf_config=SimpleNamespace(model_type="llama"),
        ),
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=True),
    )


def kv_cache_config() -> Any:
    """A real one-layer KVCacheConfig (full attention, 4 blocks of 16 tokens)."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float16)
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],  # the connector reads the groups only
        kv_cache_groups=[KVCacheGroupSpec(layer_names=[LAYER], kv_cache_spec=spec)],
    )


def page_aligned_kv_caches() -> dict[str, Any]:
    """CPU KV caches shaped like the one-layer config, page-aligned like a GPU allocation."""
    import torch

    shape = (2, NUM_BLOCKS, 16, 1, 64)
    nbytes = 2 * NUM_BLOCKS * 16 * 64 * 2
    buf = mmap.mmap(-1, max(nbytes, mmap.PAGESIZE))
    tensor = torch.frombuffer(buf, dtype=torch.float16, count=nbytes // 2).view(shape)
    return {LAYER: tensor}


def shut_down(worker: Any, timeout: float = 10.0) -> None:
    """vLLM's own MoRIIOConnectorWorker.shutdown(), once the worker's listener thread has
    started: vLLM assigns the thread before starting it from the initializing thread, and
    Thread.join() raises on a thread that is not started yet (a test that leaves a rank's
    start-up running, as the negative controls do, would otherwise fail in teardown)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            worker.shutdown()
            return
        except RuntimeError as exc:
            if "before it is started" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


class Startup:
    """register_kv_caches run by an initializing thread, as the worker runs it."""

    def __init__(self, worker: Any, kv: dict[str, Any] | None = None) -> None:
        self.worker = worker
        self.error: BaseException | None = None
        self.finished_at: float | None = None
        self.started_at = time.monotonic()
        caches = kv if kv is not None else page_aligned_kv_caches()

        def run() -> None:
            try:
                worker.register_kv_caches(caches)
            except BaseException as exc:
                self.error = exc
            self.finished_at = time.monotonic()

        self.thread = threading.Thread(target=run, daemon=True, name="test-initializing-thread")
        self.thread.start()

    def wait(self, timeout: float) -> bool:
        """True if register_kv_caches returned or raised within `timeout` s."""
        self.thread.join(timeout)
        return not self.thread.is_alive()

    @property
    def seconds(self) -> float:
        assert self.finished_at is not None
        return self.finished_at - self.started_at


def bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


_used_bases: set[int] = set()
_bases_lock = threading.Lock()


def free_port_blocks(n: int, low: int = 20000, high: int = 31000) -> tuple[int, int]:
    """(handshake base, notify base), each with `n` free ports, below the ephemeral range.

    vLLM's listener threads cannot be stopped, so every caller gets fresh blocks.
    """
    import random

    rng = random.Random()
    with _bases_lock:
        for _ in range(500):
            base = rng.randrange(low, high - 2 * n - 16, 4)
            if any(abs(base - used) < 2 * n + 64 for used in _used_bases):
                continue
            notify = base + n + 16
            if all(bindable(p) for p in (*range(base, base + n), *range(notify, notify + n))):
                _used_bases.add(base)
                return base, notify
    raise RuntimeError("no free port block")


def module_of(obj: Any) -> ModuleType:
    return importlib.import_module(obj.__module__)


class NotifyTransportStandIn:
    """What ``MoRIIOWriter`` asks of ``MoRIIOWrapper`` on its notify path; records each notify."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done_req_ids: list[Any] = []
        self.done_remote_allocate_req_dict: dict[str, Any] = {}
        self.sent: list[tuple[Any, str, int, Any]] = []

    def send_notify(
        self, transfer_id: Any, remote_ip: str, remote_port: int, message_type: Any = None, **fields: Any
    ) -> None:
        self.sent.append((transfer_id, remote_ip, int(remote_port), message_type))

    def waiting_for_transfer_complete(self, statuses: Any, *args: Any, **kwargs: Any) -> None:
        return None

    def _mark_transfer_terminal_locked(self, transfer_id: Any) -> None:
        return None

    def _is_transfer_terminal_locked(self, transfer_id: Any) -> bool:
        return False

    def fail_unallocated_write(self, transfer_id: Any) -> bool:
        return transfer_id not in self.done_remote_allocate_req_dict


class WriterWorkerStandIn:
    """The worker fields ``MoRIIOWriter`` reads on its notify path (weak-referenceable).

    ``world_size=None`` leaves the attribute out, like the fake worker of vLLM's own
    writer tests.
    """

    def __init__(self, tp_rank: int, world_size: int | None = None) -> None:
        self.tp_rank = tp_rank
        if world_size is not None:
            self.world_size = world_size
        self.moriio_wrapper = NotifyTransportStandIn()
        self.moriio_config = SimpleNamespace(defer_timeout=60.0)
