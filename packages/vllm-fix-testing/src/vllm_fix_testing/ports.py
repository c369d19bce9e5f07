"""What the guest tests of the probes that start MoRIIO listeners share: VLLM_PORT set to a port
the test holds (or to a free one), and every bind() a Python socket makes in the test traced."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

VLLM_PORT_KINDS = ("held by a listener", "free")


def trace_binds(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(port asked for, port bound or -1 where the bind failed) of every bind() a Python socket
    makes while `monkeypatch` is in force (the test's own tracing: ZMQ listeners bind in libzmq)."""
    seen: list[tuple[int, int]] = []
    original = socket.socket.bind

    def bind(self: socket.socket, address: Any) -> None:
        if not (isinstance(address, tuple) and len(address) >= 2):
            return original(self, address)
        try:
            original(self, address)
        except OSError:
            seen.append((int(address[1]), -1))
            raise
        seen.append((int(address[1]), int(self.getsockname()[1])))
        return None

    monkeypatch.setattr(socket.socket, "bind", bind)
    return seen


@contextmanager
def vllm_port(kind: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """VLLM_PORT set to a port a listening socket of the test holds (no SO_REUSEADDR: kind "held
    by a listener"), or to a free one (kind "free")."""
    if kind not in VLLM_PORT_KINDS:
        raise ValueError(f"kind must be one of {VLLM_PORT_KINDS}, not {kind!r}")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("", 0))
        port = int(sock.getsockname()[1])
        if kind == "free":
            sock.close()
        else:
            sock.listen(1)
        monkeypatch.setenv("VLLM_PORT", str(port))
        yield port
    finally:
        sock.close()
