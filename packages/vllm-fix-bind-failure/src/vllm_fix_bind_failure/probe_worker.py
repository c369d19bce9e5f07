"""The worker the probe starts up: vLLM's own ``MoRIIOConnectorWorker``, built by its installed
``__init__`` with MORI stood in (:mod:`vllm_fix_core.moriio_probe`), and what it is built from.

The probe drives ``register_kv_caches`` (as installed) on it. The engine stand-in listens on a
free port when the configured KV port is taken: this probe looks at the handshake and notify
listeners, not at the KV listener.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType, SimpleNamespace
from typing import Any, ClassVar

from vllm_fix_core import moriio_probe

HOST = "127.0.0.1"
LAYER = "model.layers.0.self_attn.attn"
NUM_BLOCKS = 2
BLOCK_SIZE = 16
HEAD_SIZE = 64


class _AnyPortEngine(moriio_probe.EngineStandIn):
    any_port_when_taken: ClassVar[bool] = True


def vllm_config(handshake: int, notify: int) -> Any:
    """What the worker reads of a VllmConfig: vLLM's own kv-transfer and parallel configs."""
    from vllm.config import KVTransferConfig, ParallelConfig

    extra = {
        "host_ip": HOST,
        "http_port": "8000",
        "handshake_port": str(handshake),
        "notify_port": str(notify),
        "proxy_ip": "",
        "proxy_ping_port": "0",
    }
    return SimpleNamespace(
        kv_transfer_config=KVTransferConfig(
            kv_connector="MoRIIOConnector", kv_role="kv_producer", kv_connector_extra_config=extra
        ),
        parallel_config=ParallelConfig(),
        cache_config=SimpleNamespace(block_size=BLOCK_SIZE, cache_dtype="auto"),
        model_config=SimpleNamespace(
            use_mla=False,
            dtype="float16",
            get_head_size=lambda: HEAD_SIZE,
            get_total_num_kv_heads=lambda: 1,
            hf_config=SimpleNamespace(model_type="probe"),
        ),
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=True),
    )


def kv_cache_config() -> Any:
    """vLLM's KVCacheConfig: one full-attention layer of NUM_BLOCKS blocks."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=HEAD_SIZE, dtype=torch.float16)
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=[LAYER], kv_cache_spec=spec)],
    )


def kv_caches() -> dict[str, Any]:
    """A CPU KV cache for the one layer, page-aligned as a device allocation is."""
    import torch

    shape = (2, NUM_BLOCKS, BLOCK_SIZE, 1, HEAD_SIZE)
    nbytes = 2 * NUM_BLOCKS * BLOCK_SIZE * HEAD_SIZE * 2
    buf = mmap.mmap(-1, max(nbytes, mmap.PAGESIZE))
    return {LAYER: torch.frombuffer(buf, dtype=torch.float16, count=nbytes // 2).view(shape)}


@contextmanager
def probe_worker(connector: ModuleType, engine: ModuleType, handshake: int, notify: int) -> Iterator[Any]:
    """vLLM's worker, built by the installed ``__init__``; shut down with vLLM's own ``shutdown``."""
    with moriio_probe.probe_worker(
        connector,
        engine,
        vllm_config(handshake, notify),
        kv_cache_config(),
        "vllm-fix-bind-failure-probe",
        engine_class=_AnyPortEngine,
    ) as worker:
        yield worker
