"""What this machine lacks, emulated exactly: MORI's IOEngine and its native TCP listener.

ROCm/mori ``TCPContext::Listen`` (src/application/transport/tcp/tcp.cpp): set
``SO_REUSEADDR``, ``bind`` (on failure: print ``syscall failed with ...`` and
``exit(-1)``), ``getsockname`` -> the engine descriptor's ``port``, ``listen(128)``.
``IOEngine.create_backend(RDMA, ...)`` is where that bind happens; XGMI has no TCP
listener. Used by this package's tests and benchmark, never by the fix itself.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any, ClassVar

RDMA = "rdma"
XGMI = "xgmi"


def mori_listen(host: str, port: int) -> socket.socket:
    """A listener bound exactly as MORI binds its RDMA control-plane socket (raises OSError)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock


@dataclass
class IOEngineConfig:
    host: str
    port: int


@dataclass
class EngineDesc:
    key: str
    host: str
    port: int


class IOEngine:
    """Stands in for ``mori.io.IOEngine(key, IOEngineConfig(host, port))``.

    ``report_port`` overrides what the descriptor says (to emulate a MORI that
    cannot report an auto-bound port).
    """

    instances: ClassVar[list[IOEngine]] = []

    def __init__(self, key: str, config: IOEngineConfig, report_port: int | None = None) -> None:
        self.key = key
        self.config = config
        self.listener: socket.socket | None = None
        self.report_port = report_port
        IOEngine.instances.append(self)

    def create_backend(self, backend_type: Any, backend_config: Any = None) -> None:
        if str(getattr(backend_type, "value", backend_type)).lower() == RDMA:
            self.listener = mori_listen(self.config.host, self.config.port)

    def get_engine_desc(self) -> EngineDesc:
        if self.report_port is not None:
            port = self.report_port
        elif self.listener is not None:
            port = self.listener.getsockname()[1]
        else:
            port = self.config.port
        return EngineDesc(self.key, self.config.host, port)

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None
