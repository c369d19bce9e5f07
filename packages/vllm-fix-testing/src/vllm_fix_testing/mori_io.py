"""Stands in for ``mori.io``'s IOEngine and its native RDMA control-plane listener.

ROCm/mori ``TCPContext::Listen`` (src/application/transport/tcp/tcp.cpp): set
``SO_REUSEADDR``, ``bind`` (on failure MORI prints ``syscall failed with ...`` and calls
``exit(-1)``; here the ``OSError`` propagates so a test can count it), ``getsockname``,
``listen(128)``. ``IOEngine.create_backend(RDMA, ...)`` is where that bind happens; XGMI has
no TCP listener.

Two MORI behaviours for ``IOEngineConfig(host, 0)``:

* ``auto_bind=True`` (ROCm/mori since "Handle IOEngineConfig(port=0) auto-bind and expose
  listen port", in every tag from v0.1.0): the engine descriptor reports the bound port;
* ``auto_bind=False`` (older builds): the listener binds a kernel-chosen port but the
  descriptor still says 0, so peers cannot reach the worker.

:func:`mori_module` builds a stand-in ``mori`` package (with ``__version__`` and ``mori.io``)
for code that inspects the installed MORI; :func:`install_in_vllm` puts the stand-in names
where vLLM's MoRIIO modules imported them from ``mori.io`` (which is absent here).
"""

from __future__ import annotations

import socket
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

RDMA = "rdma"
XGMI = "xgmi"
AUTO_BIND_SINCE = "0.1.0"  # first MORI tag; the auto-bind change precedes it
BEFORE_AUTO_BIND = "0.0.1.dev20+g0000000"  # what a build from before the change reports


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


class BackendType:
    RDMA = RDMA
    XGMI = XGMI
    TCP = "tcp"


class IOEngine:
    """Stands in for ``mori.io.IOEngine(key, IOEngineConfig(host, port))``.

    Class-level knobs (a test sets them; :func:`install_in_vllm` resets them):
    ``auto_bind`` (see the module docstring), ``before_bind`` (called with the engine
    right before the native bind: a race test waits at a barrier there).
    """

    instances: ClassVar[list[IOEngine]] = []
    auto_bind: ClassVar[bool] = True
    before_bind: ClassVar[Callable[[IOEngine], None] | None] = None

    def __init__(self, key: str, config: IOEngineConfig) -> None:
        self.key = key
        self.config = config
        self.listener: socket.socket | None = None
        IOEngine.instances.append(self)

    def create_backend(self, backend_type: Any, backend_config: Any = None) -> None:
        if str(getattr(backend_type, "value", backend_type)).lower() != RDMA:
            return
        hook = type(self).before_bind
        if hook is not None:
            hook(self)
        self.listener = mori_listen(self.config.host, self.config.port)

    def get_engine_desc(self) -> EngineDesc:
        port = self.config.port
        if self.listener is not None and (port != 0 or type(self).auto_bind):
            port = self.listener.getsockname()[1]
        return EngineDesc(self.key, self.config.host, port)

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None

    @classmethod
    def close_all(cls) -> None:
        for engine in cls.instances:
            engine.close()
        cls.instances.clear()


def _config(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
    return (args, kwargs)


def mori_module(version: str | None = AUTO_BIND_SINCE) -> types.ModuleType:
    """A stand-in ``mori`` package (``__version__``; ``mori.io`` with the names vLLM imports)."""
    mori = types.ModuleType("mori")
    if version is not None:
        mori.__version__ = version  # type: ignore[attr-defined]
    io = types.ModuleType("mori.io")
    for name, value in {
        "IOEngine": IOEngine,
        "IOEngineConfig": IOEngineConfig,
        "BackendType": BackendType,
        "EngineDesc": EngineDesc,
        "RdmaBackendConfig": _config,
        "XgmiBackendConfig": _config,
        "PollCqMode": types.SimpleNamespace(POLLING="polling", EVENT="event"),
    }.items():
        setattr(io, name, value)
    mori.io = io  # type: ignore[attr-defined]
    mori.__path__ = []  # a package, for importlib
    return mori


def _auto_bind_of(version: str | None) -> bool:
    from packaging.version import InvalidVersion, Version

    try:
        return version is not None and Version(version) >= Version(AUTO_BIND_SINCE)
    except InvalidVersion:
        return False


def put_mori(version: str | None = AUTO_BIND_SINCE, *, auto_bind: bool | None = None) -> types.ModuleType:
    """Make the stand-in the importable ``mori`` for good (a forked child that exits afterwards).

    ``auto_bind`` defaults to what that version does (auto-bind from 0.1.0 on).
    """
    module = mori_module(version)
    sys.modules["mori"] = module
    sys.modules["mori.io"] = module.io
    IOEngine.auto_bind = _auto_bind_of(version) if auto_bind is None else auto_bind
    return module


@contextmanager
def installed_mori(version: str | None = AUTO_BIND_SINCE, *, auto_bind: bool | None = None) -> Iterator[Any]:
    """``sys.modules['mori']`` / ``['mori.io']`` are the stand-in for the block (then restored)."""
    saved = {name: sys.modules.get(name) for name in ("mori", "mori.io")}
    saved_auto = IOEngine.auto_bind
    try:
        yield put_mori(version, auto_bind=auto_bind)
    finally:
        IOEngine.auto_bind = saved_auto
        for name, previous in saved.items():
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous


def install_in_vllm(setattr_: Callable[..., Any]) -> None:
    """Put the stand-in where vLLM's MoRIIO modules expect ``mori.io``'s names.

    ``setattr_`` is ``monkeypatch.setattr`` (restored after the test) or plain ``setattr``
    (a forked child that exits afterwards). Also stands in for what a CPU process lacks on the
    worker's start-up path: the world / TP groups (torch.distributed needs a GPU per rank) and
    the attention-backend lookup at the end of ``MoRIIOConnectorWorker.__init__``
    (``get_attn_backend``; ``get_current_attn_backends`` from vLLM 0.34.0).
    """
    from vllm.distributed import parallel_state
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector, moriio_engine

    IOEngine.before_bind = None
    setattr_(moriio_connector, "MoRIIO_enabled", True)
    for module in (moriio_connector, moriio_engine):
        setattr_(module, "BackendType", BackendType, raising=False)
    setattr_(moriio_connector, "IOEngine", IOEngine, raising=False)
    setattr_(moriio_connector, "IOEngineConfig", IOEngineConfig, raising=False)
    setattr_(moriio_engine, "RdmaBackendConfig", _config, raising=False)
    setattr_(moriio_engine, "XgmiBackendConfig", _config, raising=False)
    setattr_(moriio_engine, "PollCqMode", types.SimpleNamespace(POLLING="polling"), raising=False)
    backend = types.SimpleNamespace(get_name=lambda: "STAND_IN")
    if hasattr(moriio_connector, "get_attn_backend"):  # up to vLLM 0.33.0
        setattr_(moriio_connector, "get_attn_backend", lambda *a, **k: backend)
    if hasattr(moriio_connector, "get_current_attn_backends"):
        # vLLM 0.34.0: ``__init__`` asks for the backends of the config's attention layers
        setattr_(moriio_connector, "get_current_attn_backends", lambda *a, **k: [backend])
    setattr_(parallel_state, "_WORLD", types.SimpleNamespace(rank=0, local_rank=0))


def plain_setattr(owner: Any, name: str, value: Any, raising: bool = True) -> None:
    """``setattr`` with monkeypatch's signature (for a forked child)."""
    if raising and not hasattr(owner, name):
        raise AttributeError(name)
    setattr(owner, name, value)
