"""Shared fixtures: the real MoRIIO modules, and fakes only for what this machine lacks.

Fakes: the native MORI engine (IOEngine & co.), the torch.distributed groups a worker
reads its ranks from (a single process cannot hold 32 ranks), and the attention
backend lookup (platform-specific, no GPU). Everything else is vLLM's own code.
"""

from __future__ import annotations

import importlib
import socket
from collections.abc import Callable, Iterator
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

PACKAGE = "vllm.distributed.kv_transfer.kv_connector.v1.moriio"

HANDSHAKE_BASE = 16301
NOTIFY_BASE = 26005


@pytest.fixture(scope="session")
def mods() -> SimpleNamespace:
    return SimpleNamespace(
        common=importlib.import_module(f"{PACKAGE}.moriio_common"),
        connector=importlib.import_module(f"{PACKAGE}.moriio_connector"),
        engine=importlib.import_module(f"{PACKAGE}.moriio_engine"),
    )


def vllm_config(
    dp_rank: int,
    dp_local: int,
    tp_size: int,
    *,
    handshake: int = HANDSHAKE_BASE,
    notify: int = NOTIFY_BASE,
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
            kv_connector_extra_config=extra, is_kv_producer=producer, kv_role="kv_producer"
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
            hf_config=SimpleNamespace(model_type="llama"),
        ),
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=True),
    )


class FakeIOEngine:
    """Stands in for mori.io.IOEngine: no native listener, a descriptor key like MORI's."""

    def __init__(self, key: str, config: Any) -> None:
        self.key = key
        self.config = config

    def create_backend(self, *args: Any) -> None:
        pass

    def register_remote_engine(self, desc: Any) -> None:
        pass

    def register_torch_tensor(self, tensor: Any) -> Any:
        return SimpleNamespace(pack=lambda: b"memory-desc")

    def get_engine_desc(self) -> Any:
        return SimpleNamespace(key=self.key, port=12345, pack=lambda: self.key.encode())


class FakeMori:
    BackendType = SimpleNamespace(RDMA="rdma", XGMI="xgmi")
    PollCqMode = SimpleNamespace(POLLING="polling")

    @staticmethod
    def IOEngineConfig(host: str, port: int) -> Any:
        return SimpleNamespace(host=host, port=port)

    @staticmethod
    def RdmaBackendConfig(*args: Any, **kwargs: Any) -> Any:
        return SimpleNamespace(args=args, kwargs=kwargs)

    class EngineDesc:
        @staticmethod
        def unpack(data: bytes) -> Any:
            return SimpleNamespace(key=data.decode())


@pytest.fixture
def ranks(monkeypatch: pytest.MonkeyPatch, mods: SimpleNamespace) -> Callable[[int, int], None]:
    """Set this process's (tp_rank, tp_size) as vLLM's TP group would report it."""

    def set_ranks(tp_rank: int, tp_size: int) -> None:
        group = SimpleNamespace(rank=tp_rank, local_rank=tp_rank, rank_in_group=tp_rank, world_size=tp_size)
        for module in (mods.common, mods.connector):
            if hasattr(module, "get_tensor_model_parallel_rank"):
                monkeypatch.setattr(module, "get_tensor_model_parallel_rank", lambda: tp_rank)
            if hasattr(module, "get_tensor_model_parallel_world_size"):
                monkeypatch.setattr(module, "get_tensor_model_parallel_world_size", lambda: tp_size)
        monkeypatch.setattr(mods.connector, "get_world_group", lambda: group)
        monkeypatch.setattr(mods.connector, "get_tp_group", lambda: group)

    return set_ranks


@pytest.fixture
def fake_mori(monkeypatch: pytest.MonkeyPatch, mods: SimpleNamespace) -> None:
    monkeypatch.setattr(mods.connector, "MoRIIO_enabled", True)
    monkeypatch.setattr(mods.connector, "IOEngine", FakeIOEngine, raising=False)
    monkeypatch.setattr(mods.connector, "IOEngineConfig", FakeMori.IOEngineConfig, raising=False)
    monkeypatch.setattr(mods.connector, "BackendType", FakeMori.BackendType, raising=False)
    for name in ("BackendType", "PollCqMode", "RdmaBackendConfig", "EngineDesc"):
        monkeypatch.setattr(mods.engine, name, getattr(FakeMori, name), raising=False)
    backend = SimpleNamespace(get_name=lambda: "FAKE_ATTN")
    monkeypatch.setattr(mods.connector, "get_attn_backend", lambda *a, **k: backend)


