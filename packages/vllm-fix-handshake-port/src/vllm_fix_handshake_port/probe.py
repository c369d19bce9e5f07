"""Do this vLLM's MoRIIO listeners share ports, and do its dialers miss them?

Evaluates the real, currently installed ``get_port_offset`` exactly as the two listener
sites call it (``MoRIIOConfig.from_vllm_config`` for the notify port,
``MoRIIOConnectorWorker.__init__`` for the handshake port): through the module global
each one reaches, with the arguments its source passes (read from its AST), inside the
listening engine's TP-size context (``rule.listening_tp_size``: vLLM's own code ignores
it, the fix honours it). Dialers are evaluated as ``_moriio_handshake`` calls it, with
the remote TP size. No sockets, threads or state; ~10 ms (two small ASTs).
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Callable
from typing import Any

from vllm_fix_core import Check, ProbeReport, function_ast
from vllm_fix_handshake_port.rule import listening_tp_size

GRIDS = ((2, 2), (4, 8))  # (local DP size, TP size)
PACKAGE = "vllm.distributed.kv_transfer.kv_connector.v1.moriio"
# (module, class, method) of the sites that bind a per-rank port.
LISTENER_SITES = (
    ("moriio_common", "MoRIIOConfig", "from_vllm_config"),
    ("moriio_connector", "MoRIIOConnectorWorker", "__init__"),
)


def _call_arity(func: Any) -> int:
    """Number of arguments the function passes to get_port_offset (first call)."""
    for node in ast.walk(function_ast(func)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "get_port_offset"
        ):
            return len(node.args) + len(node.keywords)
    raise LookupError(f"{func!r} no longer calls get_port_offset; cannot evaluate its listener port")


def _listener(short: str, cls: str, method: str) -> tuple[Callable[..., int], int]:
    module = importlib.import_module(f"{PACKAGE}.{short}")
    raw = getattr(module, cls).__dict__[method]
    return module.get_port_offset, _call_arity(raw)


def probe() -> ProbeReport:
    collisions: list[str] = []
    misses: list[str] = []
    explicit_wrong: list[str] = []
    outside_changed: list[str] = []
    for short, cls, method in LISTENER_SITES:
        fn, arity = _listener(short, cls, method)
        site = f"{cls}.{method}"
        for dp_size, tp_size in GRIDS:
            seen: dict[int, tuple[int, int]] = {}
            with listening_tp_size(tp_size):
                for dp in range(dp_size):
                    for tp in range(tp_size):
                        listen = fn(dp, tp) if arity < 3 else fn(dp, tp, tp_size)
                        if listen in seen and len(collisions) < len(LISTENER_SITES):
                            collisions.append(
                                f"{site}: ranks {seen[listen]} and {(dp, tp)} both bind base+{listen}"
                            )
                        seen.setdefault(listen, (dp, tp))
                        dial = fn(dp, tp, tp_size)  # as _moriio_handshake / the READ release dial
                        if dial != listen and not misses:
                            misses.append(
                                f"{site}: dialer for {(dp, tp)} targets base+{dial}, "
                                f"it listens on base+{listen}"
                            )
        # Guards: a call that names the TP size keeps vLLM's formula; outside a listening
        # context, calls without one are left exactly as vLLM computes them.
        if fn(3, 1, 4) != 13:
            explicit_wrong.append(f"{short}: get_port_offset(3, 1, 4) = {fn(3, 1, 4)}")
        if fn(1, 1) != 2:
            outside_changed.append(f"{short}: get_port_offset(1, 1) = {fn(1, 1)} outside a listener")
    return ProbeReport(
        (
            Check("listener-ports-collide", bool(collisions), "; ".join(collisions)),
            Check("dialer-misses-listener", bool(misses), "; ".join(misses)),
            Check("explicit-tp-size-offset", bool(explicit_wrong), "; ".join(explicit_wrong), guard=True),
            Check(
                "offset-outside-listener-context",
                bool(outside_changed),
                "; ".join(outside_changed),
                guard=True,
            ),
        )
    )
