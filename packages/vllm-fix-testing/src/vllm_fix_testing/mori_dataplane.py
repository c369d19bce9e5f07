"""MORI's data plane on one host: ``mori.io`` for a real disaggregated pair of vLLM engines on CPU.

What vLLM's MoRIIO asks of ``mori.io`` (vLLM 0.32.0, ``moriio_engine.MoRIIOWrapper`` and
``moriio_connector.MoRIIOConnectorWorker``), and how this stands in for it:

* ``IOEngine(key, IOEngineConfig(host, port))``; ``create_backend(RDMA, RdmaBackendConfig(...))``
  binds the control-plane listener exactly as MORI's ``TCPContext::Listen`` does
  (:func:`vllm_fix_testing.mori_io.mori_listen`; port 0 auto-binds and the descriptor reports
  the bound port, as every MORI tag since v0.1.0);
* the data plane is one-sided, as RDMA is: a READ or WRITE copies straight between the
  initiator's registered region and the peer process's (``process_vm_readv`` /
  ``process_vm_writev``, the peer's pid travelling in its engine descriptor), on the posting
  thread, so no thread of the peer takes part and a busy or idle peer cannot delay it. Where
  the kernel refuses cross-process access (ptrace restrictions), a thread per engine behind
  the listener plays the NIC instead and serves the transfer over a socket;
* ``get_engine_desc()`` / ``EngineDesc.unpack`` / ``register_remote_engine``: msgpack-packed
  descriptors (key, host, port, pid) exchanged by vLLM's own handshake;
* ``register_torch_tensor(tensor)`` -> ``MemoryDesc`` (``.data`` the address, ``.size`` the
  extent; msgpack ``pack``/``unpack``); a non-contiguous tensor is refused, as MORI refuses it;
* ``create_session(local, remote)`` -> a session with ``batch_read`` / ``batch_write``
  (offset and size lists) and ``read`` / ``write`` (one range); each returns a
  :class:`TransferStatus`: ``Succeeded`` once the bytes are in the destination region (at
  once on the one-sided path, as vLLM notes MORI's executor marks the status on the calling
  thread), or ``Failed`` (``Message``, ``Code``) when a range falls outside a registered
  region, the region or peer is unknown or unreachable: a real RDMA NIC reports a
  remote-access error there, it never reads past a memory region;
* ``allocate_transfer_uid()``.

vLLM configures MORI with ``enable_notification=False`` and signals completion over its own
ZMQ sockets, so the transfer status is the only completion MORI delivers: it turns
``Succeeded`` only after the data is in the destination region.

Two GPU calls remain on MoRIIO's WRITE path: ``torch.cuda.current_stream()`` and
``torch.cuda.Event()`` (the producer waits for a layer's compute before posting its write).
On a CPU torch both raise; :func:`stand_in_cuda_calls` supplies a stream and an event whose
``record`` / ``synchronize`` return at once (a CPU forward has written the layer's KV before
``save_kv_layer`` runs), as vLLM's own CPU model runner stands in ``torch.Event`` and
``torch.cuda.Stream``.

:func:`write_mori_package` writes an importable ``mori`` package (``mori/__init__.py`` with
``__version__``, ``mori/io.py`` re-exporting this module's names) into a folder; put that folder
on the ``PYTHONPATH`` of the engine processes and vLLM's ``from mori.io import ...`` finds it.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import json
import os
import queue
import socket
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import msgpack

from vllm_fix_testing.mori_io import AUTO_BIND_SINCE, RDMA, XGMI, mori_listen

# MORI's StatusCode values that vLLM can see (mori/io/common.hpp).
SUCCESS = 0
INIT = 1
IN_PROGRESS = 2
ERR_INVALID_ARGS = 3
ERR_NOT_FOUND = 4
ERR_RDMA_OP = 5
_HEADER = struct.Struct("!I")
TRANSFER_LOG = "MORI_STANDIN_LOG"


class TransferStatus:
    """MORI's ``TransferStatus``: in progress until the executor completes or fails it."""

    def __init__(self) -> None:
        self._code = IN_PROGRESS
        self._message = ""
        self._done = threading.Event()

    def Succeeded(self) -> bool:
        return self._code == SUCCESS

    def Failed(self) -> bool:
        return self._code > IN_PROGRESS

    def InProgress(self) -> bool:
        return self._code in (INIT, IN_PROGRESS)

    def Code(self) -> int:
        return self._code

    def Message(self) -> str:
        return self._message

    def Wait(self) -> None:
        self._done.wait()

    def finish(self, code: int = SUCCESS, message: str = "") -> None:
        self._code, self._message = code, message
        self._done.set()

    def __repr__(self) -> str:
        return f"TransferStatus(code={self._code}, message={self._message!r})"


