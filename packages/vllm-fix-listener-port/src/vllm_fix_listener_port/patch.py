"""Apply: two stateless-per-call wrappers (the config's kv port; the worker adopts what MORI bound).

The strategy follows the installed MORI (mori_support), decided in ``recognize``:

* ``port 0``: MORI reports an auto-bound port, so the RDMA config asks its listener for
  port 0 and the kernel chooses at bind time;
* ``held reservation``: an older (or unversioned) MORI would report 0, so the config
  carries a port this process holds (reserve.py) until the worker's ``__init__`` has
  started MORI's listener; then the hold is released.

Both wrappers only touch ``local_kv_port`` and compose with any other fix's wrapper on
the same targets (vllm_fix_core.PatchSet layers them), in either order.
"""

from __future__ import annotations

import ast
from typing import Any

from vllm_fix_core import PatchSet, UnknownShape, ast_fingerprint, function_ast, get_logger, original_of
from vllm_fix_listener_port.mori_support import installed_mori
from vllm_fix_listener_port.reserve import hold_for_listener, keep_until_released, release_for
from vllm_fix_listener_port.rule import adopt_native_port, is_rdma, let_native_engine_choose

# (from_vllm_config, MoRIIOConnectorWorker.__init__) normalized-AST fingerprints.
KNOWN_SHAPES = {
    ("b76105651890c6b7", "9c7f54fd1e2be239"): "vllm-0.32.0",
    ("b76105651890c6b7", "f3895dfaa3153145"): "vllm-0.33.0",
}
PORT_ZERO = "port 0"
HELD_RESERVATION = "held reservation"
_logger = get_logger("listener-port")


def _classes() -> tuple[Any, Any]:
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_common, moriio_connector

    return moriio_common.MoRIIOConfig, moriio_connector.MoRIIOConnectorWorker


def config_wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """MoRIIOConfig.from_vllm_config: an RDMA config asks the native listener for port 0."""
    return let_native_engine_choose(wrapped(*args, **kwargs))


def config_wrapper_reserving(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """MoRIIOConfig.from_vllm_config: an RDMA config carries a port this process holds.

    The hold ends when the worker's __init__ returns (its listener is up) or raises, or
    when the config is collected, whichever comes first.
    """
    config = wrapped(*args, **kwargs)
    if is_rdma(config):
        reservation = hold_for_listener(str(config.local_ip))
        config.local_kv_port = reservation.port
        keep_until_released(config, reservation)
    return config


def worker_init_wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """MoRIIOConnectorWorker.__init__: once the listener is up, release any hold, adopt the bound port."""
    try:
        wrapped(*args, **kwargs)
    finally:
        config = getattr(instance, "moriio_config", None)
        if config is not None:
            release_for(config)
    if instance is None:
        return
    port = adopt_native_port(instance)
    if port is not None:
        _logger.debug("MoRIIO RDMA listener bound port %d", port)


def kv_port_value(func: Any) -> ast.expr:
    """The expression from_vllm_config passes as ``local_kv_port=`` to ``cls(...)``."""
    return kv_port_value_in(function_ast(func))


def kv_port_value_in(tree: ast.AST) -> ast.expr:
    """The same, in from_vllm_config's AST (the runtime's and the native carry's check)."""
    values = [
        kw.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "cls"
        for kw in node.keywords
        if kw.arg == "local_kv_port"
    ]
    if len(values) != 1:
        raise UnknownShape(f"from_vllm_config passes local_kv_port= to cls(...) {len(values)} times")
    return values[0]


def is_released_probe(value: ast.expr) -> bool:
    """``get_open_port()`` with no arguments: a port probed and released before MORI binds."""
    return (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Name)
        and value.func.id == "get_open_port"
        and not value.args
        and not value.keywords
    )


def _worker_shape(init: Any) -> None:
    worker_shape(function_ast(init))


def worker_shape(tree: ast.AST) -> None:
    """UnknownShape unless MoRIIOConnectorWorker.__init__ (its AST) builds the config, the
    engine and the backend the way both wrappers and the native carry rely on."""
    source = ast.unparse(tree)
    needed = {
        "self.moriio_config = MoRIIOConfig.from_vllm_config(": "builds its config with from_vllm_config",
        "self.local_kv_port = self.moriio_config.local_kv_port": "copies local_kv_port from the config",
        "self.moriio_engine = IOEngine(": "creates the native IOEngine",
        "IOEngineConfig(self.moriio_config.local_ip, self.moriio_config.local_kv_port)": (
            "hands moriio_config.local_kv_port to IOEngineConfig"
        ),
        ".set_backend_type(": "starts the backend (the native bind) inside __init__",
    }
    for text, what in needed.items():
        if text not in source:
            raise UnknownShape(f"MoRIIOConnectorWorker.__init__ no longer {what}")
    order = [source.index(t) for t in ("from_vllm_config(", "IOEngine(", ".set_backend_type(")]
    if order != sorted(order):
        raise UnknownShape("MoRIIOConnectorWorker.__init__ builds config, engine, backend in another order")


def strategy() -> tuple[str, str]:
    """(strategy, why) for the installed MORI."""
    mori = installed_mori()
    if not mori.present:
        return PORT_ZERO, mori.describe() + " (no MoRIIO worker can start; port 0 is the default)"
    if mori.auto_bind:
        return PORT_ZERO, mori.describe()
    return HELD_RESERVATION, mori.describe()


def recognize() -> str:
    config_cls, worker_cls = _classes()
    raw = original_of(config_cls, "from_vllm_config")
    if not isinstance(raw, classmethod):
        raise UnknownShape("MoRIIOConfig.from_vllm_config is no longer a classmethod")
    fields = getattr(config_cls, "__dataclass_fields__", {})
    # No ``backend`` field: an RDMA-only MoRIIO, which the fix treats as RDMA.
    for name in ("local_ip", "local_kv_port"):
        if name not in fields:
            raise UnknownShape(f"MoRIIOConfig has no {name} field")
    value = kv_port_value(raw)
    if not is_released_probe(value):
        raise UnknownShape(f"from_vllm_config sets local_kv_port={ast.unparse(value)}, not get_open_port()")
    init = original_of(worker_cls, "__init__")
    _worker_shape(init)
    key = (ast_fingerprint(raw), ast_fingerprint(init))
    chosen, why = strategy()
    return f"{KNOWN_SHAPES.get(key, 'structural')}; {chosen}: {why}"


def apply(patch: PatchSet, shape: str) -> None:
    config_cls, worker_cls = _classes()
    reserving = f"; {HELD_RESERVATION}:" in shape
    patch.wrap(config_cls, "from_vllm_config", config_wrapper_reserving if reserving else config_wrapper)
    patch.wrap(worker_cls, "__init__", worker_init_wrapper)
