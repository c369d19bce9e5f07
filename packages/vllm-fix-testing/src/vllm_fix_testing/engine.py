"""MORI engine, sessions and a MoRIIOWrapper stand-in that record what vLLM asks of them."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm_fix_testing.status import SUCCEEDED, FakeStatus

WRAPPER_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_engine"


@dataclass(frozen=True)
class ReadCall:
    """One ``session.batch_read`` (what vLLM's real ``read_remote_data`` posts)."""

    session: int
    local_offsets: Any
    remote_offsets: Any
    sizes: Any
    uid: int


@dataclass(frozen=True)
class Notify:
    """One ``send_notify`` call, as vLLM made it."""

    transfer_id: Any
    host: str
    port: Any
    message_type: str | None
    message_fields: dict[str, Any] | None


@dataclass(frozen=True)
class FakeMemoryDesc:
    """What ``register_torch_tensor`` returns: the registered byte range."""

    data_ptr: int
    nbytes: int
    device: str

    def pack(self) -> bytes:
        return f"{self.data_ptr}:{self.nbytes}:{self.device}".encode()


@dataclass
class FakeSession:
    """A session between one local and one remote memory region; records its reads."""

    index: int
    local: Any = None
    remote: Any = None
    engine: FakeEngine | None = None
    reads: list[ReadCall] = field(default_factory=list)
    # Called for every read; returns the status handed back to vLLM.
    status_factory: Callable[[ReadCall], FakeStatus] = field(default=lambda _call: FakeStatus(SUCCEEDED))

    def batch_read(self, local_offsets: Any, remote_offsets: Any, sizes: Any, uid: int) -> FakeStatus:
        call = ReadCall(self.index, local_offsets, remote_offsets, sizes, uid)
        self.reads.append(call)
        if self.engine is not None:
            self.engine.reads.append(call)
        return self.status_factory(call)


class FakeEngine:
    """The ``mori.io.IOEngine`` calls made by vLLM's real ``MoRIIOWrapper``."""

    def __init__(self) -> None:
        self._uids = itertools.count(1)
        self.registered: list[FakeMemoryDesc] = []
        self.sessions: list[FakeSession] = []
        self.reads: list[ReadCall] = []

    def allocate_transfer_uid(self) -> int:
        return next(self._uids)

    def register_torch_tensor(self, tensor: Any) -> FakeMemoryDesc:
        nbytes = int(tensor.numel()) * int(tensor.element_size())
        desc = FakeMemoryDesc(int(tensor.data_ptr()), nbytes, str(tensor.device))
        self.registered.append(desc)
        return desc

    def create_session(self, local: Any, remote: Any) -> FakeSession:
        session = FakeSession(len(self.sessions), local, remote, engine=self)
        self.sessions.append(session)
        return session


def real_wrapper_class() -> Any:
    """vLLM's own ``MoRIIOWrapper`` (imports vLLM)."""
    import importlib

    return importlib.import_module(WRAPPER_MODULE).MoRIIOWrapper


class FakeWrapper:
    """Stand-in for ``MoRIIOWrapper`` on a worker built with ``__new__``.

    ``lock`` is a real lock, ``poll_transfer_batch`` is vLLM's real method (looked up
    at call time, so it is whatever the installed vLLM ships), and ``send_notify``
    records a :class:`Notify` instead of opening a ZMQ socket. ``notify_error`` makes
    the next notifies raise (like a socket failure) to exercise error paths.
    """

    def __init__(self, engine: FakeEngine | None = None) -> None:
        self.lock = threading.Lock()
        self.moriio_engine = engine or FakeEngine()
        self.sent: list[Notify] = []
        self.notify_error: BaseException | None = None
        self.shut_down = False

    def poll_transfer_batch(self, transfer_statuses: list[Any]) -> Any:
        return real_wrapper_class().poll_transfer_batch(self, transfer_statuses)

    def send_notify(
        self,
        req_ids: Any,
        remote_ip: str,
        remote_port: Any,
        message_type: str | None = None,
        message_fields: dict[str, Any] | None = None,
    ) -> None:
        if self.notify_error is not None:
            raise self.notify_error
        ids = req_ids if isinstance(req_ids, list) else [req_ids]
        for req_id in ids:
            fields = dict(message_fields) if message_fields is not None else None
            self.sent.append(Notify(req_id, remote_ip, remote_port, message_type, fields))

    def shutdown(self) -> None:
        """Called by ``MoRIIOConnectorWorker.__del__``; nothing to close."""
        self.shut_down = True

    def releases(self) -> list[tuple[Any, Any]]:
        """(transfer_id, port) of every ``release`` sent so far."""
        return [(n.transfer_id, n.port) for n in self.sent if n.message_type == "release"]
