"""The fix's own rule, importable without vLLM.

* ``let_native_engine_choose(config)``: an RDMA MoRIIO config asks its native
  listener for port 0, so the kernel chooses a free port atomically at bind time.
* ``adopt_native_port(worker)``: after the native listener is up, the port the
  engine actually bound (its descriptor's ``port``) becomes the worker's and the
  config's ``local_kv_port``. Port 0 from an RDMA backend is a clear error.
"""

from __future__ import annotations

from typing import Any

#: What the native MORI listener is asked to bind: "any free port".
NATIVE_CHOOSES = 0
RDMA = "rdma"


class ListenerPortError(RuntimeError):
    """The native MoRIIO engine did not report the port its RDMA listener bound."""


def is_rdma(config: Any) -> bool:
    """RDMA backend (a MoRIIOConfig without a ``backend`` field is RDMA-only)."""
    return str(getattr(config, "backend", RDMA)).lower() == RDMA


def let_native_engine_choose(config: Any) -> Any:
    """Make an RDMA config ask for port 0; other backends (XGMI: no TCP listener) untouched."""
    if is_rdma(config):
        config.local_kv_port = NATIVE_CHOOSES
    return config


def native_port(engine: Any) -> int:
    """The port in the engine descriptor (``IOEngine.get_engine_desc().port``)."""
    if engine is None:
        raise ListenerPortError("MoRIIO worker has no native engine after __init__")
    get_desc = getattr(engine, "get_engine_desc", None)
    if get_desc is None:
        raise ListenerPortError(
            f"MoRIIO engine {type(engine).__name__} has no get_engine_desc(); this MORI cannot "
            "report the port its RDMA listener bound"
        )
    port = getattr(get_desc(), "port", None)
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ListenerPortError(f"MoRIIO engine descriptor carries no valid port: {port!r}")
    return port


def adopt_native_port(worker: Any) -> int | None:
    """Post-init fix-up of a MoRIIOConnectorWorker; returns the adopted port (None: not RDMA)."""
    config = worker.moriio_config
    if not is_rdma(config):
        return None
    port = native_port(getattr(worker, "moriio_engine", None))
    if port == NATIVE_CHOOSES:
        raise ListenerPortError(
            "the MoRIIO RDMA backend reports listen port 0 after start-up, so peers could not "
            "reach this worker. This MORI does not support IOEngineConfig(port=0) auto-bind "
            "(ROCm/mori#125, 'Handle IOEngineConfig(port=0) auto-bind and expose listen port', "
            "in every tag from v0.1.0) although its version said it does; upgrade MORI, or "
            "disable this fix with VLLM_FIXES_DISABLE=listener-port"
        )
    worker.local_kv_port = port
    config.local_kv_port = port
    return port
