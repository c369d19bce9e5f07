"""The worker the probe starts up: vLLM's own ``MoRIIOConnectorWorker``, built by its installed
``__init__`` with MORI stood in (:mod:`vllm_fix_core.moriio_probe`), and what it is built from
(the configs and the KV cache of that module too).

The probe drives ``register_kv_caches`` (as installed) on it. The engine stand-in listens on a
port the kernel picks, whatever the config says: this probe looks at the handshake and notify
listeners, not at the KV listener.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any, ClassVar

from vllm_fix_core import moriio_probe

NUM_BLOCKS = 2


class _KernelPortEngine(moriio_probe.EngineStandIn):
    kernel_port: ClassVar[bool] = True


def vllm_config(handshake: int, notify: int) -> Any:
    """vLLM's own VllmConfig for the worker (built by vllm_fix_core.moriio_probe)."""
    return moriio_probe.with_worker_configs(
        moriio_probe.vllm_config(moriio_probe.extra_config(handshake, notify))
    )


def kv_caches() -> dict[str, Any]:
    """A CPU KV cache for the worker's one layer, page-aligned as a device allocation is."""
    return moriio_probe.kv_caches(NUM_BLOCKS)


@contextmanager
def probe_worker(connector: ModuleType, engine: ModuleType, handshake: int, notify: int) -> Iterator[Any]:
    """vLLM's worker, built by the installed ``__init__``; shut down with vLLM's own ``shutdown``."""
    with moriio_probe.probe_worker(
        connector,
        engine,
        vllm_config(handshake, notify),
        moriio_probe.kv_cache_config(NUM_BLOCKS),
        "vllm-fix-bind-failure-probe",
        engine_class=_KernelPortEngine,
    ) as worker:
        yield worker
