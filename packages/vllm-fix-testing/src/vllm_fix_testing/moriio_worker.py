"""What a real ``MoRIIOConnectorWorker.__init__`` / ``register_kv_caches`` needs on a CPU box.

The worker is vLLM's own class, built by its own ``__init__`` and started by its own
``register_kv_caches`` (real handshake and notify listeners on loopback). Stood in for,
and only these:

* the native MORI engine (``IOEngine`` / ``IOEngineConfig`` / ``BackendType`` /
  ``EngineDesc`` / ``RdmaBackendConfig`` / ``PollCqMode``): the probes' stand-in
  (``vllm_fix_core.moriio_probe``), as :class:`MoriEngineStandIn` without its RDMA listener; it
  keeps the engine key vLLM builds (``<role>:<ip>:<handshake base>:tp<t>:dp<d>``);
* the tensor-parallel group getters (one process plays every rank);
* the attention-backend lookup (platform-specific, no GPU).

The configs, the KV cache and the writer's worker and transport are the probes' own
(``vllm_fix_core.moriio_probe``). Use :func:`install_worker_stand_ins` with a pytest
``MonkeyPatch`` (undone at test end).
"""

from __future__ import annotations

import importlib
import socket
import threading
import time
from types import ModuleType, SimpleNamespace
from typing import Any

from vllm_fix_core import moriio_probe
from vllm_fix_core.moriio_probe import LAYER, NotifyTransportStandIn, WriterWorkerStandIn

__all__ = [
    "LAYER",
    "NUM_BLOCKS",
    "MoriEngineStandIn",
    "NotifyTransportStandIn",
    "Startup",
    "WriterWorkerStandIn",
    "bindable",
    "free_port_blocks",
    "install_worker_stand_ins",
    "kv_cache_config",
    "module_of",
    "moriio_modules",
    "page_aligned_kv_caches",
    "shut_down",
    "worker_vllm_config",
]

PACKAGE = "vllm.distributed.kv_transfer.kv_connector.v1.moriio"
NUM_BLOCKS = 4


def moriio_modules() -> SimpleNamespace:
    """vLLM's MoRIIO modules: common, connector, engine."""
    return SimpleNamespace(
        common=importlib.import_module(f"{PACKAGE}.moriio_common"),
        connector=importlib.import_module(f"{PACKAGE}.moriio_connector"),
        engine=importlib.import_module(f"{PACKAGE}.moriio_engine"),
    )


class MoriEngineStandIn(moriio_probe.EngineStandIn):
    """The probes' ``mori.io.IOEngine`` stand-in, opening no RDMA listener: these tests start
    vLLM's handshake and notify listeners, not MORI's."""

    def create_backend(self, backend_type: Any, backend_config: Any = None) -> None:
        return None


class _EngineDesc:
    @staticmethod
    def unpack(data: bytes) -> Any:
        return SimpleNamespace(key=data.decode())


def install_worker_stand_ins(monkeypatch: Any, mods: SimpleNamespace | None = None) -> SimpleNamespace:
    """MORI, the attention-backend lookup; returns ``mods`` with ``set_ranks(tp_rank, tp_size)``."""
    mods = mods or moriio_modules()
    for owner, name, value in moriio_probe.mori_stand_ins(mods.connector, mods.engine, MoriEngineStandIn):
        monkeypatch.setattr(owner, name, value, raising=False)
    monkeypatch.setattr(mods.engine, "EngineDesc", _EngineDesc, raising=False)

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
    """What MoRIIOConfig.from_vllm_config and the worker read, for rank `dp_rank` of a
    `dp_local` x `tp_size` host (the probes' builder; an 8-head llama model)."""
    config = moriio_probe.vllm_config(
        moriio_probe.extra_config(handshake, notify),
        parallel=moriio_probe.parallel_config(dp_rank, dp_local, tp_size),
        producer=producer,
    )
    return moriio_probe.with_worker_configs(config, num_kv_heads=8, model_type="llama")


def kv_cache_config() -> Any:
    """A real one-layer KVCacheConfig (full attention, NUM_BLOCKS blocks of 16 tokens)."""
    return moriio_probe.kv_cache_config(NUM_BLOCKS)


def page_aligned_kv_caches() -> dict[str, Any]:
    """CPU KV caches shaped like the one-layer config, page-aligned like a GPU allocation."""
    return moriio_probe.kv_caches(NUM_BLOCKS)


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
