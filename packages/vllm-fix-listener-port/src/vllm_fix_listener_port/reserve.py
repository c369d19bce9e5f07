"""Fallback for a port Python must choose before a native bind that cannot be retried.

Used where the installed MORI cannot report a port-0 listener's port (mori_support):
the RDMA config then carries a port held by this process from the moment it is
chosen until MORI's listener is up. Where a number must be
known before a native listener binds it (a native ``bind`` that ``exit()``s on
``EADDRINUSE``, a base port a peer derives), hold a *kernel* reservation from the
moment the number is chosen until the native listener is in LISTEN:

1. bind a TCP socket **without** ``SO_REUSEADDR`` (exclusive: fails if anyone
   holds the port, and no other exclusive binder, probe or ``bind(0)`` can get it);
2. **then** switch ``SO_REUSEADDR`` on, so the native listener (MORI sets
   ``SO_REUSEADDR`` before its ``bind``) can bind the same port while the
   reservation, which never listens, is still held;
3. close it once the native listener is listening, and on every error path.

The trap: ``SO_REUSEADDR`` set *before* the reservation's bind lets a second
reserver doing the same bind the same port (two non-listening sockets that both
allow reuse do not conflict on Linux). Never do that.

Usage::

    with reserve_port(host) as reservation:
        start_native_listener(reservation.port)   # binds with SO_REUSEADDR
    # released here (also if the listener start raised)
"""

from __future__ import annotations

import errno
import os
import socket
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class Reservation:
    """A port held by a bound, non-listening socket with SO_REUSEADDR switched on."""

    host: str
    port: int
    sock: socket.socket

    @property
    def held(self) -> bool:
        return self.sock.fileno() != -1

    def release(self) -> None:
        self.sock.close()


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def hold(host: str = "", port: int = 0) -> Reservation:
    """Reserve (host, port) exclusively; port 0 lets the kernel choose. Raises OSError (EADDRINUSE)."""
    if not 0 <= port <= 65535:
        raise ValueError(f"port out of range: {port}")
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        # Exclusive: no SO_REUSEADDR at bind time (see the trap above).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
        sock.bind((host, port))
        # Only now let the intended (SO_REUSEADDR) listener share it.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        return Reservation(host, sock.getsockname()[1], sock)
    except BaseException:
        sock.close()
        raise


def hold_scanning(host: str, start: int, attempts: int = 1000) -> Reservation:
    """Reserve the first free port from ``start`` upward (VLLM_PORT-style scanning, but held)."""
    if attempts < 1:
        raise ValueError("attempts must be >= 1")
    # Only the last error's text is kept: keeping the exception would keep its traceback's
    # frames, and with them the caller's locals (a config whose hold must end with it).
    last = ""
    for port in range(start, min(start + attempts, 65536)):
        try:
            return hold(host, port)
        except OSError as exc:
            if exc.errno not in (errno.EADDRINUSE, errno.EACCES):
                raise
            last = str(exc)
    raise OSError(
        errno.EADDRINUSE, f"no free port in {start}..{start + attempts - 1} on {host or '*'} ({last})"
    )


def hold_for_listener(host: str) -> Reservation:
    """A held port for a native listener on ``host``.

    With ``VLLM_PORT`` set, the first free port from it upward (as vLLM scans, but held);
    otherwise a kernel-chosen one. Held on the wildcard address of ``host``'s family, so
    no probe on any address (vLLM's ``get_open_port`` binds the wildcard) can take it.
    """
    wildcard = "::" if ":" in host else ""
    start = os.environ.get("VLLM_PORT")
    if start is not None and start.strip():
        try:
            first = int(start)
        except ValueError as exc:
            raise ValueError(f"VLLM_PORT={start!r} is not a port number") from exc
        return hold_scanning(wildcard, first)
    return hold(wildcard, 0)


_HELD: dict[int, Reservation] = {}
_HELD_LOCK = threading.Lock()


def keep_until_released(owner: object, reservation: Reservation) -> None:
    """Hold ``reservation`` until :func:`release_for` ``(owner)`` or until ``owner`` is collected."""
    key = id(owner)
    with _HELD_LOCK:
        previous = _HELD.pop(key, None)
        _HELD[key] = reservation
    if previous is not None:
        previous.release()
    weakref.finalize(owner, _release_key, key, reservation)


def _release_key(key: int, reservation: Reservation | None = None) -> None:
    with _HELD_LOCK:
        held = _HELD.get(key)
        if held is not None and (reservation is None or held is reservation):
            del _HELD[key]
        else:
            held = None
    if held is not None:
        held.release()


def release_for(owner: object) -> None:
    """Release the reservation kept for ``owner`` (no-op when there is none)."""
    _release_key(id(owner))


def held_ports() -> list[int]:
    with _HELD_LOCK:
        return sorted(r.port for r in _HELD.values())


@contextmanager
def reserve_port(host: str = "", port: int = 0, *, scan: int | None = None) -> Iterator[Reservation]:
    """Hold a port until the block ends (normally or by an exception).

    ``port=0``: the kernel chooses; ``scan=N``: first free port in ``port .. port+N-1``.
    """
    reservation = hold_scanning(host, port, scan) if scan is not None else hold(host, port)
    try:
        yield reservation
    finally:
        reservation.release()
