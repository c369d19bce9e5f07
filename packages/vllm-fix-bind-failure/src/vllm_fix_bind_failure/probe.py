"""Does this vLLM leave a MoRIIO listener's bind failure unseen by the thread that waits for it?

Holds loopback TCP ports (bound on all interfaces, listening, so a ZMQ bind to one fails
with "Address already in use") and points vLLM's own listeners at them, as installed:

* start-up (``MoRIIOConnectorWorker.register_kv_caches``, run in a thread as the worker
  runs it, on a worker built by vLLM's own ``__init__`` with MORI stood in: probe_worker)
  with its handshake listener on a held port and its notify listener on another: vLLM's
  behaviour is that the handshake listener thread dies before it sets its ready event and
  ``register_kv_caches`` waits on that event forever (affected). The specification's
  answer: ``register_kv_caches`` raises an error that names the handshake port and the
  ``handshake_port`` setting, and starts no notify listener. The wait is seen, not timed:
  once the listener thread is dead, the ``ready_event`` that ``register_kv_caches`` waits
  on is read from its frame; if unset it is set by the probe, so the start-up thread ends
  (its notify listener then dies on the other held port) and nothing is left behind;
* the notify listener (``MoRIIOWrapper.async_wait_reqid`` on a wrapper that has only the
  notify port): vLLM's behaviour is that it returns while its listener thread dies
  (affected). The specification's answer: it raises an error naming the port and the
  bind's own cause (``Address already in use``), which only the socket that failed to
  bind (vLLM's ``zmq_ctx`` ROUTER context) knows.

It is a guest (vllm_fix_core.moriio_probe): it binds only ports the kernel picks (the two it
holds; the worker's config gets kernel-chosen ports for ``get_open_port``, never
``VLLM_PORT``, and its MORI stand-in listens on port 0), and every thread it or vLLM's code
starts for it is a ``GuestThread``: quiet from its first line ("Node starting to listen
notify ..."), its dying exception kept on the thread (``threading.excepthook`` is not
touched, so another thread's exception is reported as before), and waited for before the
probe returns. About 30-60 ms (one worker, three ZMQ contexts, four threads).
"""

from __future__ import annotations

import errno
import importlib
import inspect
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from vllm_fix_bind_failure.probe_worker import kv_caches, probe_worker
from vllm_fix_core import Check, ProbeReport
from vllm_fix_core.moriio_probe import GuestThread, bound, guest_threads

PACKAGE = "vllm.distributed.kv_transfer.kv_connector.v1.moriio"
JOIN_S = 5.0


@contextmanager
def _held_port() -> Iterator[int]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("0.0.0.0", 0))
        sock.listen(1)
        yield int(sock.getsockname()[1])
    finally:
        sock.close()


def _handshake_listener(connector: Any, port: int) -> tuple[bool, str]:
    listener = connector.MoRIIOConnectorWorker._moriio_handshake_listener
    ready = threading.Event()
    names = list(inspect.signature(listener).parameters)
    extra: dict[str, Any] = {name: 0 if name in ("tp_rank", "dp_rank") else {} for name in names[3:]}
    error: list[BaseException] = []

    def run() -> None:
        try:
            listener({}, ready, port, **extra)
        except BaseException as exc:  # vLLM's thread would die of it
            error.append(exc)

    thread = GuestThread(target=run, daemon=True, name="vllm-fix-bind-failure-probe")
    thread.start()
    thread.join(JOIN_S)
    if thread.is_alive():
        raise RuntimeError(f"the handshake listener bound port {port}, which the probe holds")
    if ready.is_set():
        return False, ""
    cause = repr(error[0]) if error else "no error"
    return True, f"the handshake listener on a taken port ended ({cause}) without setting its ready event"


def _names_cause(error: BaseException, port: int) -> bool:
    """The operator's error names the port and the bind's own cause (a table from the spec)."""
    text = str(error)
    return bool(re.search(rf"\b{port}\b", text)) and os.strerror(errno.EADDRINUSE) in text


def _async_wait_reqid(engine: Any, wrapper: Any) -> Any:
    """The installed ``MoRIIOWrapper.async_wait_reqid``, bound to `wrapper`, its notify
    listener a GuestThread (vllm_fix_core.moriio_probe.bound)."""
    return bound(engine.MoRIIOWrapper, "async_wait_reqid", wrapper)


