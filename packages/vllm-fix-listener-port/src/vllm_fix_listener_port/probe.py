"""Does this vLLM hand MORI a kv port that Python chose (and released) before the native bind?

Runs the real, installed ``MoRIIOConfig.from_vllm_config`` body for two TP ranks
with ``SimpleNamespace`` configs, then, if this fix is installed on the target,
through this fix's own wrapper, and reads ``local_kv_port``.

The body reads two process-wide things a probe must not touch: the tensor-parallel
group (``get_tensor_model_parallel_rank`` / ``_world_size``, which need an
initialized distributed group) and ``get_open_port`` (sockets, ``VLLM_PORT``).
So the probe runs vLLM's own code object under a *private copy* of its module
globals in which those three names are stand-ins; vLLM's module, its
``parallel_state`` and the environment are never changed, and no socket is opened.
The ``get_open_port`` stand-in answers what ``VLLM_PORT`` scanning answers on a
host where no rank's listener is up yet: the same first port for everyone.

Other fixes' wrappers on the same target (e.g. vllm-fix-handshake-port) are not
run: the probe asks only about ``local_kv_port``.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from vllm_fix_core import Check, ProbeReport

SCAN_BASE = 47000  # what VLLM_PORT=47000 scanning returns while nothing listens yet
TP_SIZE = 2
HOST = "127.0.0.1"
EXTRA_CONFIG: dict[str, Any] = {
    "host_ip": HOST,  # resolve_host_ip: no get_ip() (it opens a socket)
    "http_port": "8000",
    "handshake_port": "6301",
    "notify_port": "61005",
    "proxy_ip": "",
    "proxy_ping_port": "0",
    "backend": "rdma",
}


class ScanStandIn:
    """Stands in for get_open_port(): VLLM_PORT scanning before any listener is up."""

    def __init__(self, base: int = SCAN_BASE) -> None:
        self.base = base
        self.calls = 0

    def __call__(self) -> int:
        self.calls += 1
        return self.base


def vllm_config(extra: dict[str, Any] | None = None) -> Any:
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config=dict(EXTRA_CONFIG if extra is None else extra),
            is_kv_producer=True,
        ),
        parallel_config=SimpleNamespace(
            data_parallel_rank=0, data_parallel_size_local=1, data_parallel_size=1
        ),
    )


def _modules() -> tuple[Any, Any]:
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_common, moriio_connector

    return moriio_common, moriio_connector


def original_from_vllm_config() -> Callable[..., Any]:
    """vLLM's own from_vllm_config function (below every fix's layers)."""
    from vllm_fix_core import original_of

    common, _ = _modules()
    raw = original_of(common.MoRIIOConfig, "from_vllm_config")
    func = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
    if not isinstance(func, types.FunctionType):
        raise TypeError(f"MoRIIOConfig.from_vllm_config is a {type(raw).__name__}, not a function")
    return func


def private_body(tp_rank: int, tp_size: int, scan: Callable[[], int]) -> Callable[..., Any]:
    """vLLM's from_vllm_config code object bound to MoRIIOConfig, under private globals."""
    common, _ = _modules()
    func = original_from_vllm_config()
    scope = dict(func.__globals__)
    scope["get_tensor_model_parallel_rank"] = lambda: tp_rank
    scope["get_tensor_model_parallel_world_size"] = lambda: tp_size
    scope["get_open_port"] = scan
    clone = types.FunctionType(func.__code__, scope, func.__name__, func.__defaults__, func.__closure__)
    clone.__kwdefaults__ = func.__kwdefaults__
    return functools.partial(clone, common.MoRIIOConfig)


def wrappers_on(owner: Any, attr: str) -> list[Any]:
    """The wrapt wrapper functions layered on owner.attr, outermost first."""
    import wrapt

    found: list[Any] = []
    obj = owner.__dict__.get(attr)
    while isinstance(obj, wrapt.FunctionWrapper) and len(found) < 32:
        found.append(getattr(obj, "_self_wrapper", None))
        obj = obj.__wrapped__
    return found


def installed() -> tuple[bool, bool]:
    """Is this fix's wrapper on (from_vllm_config, MoRIIOConnectorWorker.__init__)?"""
    from vllm_fix_listener_port import patch

    common, connector = _modules()
    return (
        patch.config_wrapper in wrappers_on(common.MoRIIOConfig, "from_vllm_config"),
        patch.worker_init_wrapper in wrappers_on(connector.MoRIIOConnectorWorker, "__init__"),
    )


def build(tp_rank: int, ours: bool) -> tuple[Any, Any, int]:
    """(vLLM's config, the config after this fix's wrapper if installed, probe calls)."""
    from vllm_fix_listener_port import patch

    common, _ = _modules()
    scan = ScanStandIn()
    body = private_body(tp_rank, TP_SIZE, scan)
    seen: list[Any] = []

    def call(*args: Any, **kwargs: Any) -> Any:
        config = body(*args, **kwargs)
        seen.append(dataclasses.replace(config))
        return config

    if ours:
        config = patch.config_wrapper(call, common.MoRIIOConfig, (vllm_config(),), {})
    else:
        config = call(vllm_config())
    return seen[0], config, scan.calls


def probe() -> ProbeReport:
    config_fixed, worker_fixed = installed()
    built = [build(rank, config_fixed) for rank in range(TP_SIZE)]
    ports = [cfg.local_kv_port for _, cfg, _ in built]
    python_chosen = [p for p in ports if p != 0]
    changed = sorted(
        {
            f.name
            for raw, cfg, _ in built
            for f in dataclasses.fields(raw)
            if f.name != "local_kv_port" and getattr(raw, f.name) != getattr(cfg, f.name)
        }
    )
    return ProbeReport(
        (
            Check(
                "kv-port-chosen-before-native-bind",
                bool(python_chosen),
                f"TP ranks 0..{TP_SIZE - 1} get local_kv_port {ports} from a released probe "
                f"(get_open_port called {built[0][2]}x per config); MORI binds it later"
                if python_chosen
                else f"local_kv_port {ports}: the native listener chooses",
            ),
            # Guards: the fix changes nothing else, and never runs half-installed.
            Check(
                "other-config-fields-kept",
                bool(changed),
                f"fields changed: {changed}" if changed else "",
                guard=True,
            ),
            Check(
                "worker-reads-native-port",
                config_fixed and not worker_fixed,
                "local_kv_port=0 but MoRIIOConnectorWorker.__init__ does not read the bound port back"
                if config_fixed and not worker_fixed
                else "",
                guard=True,
            ),
        )
    )
