"""Does this vLLM leave a MoRIIO listener's bind failure unseen by the thread that waits for it?

Holds one loopback TCP port (bound on all interfaces, listening, so a ZMQ bind to it fails
with "Address already in use") and points vLLM's own listeners at it, as installed:

* the handshake listener (``MoRIIOConnectorWorker._moriio_handshake_listener``, run in a
  thread as vLLM runs it): vLLM's behaviour is that the thread dies before it sets its
  ready event, so ``register_kv_caches`` would wait forever (affected); with the failure
  surfaced, the ready event is set and the failure is on record;
* the notify listener (``MoRIIOWrapper.async_wait_reqid`` on a wrapper that has only the
  notify port): vLLM's behaviour is that it returns while its listener thread dies
  (affected); surfaced, it raises.

The dying listener's traceback (vLLM's default thread excepthook) is kept out of the log
for the probe's own threads only. About 10-30 ms (two ZMQ contexts, two threads).
"""

from __future__ import annotations

import importlib
import inspect
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from vllm_fix_core import Check, ProbeReport

PACKAGE = "vllm.distributed.kv_transfer.kv_connector.v1.moriio"
JOIN_S = 5.0

_hook_lock = threading.Lock()


@contextmanager
def _held_port() -> Iterator[int]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("0.0.0.0", 0))
        sock.listen(1)
        yield int(sock.getsockname()[1])
    finally:
        sock.close()


@contextmanager
def _quiet(name: str) -> Iterator[None]:
    """Uncaught exceptions of threads named `name` started in this block are not printed."""
    with _hook_lock:
        previous = threading.excepthook
        before = set(threading.enumerate())

        def hook(args: Any) -> None:
            if args.thread is None or args.thread in before or args.thread.name != name:
                previous(args)

        threading.excepthook = hook
        try:
            yield
        finally:
            threading.excepthook = previous


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

    thread = threading.Thread(target=run, daemon=True, name="vllm-fix-bind-failure-probe")
    thread.start()
    thread.join(JOIN_S)
    if thread.is_alive():
        raise RuntimeError(f"the handshake listener bound port {port}, which the probe holds")
    if ready.is_set():
        return False, ""
    cause = repr(error[0]) if error else "no error"
    return True, f"the handshake listener on a taken port ended ({cause}) without setting its ready event"


def _notify_listener(engine: Any, port: int) -> tuple[bool, str]:
    wrapper = engine.MoRIIOWrapper.__new__(engine.MoRIIOWrapper)
    wrapper.notify_port = port
    wrapper.notify_thread = None
    with _quiet("moriio-notify-listener"):
        try:
            wrapper.async_wait_reqid()
        except Exception:
            return False, ""  # surfaced to the caller
        thread = wrapper.notify_thread
        if not isinstance(thread, threading.Thread):
            raise RuntimeError("async_wait_reqid started no notify listener")
        thread.join(JOIN_S)
    if thread.is_alive():
        raise RuntimeError(f"the notify listener bound port {port}, which the probe holds")
    return True, "async_wait_reqid returned while its notify listener died on a taken port"


def probe() -> ProbeReport:
    connector = importlib.import_module(f"{PACKAGE}.moriio_connector")
    engine = importlib.import_module(f"{PACKAGE}.moriio_engine")
    with _held_port() as port:
        handshake = _handshake_listener(connector, port)
        notify = _notify_listener(engine, port)
    return ProbeReport(
        (
            Check("handshake-bind-failure-unseen", handshake[0], handshake[1]),
            Check("notify-bind-failure-unseen", notify[0], notify[1]),
        )
    )