def _notify_listener(engine: Any, port: int) -> tuple[bool, str]:
    wrapper = engine.MoRIIOWrapper.__new__(engine.MoRIIOWrapper)
    wrapper.notify_port = port
    wrapper.notify_thread = None
    try:
        _async_wait_reqid(engine, wrapper)()
    except Exception as exc:
        thread = wrapper.notify_thread
        if isinstance(thread, threading.Thread):
            thread.join(JOIN_S)
        if _names_cause(exc, port):
            return False, ""  # surfaced to the caller, with the bind's cause
        return True, f"async_wait_reqid raised without the bind's cause on port {port}: {exc}"
    thread = wrapper.notify_thread
    if not isinstance(thread, threading.Thread):
        raise RuntimeError("async_wait_reqid started no notify listener")
    thread.join(JOIN_S)
    if thread.is_alive():
        raise RuntimeError(f"the notify listener bound port {port}, which the probe holds")
    return True, "async_wait_reqid returned while its notify listener died on a taken port"


def _waiting_event(thread: threading.Thread) -> threading.Event | None:
    """The ``ready_event`` that vLLM's ``register_kv_caches`` in `thread` waits on, if any."""
    frame: FrameType | None = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        if frame.f_code.co_name == "register_kv_caches":
            event = frame.f_locals.get("ready_event")
            if isinstance(event, threading.Event):
                return event
        frame = frame.f_back
    return None


def _start_up(connector: Any, engine: Any, handshake: int, notify: int) -> tuple[bool, str]:
    """register_kv_caches with the handshake listener on a taken port (notify: another one)."""
    with probe_worker(connector, engine, handshake, notify) as worker:
        # What register_kv_caches / async_wait_reqid read: the held ports, whatever rank
        # offset (or port convention) this process's groups and fixes give the worker.
        worker.side_channel_port = handshake
        wrapper = worker.moriio_wrapper
        wrapper.notify_port = notify
        # register_kv_caches reaches it as self.moriio_wrapper.async_wait_reqid: on the probe's
        # own wrapper, the installed one whose notify listener is a GuestThread.
        wrapper.async_wait_reqid = _async_wait_reqid(engine, wrapper)
        register_kv_caches = bound(connector.MoRIIOConnectorWorker, "register_kv_caches", worker)
        caches = kv_caches()
        error: list[BaseException] = []

        def run() -> None:
            try:
                register_kv_caches(caches)
            except BaseException as exc:
                error.append(exc)

        starter = GuestThread(target=run, daemon=True, name="vllm-fix-bind-failure-probe-start-up")
        starter.start()
        hung = False
        deadline = time.monotonic() + JOIN_S
        while starter.is_alive() and time.monotonic() < deadline:
            listener = getattr(worker, "_moriio_handshake_listener_t", None)
            if (
                isinstance(listener, threading.Thread)
                and listener.ident is not None
                and not listener.is_alive()
            ):
                event = _waiting_event(starter)
                if event is not None and not event.is_set():
                    hung = True  # vLLM waits on it with no timeout: forever
                    event.set()  # release the start-up thread (the probe's own)
                starter.join(JOIN_S)
                break
            time.sleep(0.001)
        starter.join(JOIN_S)
        notify_thread = getattr(worker.moriio_wrapper, "notify_thread", None)
        if isinstance(notify_thread, threading.Thread):
            notify_thread.join(JOIN_S)
        if starter.is_alive():
            raise RuntimeError("register_kv_caches neither returned nor waited on its listener")
        if hung:
            return True, (
                f"register_kv_caches waited forever on its handshake listener's ready event: "
                f"the listener died on taken port {handshake}"
            )
        if not error:
            return True, f"register_kv_caches returned with its handshake listener dead on port {handshake}"
        text = str(error[0])
        if not (re.search(rf"\b{handshake}\b", text) and "handshake_port" in text):
            return True, f"register_kv_caches raised, not naming handshake port {handshake}: {error[0]!r}"
        if isinstance(notify_thread, threading.Thread):
            return True, "register_kv_caches started the notify listener after the handshake listener failed"
        return False, ""


def probe() -> ProbeReport:
    connector = importlib.import_module(f"{PACKAGE}.moriio_connector")
    engine = importlib.import_module(f"{PACKAGE}.moriio_engine")
    with _held_port() as port, _held_port() as other, guest_threads(JOIN_S):
        handshake = _handshake_listener(connector, port)
        start_up = _start_up(connector, engine, port, other)
        notify = _notify_listener(engine, port)
    return ProbeReport(
        (
            Check("handshake-bind-failure-unseen", handshake[0], handshake[1]),
            Check("start-up-waits-on-dead-handshake-listener", start_up[0], start_up[1]),
            Check("notify-bind-failure-unseen", notify[0], notify[1]),
        )
    )