@dataclass(frozen=True)
class EngineDesc:
    key: str
    host: str
    port: int
    pid: int = 0  # the process whose memory the engine's regions are (the one-sided path's target)

    def pack(self) -> bytes:
        return bytes(msgpack.dumps([self.key, self.host, self.port, self.pid]))

    @staticmethod
    def unpack(data: bytes) -> EngineDesc:
        key, host, port, pid = msgpack.loads(data)
        return EngineDesc(str(key), str(host), int(port), int(pid))


@dataclass(frozen=True)
class MemoryDesc:
    engine_key: str
    id: int
    device_id: int
    data: int
    size: int
    loc: str

    def pack(self) -> bytes:
        fields = [self.engine_key, self.id, self.device_id, self.data, self.size, self.loc]
        return bytes(msgpack.dumps(fields))

    @staticmethod
    def unpack(data: bytes) -> MemoryDesc:
        key, mem_id, device, address, size, loc = msgpack.loads(data)
        return MemoryDesc(str(key), int(mem_id), int(device), int(address), int(size), str(loc))


@dataclass(frozen=True)
class IOEngineConfig:
    host: str
    port: int


class BackendType:
    RDMA = RDMA
    XGMI = XGMI


class PollCqMode:
    POLLING = "polling"
    EVENT = "event"


