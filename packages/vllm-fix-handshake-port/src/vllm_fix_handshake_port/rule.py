"""The port rule itself (no vLLM imports).

MoRIIO gives every (local DP rank, TP rank) of an engine its own handshake and notify
port: ``base + offset``. Peers do not exchange these ports; each side derives them
from the published base ports, so the listener and every dialer must agree on one
offset. The rule here is the only injective one that fits vLLM's dialers:

    offset(dp_local, tp_rank) = dp_local * tp_size + tp_rank,   0 <= tp_rank < tp_size

with ``tp_size`` the TP size of the engine that *listens*.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

MAX_PORT = 65535

TpSize = int | Callable[[], int]

# TP size of the engine that listens on the ports computed in this context. Set by
# the wrappers around every vLLM function that calls get_port_offset(dp, tp) without
# a TP size; read by the wrapped get_port_offset.
_LISTENING_TP: ContextVar[TpSize | None] = ContextVar("vllm_fix_handshake_port_tp", default=None)


class PortLayoutError(ValueError):
    """The handshake/notify bases cannot give every rank of this host its own port."""


def port_offset(dp_local: int, tp_rank: int, tp_size: int) -> int:
    """The per-rank offset, injective over 0 <= tp_rank < tp_size, dp_local >= 0."""
    for name, value in (("dp_local", dp_local), ("tp_rank", tp_rank), ("tp_size", tp_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} is outside [0, {tp_size}): its port would be another rank's")
    if dp_local < 0:
        raise ValueError(f"local DP rank must be >= 0, got {dp_local}")
    return dp_local * tp_size + tp_rank


def rank_of_offset(offset: int, tp_size: int) -> tuple[int, int]:
    """Inverse of port_offset: (dp_local, tp_rank)."""
    if tp_size < 1 or offset < 0:
        raise ValueError(f"no rank has offset {offset} with tp_size {tp_size}")
    return divmod(offset, tp_size)


def check_layout(handshake_base: int, notify_base: int, dp_size_local: int, tp_size: int) -> None:
    """Raise PortLayoutError unless both port blocks fit and do not overlap.

    Each base owns ``dp_size_local * tp_size`` consecutive ports on the host.
    ``dp_size_local == 0`` (vLLM's external-DP sentinel) counts as one DP rank.
    """
    ranks = max(dp_size_local, 1) * max(tp_size, 1)
    blocks = {"handshake_port": handshake_base, "notify_port": notify_base}
    for name, base in blocks.items():
        if not 1 <= base <= MAX_PORT - ranks + 1:
            raise PortLayoutError(
                f"MoRIIO {name}={base} leaves no room for {ranks} ranks "
                f"(DP local x TP = {max(dp_size_local, 1)} x {tp_size}): ports "
                f"{base}..{base + ranks - 1} must lie in 1..{MAX_PORT}; change {name} in "
                "kv_transfer_config.kv_connector_extra_config"
            )
    lo, hi = sorted((handshake_base, notify_base))
    if hi < lo + ranks:
        raise PortLayoutError(
            f"MoRIIO handshake_port={handshake_base} and notify_port={notify_base} overlap: "
            f"each needs {ranks} consecutive ports (DP local x TP = {max(dp_size_local, 1)} x "
            f"{tp_size}), so one rank's handshake port would be another rank's notify port. "
            "Move one base in kv_transfer_config.kv_connector_extra_config at least "
            f"{ranks} ports away from the other."
        )


@contextmanager
def listening_tp_size(size: TpSize) -> Iterator[None]:
    """get_port_offset(dp, tp) calls inside this block use `size` as the TP size."""
    token = _LISTENING_TP.set(size)
    try:
        yield
    finally:
        _LISTENING_TP.reset(token)


def current_listening_tp_size() -> int | None:
    """The TP size set by the innermost listening_tp_size block, or None outside one."""
    value = _LISTENING_TP.get()
    if value is None:
        return None
    size = value() if callable(value) else value
    return int(size)
