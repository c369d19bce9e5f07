"""Do this vLLM's MoRIIO listeners share ports, and do its dialers miss them?

Calls the real, currently installed ``get_port_offset`` through each module global the
MoRIIO call sites reach (moriio_common, moriio_connector, moriio_engine), the way they
call it: listeners as ``get_port_offset(dp, tp)`` inside the listening engine's TP-size
context (``rule.listening_tp_size``, which vLLM's own code ignores and the fix honours),
dialers as ``get_port_offset(dp, tp, remote_tp_size)``. ``recognize`` proves that every
call without a TP size is such a listener/sender site. No sockets, threads or state.
"""

from __future__ import annotations

import importlib
from typing import Any

from vllm_fix_core import Check, ProbeReport

from vllm_fix_handshake_port.rule import listening_tp_size

GRIDS = ((2, 2), (4, 8))  # (local DP size, TP size)
MODULES = ("moriio_common", "moriio_connector", "moriio_engine")
PACKAGE = "vllm.distributed.kv_transfer.kv_connector.v1.moriio"


def _offsets() -> list[tuple[str, Any]]:
    found = []
    for short in MODULES:
        module = importlib.import_module(f"{PACKAGE}.{short}")
        fn = getattr(module, "get_port_offset", None)
        if fn is not None:
            found.append((short, fn))
    return found


def probe() -> ProbeReport:
    collisions: list[str] = []
    misses: list[str] = []
    explicit_wrong: list[str] = []
    outside_changed: list[str] = []
    for short, fn in _offsets():
        for dp_size, tp_size in GRIDS:
            seen: dict[int, tuple[int, int]] = {}
            with listening_tp_size(tp_size):
                for dp in range(dp_size):
                    for tp in range(tp_size):
                        listen = fn(dp, tp)
                        if listen in seen and not collisions:
                            collisions.append(f"{short}: ranks {seen[listen]} and {(dp, tp)} both bind base+{listen}")
                        seen.setdefault(listen, (dp, tp))
                        dial = fn(dp, tp, tp_size)
                        if dial != listen and not misses:
                            misses.append(
                                f"{short}: dialer for {(dp, tp)} targets base+{dial}, it listens on base+{listen}"
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
            Check("explicit-tp-size-offset", bool(explicit_wrong), "; ".join(explicit_wrong)),
            Check("offset-outside-listener-context", bool(outside_changed), "; ".join(outside_changed)),
        )
    )