def RdmaBackendConfig(*args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (args, kwargs)


def XgmiBackendConfig(*args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (args, kwargs)


class TransferError(Exception):
    """A transfer the NIC would reject (the status carries code and message)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def _ranges(offsets: Any, sizes: Any) -> list[tuple[int, int]]:
    if isinstance(offsets, (int, float)):
        return [(int(offsets), int(sizes))]
    offs, lens = [int(o) for o in offsets], [int(s) for s in sizes]
    if len(offs) != len(lens):
        raise TransferError(ERR_INVALID_ARGS, f"{len(offs)} offsets for {len(lens)} sizes")
    return list(zip(offs, lens, strict=True))


def _check_extent(region: MemoryDesc, ranges: Sequence[tuple[int, int]]) -> None:
    for offset, size in ranges:
        if offset < 0 or size < 0 or offset + size > region.size:
            raise TransferError(
                ERR_RDMA_OP,
                f"remote access error: [{offset}, {offset + size}) outside memory region "
                f"{region.id} of {region.size} bytes",
            )


def _send(sock: socket.socket, header: dict[str, Any], payload: bytes = b"") -> None:
    blob = msgpack.dumps(header)
    sock.sendall(_HEADER.pack(len(blob)) + blob + payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise ConnectionError("peer closed the data channel")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _recv(sock: socket.socket) -> dict[str, Any]:
    (length,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    header = msgpack.loads(_recv_exact(sock, length))
    assert isinstance(header, dict)
    return header


class _Refused(Exception):
    """The kernel does not let this process reach the peer's memory (ptrace restrictions)."""


class _IOVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_IOV_MAX = 1024
_LIBC = ctypes.CDLL(None, use_errno=True)
for _name in ("process_vm_readv", "process_vm_writev"):
    _fn = getattr(_LIBC, _name)
    _fn.restype = ctypes.c_ssize_t
    _fn.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(_IOVec),
        ctypes.c_ulong,
        ctypes.POINTER(_IOVec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]


def _iovecs(ranges: Sequence[tuple[int, int]]) -> Any:
    return (_IOVec * len(ranges))(*(_IOVec(address, size) for address, size in ranges))


class IOEngine:
    """``mori.io.IOEngine`` on one host: control-plane listener, registered regions, a data channel.

    ``one_sided`` (class-wide): transfers go straight between the two processes' memory
    (process_vm_readv/writev, no thread of the target involved, as with RDMA); where the kernel
    refuses that, the listener's NIC threads serve them over a socket instead.
    """

    instances: ClassVar[list[IOEngine]] = []
    one_sided: ClassVar[bool] = True

    def __init__(self, key: str, config: IOEngineConfig) -> None:
        self.key = key
        self.config = config
        self.listener: socket.socket | None = None
        self._regions: dict[int, MemoryDesc] = {}
        self._remotes: dict[str, EngineDesc] = {}
        self._channels: dict[str, socket.socket] = {}
        self._ids = itertools.count(1)
        self._uids = itertools.count(1)
        self._lock = threading.Lock()
        self._posted: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self.transfers = 0
        self.bytes_moved = 0
        IOEngine.instances.append(self)

    # -- backend and descriptors
    def create_backend(self, backend_type: Any, backend_config: Any = None) -> None:
        if str(getattr(backend_type, "value", backend_type)).lower() != RDMA:
            return
        self.listener = mori_listen(self.config.host, self.config.port)
        for target, name in ((self._serve, "mori-nic"), (self._execute, "mori-executor")):
            threading.Thread(target=target, daemon=True, name=f"{name}-{self.key}").start()

    def get_engine_desc(self) -> EngineDesc:
        port = self.listener.getsockname()[1] if self.listener is not None else self.config.port
        return EngineDesc(self.key, self.config.host, int(port), os.getpid())

    def register_remote_engine(self, desc: EngineDesc) -> None:
        with self._lock:
            self._remotes[desc.key] = desc

    def register_torch_tensor(self, tensor: Any) -> MemoryDesc:
        if not tensor.is_contiguous():
            raise ValueError("register_torch_tensor: tensor must be contiguous")
        size = int(tensor.numel()) * int(tensor.element_size())
        device = tensor.device.index if tensor.device.index is not None else -1
        desc = MemoryDesc(self.key, next(self._ids), device, int(tensor.data_ptr()), size, str(tensor.device))
        with self._lock:
            self._regions[desc.id] = desc
        return desc

    def deregister_memory(self, desc: MemoryDesc) -> None:
        with self._lock:
            self._regions.pop(desc.id, None)

    def allocate_transfer_uid(self) -> int:
        return next(self._uids)

    def create_session(self, local: MemoryDesc, remote: MemoryDesc) -> IOEngineSession:
        return IOEngineSession(self, local, remote)

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None

    # -- the initiator side (what posting a work request and polling the CQ do)
    def post(
        self,
        op: str,
        local: MemoryDesc,
        remote: MemoryDesc,
        local_offsets: Any,
        remote_offsets: Any,
        sizes: Any,
    ) -> TransferStatus:
        status = TransferStatus()
        if IOEngine.one_sided:
            try:
                self._transfer_one_sided(
                    op, local, remote, _ranges(local_offsets, sizes), _ranges(remote_offsets, sizes)
                )
            except TransferError as exc:
                status.finish(exc.code, str(exc))
            except _Refused:
                IOEngine.one_sided = False  # e.g. ptrace restricted: the NIC threads serve instead
            else:
                status.finish(SUCCESS)
                return status
            if status.Failed():
                return status
        self._posted.put((op, local, remote, local_offsets, remote_offsets, sizes, status))
        return status

    def _transfer_one_sided(
        self,
        op: str,
        local: MemoryDesc,
        remote: MemoryDesc,
        here: list[tuple[int, int]],
        there: list[tuple[int, int]],
    ) -> None:
        """process_vm_readv/writev against the peer process's registered region: no CPU of the
        target takes part, as with RDMA; the status is final when this returns."""
        with self._lock:
            if local.id not in self._regions:
                raise TransferError(ERR_NOT_FOUND, f"local memory region {local.id} is not registered")
            peer = self._remotes.get(remote.engine_key)
        if peer is None:
            raise TransferError(ERR_NOT_FOUND, f"remote engine {remote.engine_key!r} is not registered")
        _check_extent(local, here)
        _check_extent(remote, there)
        write = op == "write"
        for start in range(0, len(here), _IOV_MAX):
            chunk_here, chunk_there = here[start : start + _IOV_MAX], there[start : start + _IOV_MAX]
            local_iov = _iovecs([(local.data + off, size) for off, size in chunk_here])
            remote_iov = _iovecs([(remote.data + off, size) for off, size in chunk_there])
            call = _LIBC.process_vm_writev if write else _LIBC.process_vm_readv
            want = sum(size for _, size in chunk_here)
            done = call(peer.pid, local_iov, len(chunk_here), remote_iov, len(chunk_there), 0)
            if done < 0:
                err = ctypes.get_errno()
                if err in (errno.EPERM, errno.ENOSYS) and start == 0:
                    raise _Refused(os.strerror(err))
                raise TransferError(ERR_RDMA_OP, f"remote access error: {os.strerror(err)}")
            if done != want:
                raise TransferError(ERR_RDMA_OP, f"remote access error: {done} of {want} bytes moved")
        self.transfers += 1
        nbytes = sum(size for _, size in here)
        self.bytes_moved += nbytes
        self._record(op, nbytes)

    def _execute(self) -> None:
        while True:
            op, local, remote, local_offsets, remote_offsets, sizes, status = self._posted.get()
            try:
                self._transfer(
                    op, local, remote, _ranges(local_offsets, sizes), _ranges(remote_offsets, sizes)
                )
            except TransferError as exc:
                status.finish(exc.code, str(exc))
            except (OSError, ConnectionError, KeyError) as exc:
                status.finish(ERR_RDMA_OP, f"{type(exc).__name__}: {exc}")
            else:
                status.finish(SUCCESS)

    def _transfer(
        self,
        op: str,
        local: MemoryDesc,
        remote: MemoryDesc,
        here: list[tuple[int, int]],
        there: list[tuple[int, int]],
    ) -> None:
        with self._lock:
            if local.id not in self._regions:
                raise TransferError(ERR_NOT_FOUND, f"local memory region {local.id} is not registered")
        _check_extent(local, here)
        header = {"op": op, "mem": remote.id, "ranges": there}
        channel = self._channel(remote.engine_key)
        if op == "write":
            payload = b"".join(ctypes.string_at(local.data + off, size) for off, size in here)
            _send(channel, {**header, "nbytes": len(payload)}, payload)
            reply = _recv(channel)
        else:
            _send(channel, header)
            reply = _recv(channel)
            if reply.get("ok"):
                data = _recv_exact(channel, int(reply["nbytes"]))
                at = 0
                for off, size in here:
                    ctypes.memmove(local.data + off, data[at : at + size], size)
                    at += size
        if not reply.get("ok"):
            raise TransferError(int(reply.get("code", ERR_RDMA_OP)), str(reply.get("message", "")))
        self.transfers += 1
        self.bytes_moved += sum(size for _, size in here)
        self._record(op, sum(size for _, size in here))

    def _record(self, op: str, nbytes: int) -> None:
        """One JSON line per completed transfer to ``$MORI_STANDIN_LOG`` (tests read it)."""
        path = os.environ.get(TRANSFER_LOG)
        if path:
            with open(path, "a") as f:
                f.write(
                    json.dumps(
                        {
                            "pid": os.getpid(),
                            "engine": self.key,
                            "op": op,
                            "bytes": nbytes,
                            "one_sided": IOEngine.one_sided,
                            "t": time.time(),
                        }
                    )
                    + "\n"
                )

    def _channel(self, engine_key: str) -> socket.socket:
        sock = self._channels.get(engine_key)
        if sock is None:
            with self._lock:
                remote = self._remotes.get(engine_key)
            if remote is None:
                raise TransferError(ERR_NOT_FOUND, f"remote engine {engine_key!r} is not registered")
            sock = socket.create_connection((remote.host, remote.port), timeout=30)
            self._channels[engine_key] = sock
        return sock

    # -- the target side (what the NIC does for a one-sided READ/WRITE)
    def _serve(self) -> None:
        listener = self.listener
        while listener is not None:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve_peer, args=(conn,), daemon=True).start()

    def _serve_peer(self, conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    header = _recv(conn)
                except (ConnectionError, OSError):
                    return
                payload = _recv_exact(conn, int(header["nbytes"])) if header["op"] == "write" else b""
                try:
                    self._apply(conn, header, payload)
                except TransferError as exc:
                    _send(conn, {"ok": False, "code": exc.code, "message": str(exc)})

    def _apply(self, conn: socket.socket, header: dict[str, Any], payload: bytes) -> None:
        with self._lock:
            region = self._regions.get(int(header["mem"]))
        if region is None:
            raise TransferError(ERR_NOT_FOUND, f"memory region {header['mem']} is not registered")
        ranges = [(int(off), int(size)) for off, size in header["ranges"]]
        _check_extent(region, ranges)
        if header["op"] == "write":
            at = 0
            for off, size in ranges:
                ctypes.memmove(region.data + off, payload[at : at + size], size)
                at += size
            _send(conn, {"ok": True})
            return
        data = b"".join(ctypes.string_at(region.data + off, size) for off, size in ranges)
        _send(conn, {"ok": True, "nbytes": len(data)}, data)


class IOEngineSession:
    """``IOEngine.Session``: one local and one remote memory region."""

    def __init__(self, engine: IOEngine, local: MemoryDesc, remote: MemoryDesc) -> None:
        self.engine, self.local, self.remote = engine, local, remote

    def batch_read(self, local_offsets: Any, remote_offsets: Any, sizes: Any, uid: int) -> TransferStatus:
        return self.engine.post("read", self.local, self.remote, local_offsets, remote_offsets, sizes)

    def batch_write(self, local_offsets: Any, remote_offsets: Any, sizes: Any, uid: int) -> TransferStatus:
        return self.engine.post("write", self.local, self.remote, local_offsets, remote_offsets, sizes)

    def read(self, local_offset: int, remote_offset: int, size: int, uid: int) -> TransferStatus:
        return self.batch_read(local_offset, remote_offset, size, uid)

    def write(self, local_offset: int, remote_offset: int, size: int, uid: int) -> TransferStatus:
        return self.batch_write(local_offset, remote_offset, size, uid)


IOEngine.Session = IOEngineSession  # type: ignore[attr-defined]


class _CpuStream:
    device = "cpu"

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None


class _CpuEvent:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.recorded = False

    def record(self, stream: Any = None) -> None:
        self.recorded = True

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


def stand_in_cuda_calls() -> bool:
    """``torch.cuda.current_stream`` / ``torch.cuda.Event`` for a CPU torch; False if CUDA is there."""
    import torch

    if torch.cuda.is_available():
        return False
    torch.cuda.current_stream = lambda device=None: _CpuStream()  # type: ignore[assignment]
    torch.cuda.Event = _CpuEvent  # type: ignore[assignment,misc]
    return True


NAMES = (
    "IOEngine",
    "IOEngineConfig",
    "IOEngineSession",
    "BackendType",
    "EngineDesc",
    "MemoryDesc",
    "PollCqMode",
    "RdmaBackendConfig",
    "XgmiBackendConfig",
    "TransferStatus",
)


def write_mori_package(folder: Path, version: str = AUTO_BIND_SINCE) -> Path:
    """Write an importable ``mori`` package (this data plane as ``mori.io``) into ``folder``."""
    package = folder / "mori"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(
        '"""MORI stood in for CPU (vllm_fix_testing.mori_dataplane); written by the tests."""\n'
        "from vllm_fix_testing.mori_dataplane import stand_in_cuda_calls\n\n"
        f"__version__ = {version!r}\n"
        "stand_in_cuda_calls()\n"
    )
    (package / "io.py").write_text(
        "from vllm_fix_testing.mori_dataplane import (  # noqa: F401\n"
        + "".join(f"    {name},\n" for name in NAMES)
        + ")\n"
    )
    return folder