@pytest.fixture
def make_worker(
    mods: SimpleNamespace, ranks: Callable[[int, int], None], fake_mori: None
) -> Iterator[Callable[..., Any]]:
    """Run the real MoRIIOConnectorWorker.__init__ for rank (dp, tp) of a DP x TP host."""
    made: list[Any] = []

    def make(dp: int, tp: int, dp_local: int, tp_size: int, **config: Any) -> Any:
        ranks(tp, tp_size)
        worker = mods.connector.MoRIIOConnectorWorker(
            vllm_config(dp, dp_local, tp_size, **config), f"engine-dp{dp}", kv_cache_config()
        )
        made.append(worker)
        return worker

    yield make
    for worker in made:
        worker.shutdown()


LAYER = "model.layers.0.self_attn.attn"
NUM_BLOCKS = 4


def kv_cache_config() -> Any:
    """A real one-layer KVCacheConfig (full attention, 4 blocks of 16 tokens)."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )

    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float16)
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],  # the connector reads the groups only
        kv_cache_groups=[KVCacheGroupSpec(layer_names=[LAYER], kv_cache_spec=spec)],
    )


@pytest.fixture
def kv_caches() -> Callable[[], dict[str, Any]]:
    """CPU KV caches shaped like the one-layer config ([2, blocks, 16, 1, 64]).

    Page-aligned like a GPU allocation (the connector registers whole pages): the
    storage is an anonymous mmap.
    """
    import mmap

    import torch

    def make() -> dict[str, Any]:
        shape = (2, NUM_BLOCKS, 16, 1, 64)
        nbytes = 2 * NUM_BLOCKS * 16 * 64 * 2
        buf = mmap.mmap(-1, max(nbytes, mmap.PAGESIZE))
        tensor = torch.frombuffer(buf, dtype=torch.float16, count=nbytes // 2).view(shape)
        return {LAYER: tensor}

    return make


@pytest.fixture
def held_port() -> Iterator[Callable[[], tuple[socket.socket, int]]]:
    """A TCP port held by a listener of another party (as a colliding rank would hold it)."""
    socks: list[socket.socket] = []

    def hold() -> tuple[socket.socket, int]:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("0.0.0.0", 0))
        sock.listen(8)
        socks.append(sock)
        return sock, sock.getsockname()[1]

    yield hold
    for sock in socks:
        sock.close()


def module_of(obj: Any) -> ModuleType:
    return importlib.import_module(obj.__module__)


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


_used_bases: set[int] = set()


@pytest.fixture
def free_bases() -> Callable[[int], tuple[int, int]]:
    """(handshake base, notify base), each with `n` free ports, below the ephemeral range.

    Listener threads of vLLM cannot be stopped, so every test gets fresh blocks.
    """
    import random

    def find(n: int) -> tuple[int, int]:
        rng = random.Random()
        for _ in range(500):
            base = rng.randrange(20000, 31000 - 2 * n, 4)
            if any(abs(base - used) < 2 * n + 64 for used in _used_bases):
                continue
            notify = base + n + 16
            if all(_bindable(p) for p in (*range(base, base + n), *range(notify, notify + n))):
                _used_bases.add(base)
                return base, notify
        raise RuntimeError("no free port block")

    return find


class Startup:
    """register_kv_caches run by an initializing thread, as the worker runs it."""

    def __init__(self, worker: Any, kv: dict[str, Any]) -> None:
        import threading
        import time

        self.worker = worker
        self.error: BaseException | None = None
        self.finished_at: float | None = None
        self.started_at = time.monotonic()

        def run() -> None:
            try:
                worker.register_kv_caches(kv)
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


@pytest.fixture
def startup(kv_caches: Callable[[], dict[str, Any]]) -> Callable[[Any], Startup]:
    return lambda worker: Startup(worker, kv_caches())
