"""Is the kv port MORI will bind chosen by a probe that is released before the native bind?

Calls the installed ``MoRIIOConfig.from_vllm_config`` (vLLM's body with whatever is layered
on it: this fix, another fix, anything) twice, as two ranks on one host do before either
has started MORI's listener, with vLLM's own ``KVTransferConfig`` and ``ParallelConfig``.
Then it looks at the two ``local_kv_port`` values the way the host sees them:

* a non-zero port that no socket of this process holds right after the call is a released
  probe: nothing of ours holds it until MORI binds, so another rank, another process or an
  outgoing ``connect()`` can take it first (the bug);
* two ranks given one port (``VLLM_PORT`` scanning before any listener is up) collide;
* port 0 is right only with a MORI that reports the port it auto-bound (mori_support);
  with an older one every worker would fail at start-up.

The ports themselves come from whatever the installed wrappers do and, for vLLM's own
``get_open_port()`` calls, from the kernel: the probe calls the installed chain with vLLM's
function run on a private copy of its module's globals in which ``get_open_port`` binds port
0 and releases it, as vLLM's does without ``VLLM_PORT`` (vllm_fix_core.moriio_probe), so the
probe never binds ``VLLM_PORT`` and changes nothing another thread sees; the configs are
dropped at the end. ``from_vllm_config`` reads the tensor-parallel rank; where this process
has no TP group yet (the ``vllm-fixes`` command, a process before distributed init) a rank-0
of 1 stand-in is set for the two calls and removed afterwards (unless a real group was
installed meanwhile); a real group is used as it is.

Then it builds one worker with the installed ``MoRIIOConnectorWorker.__init__`` (vLLM's
body and whatever is layered on it), MORI stood in for the call (vllm_fix_core.moriio_probe: its listener
binds as MORI's does, on loopback, and reports the port it is bound to), and looks at what
the worker ends up with, as a peer and the host would see it:

* the worker's and its config's ``local_kv_port`` must be the port its listener is bound to
  (vLLM's own logs and the config report that number; 0 or a stale number is wrong);
* once ``__init__`` has returned, no other socket of this process may still hold that port
  (a hold meant to last until MORI's listener is up, left behind);
* a native bind that fails with ``EADDRINUSE`` (the port vLLM chose was taken before MORI
  bound it) is the bug itself.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from vllm_fix_core import Check, ProbeReport, moriio_probe
from vllm_fix_core.moriio_probe import probe_worker
from vllm_fix_listener_port.mori_support import installed_mori

HOST = moriio_probe.HOST
EXTRA_CONFIG: dict[str, Any] = moriio_probe.extra_config(6301, 61005, backend="rdma")
_TP_LOCK = threading.Lock()


def vllm_config(extra: dict[str, Any] | None = None) -> Any:
    """vLLM's own VllmConfig as from_vllm_config reads it (vllm_fix_core.moriio_probe)."""
    return moriio_probe.vllm_config(EXTRA_CONFIG if extra is None else extra)


@contextmanager
def tp_group() -> Iterator[None]:
    """This process's TP group, or a rank-0-of-1 stand-in for the duration (then none again,
    unless a real group was installed meanwhile: that one stays)."""
    with _TP_LOCK, moriio_probe.process_groups():
        yield


def ports_held_here() -> set[int]:
    """Local ports of this process's TCP sockets (bound, listening or connected).

    Read from the process's own descriptors (``/proc/self/fd``; ``/dev/fd`` elsewhere), each
    duplicated, asked for its address and closed again: who holds a port on the host at
    large is not the question (another rank may already have taken a released port, which is
    the bug), only whether this process still holds what it handed to MORI.
    """
    base = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
    held: set[int] = set()
    for name in os.listdir(base):
        try:
            fd = int(name)
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except (OSError, ValueError):
            continue
        try:
            if sock.type == socket.SOCK_STREAM and sock.family in (socket.AF_INET, socket.AF_INET6):
                held.add(int(sock.getsockname()[1]))
        except OSError:
            pass
        finally:
            sock.close()  # the duplicate only
    return held


def worker_config() -> Any:
    """What MoRIIOConnectorWorker.__init__ reads of a VllmConfig beyond from_vllm_config."""
    return moriio_probe.with_worker_configs(vllm_config(), dtype="bfloat16", head_size=128)


def _worker_port() -> tuple[bool, str]:
    """Build one worker through the installed __init__: is it on the port its listener bound?"""
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector, moriio_engine
    from vllm.v1.kv_cache_interface import KVCacheConfig

    no_cache = KVCacheConfig(num_blocks=1, kv_cache_tensors=[], kv_cache_groups=[])
    name = "vllm-fix-listener-port-probe"
    try:
        with probe_worker(moriio_connector, moriio_engine, worker_config(), no_cache, name) as worker:
            engine = worker.moriio_engine
            listener = engine.listener
            if listener is None:
                raise RuntimeError("the RDMA backend opened no listener")
            bound = int(listener.getsockname()[1])
            recorded = [int(worker.local_kv_port), int(worker.moriio_config.local_kv_port)]
            engine.close()  # MORI's listener gone: what still holds the port is ours
            still_held = bound in ports_held_here()
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        return True, f"MORI's listener could not bind the kv port vLLM chose: {exc}"
    if recorded != [bound, bound]:
        return True, f"worker / config local_kv_port {recorded}, its listener is bound to {bound}"
    if still_held:
        return True, f"kv port {bound} still held by another socket of this process after __init__"
    return False, ""


def _worker_port_twice() -> tuple[bool, str]:
    """The worker check, asked again once when it sees the bug: where vLLM has it, it shows on
    every worker; a single miss can be another process on the host taking a port in between
    (ranks of one node start together), and a probe that misreads that once must not take the
    fix away from that rank."""
    first = _worker_port()
    if not first[0]:
        return first
    second = _worker_port()
    return second if not second[0] else (True, f"{second[1]} (twice; first: {first[1]})")


def probe() -> ProbeReport:
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_common

    mori = installed_mori()
    with tp_group():
        configs = [moriio_probe.from_vllm_config(moriio_common, vllm_config()) for _ in range(2)]
        worker = _worker_port_twice()
    ports = [int(c.local_kv_port) for c in configs]
    here = ports_held_here()
    released = [p for p in ports if p != 0 and p not in here]
    shared = ports[0] == ports[1] != 0
    zero_unreported = 0 in ports and mori.present and not mori.auto_bind
    del configs  # a hold tied to a probe config ends with it (no cycles: refcounting frees it)
    detail = f"local_kv_port {ports}: held, or chosen by the native listener"
    if released:
        detail = f"local_kv_port {ports}: {released} not held by this process until MORI binds"
        if shared:
            detail += " (both ranks got the same port: all but one native bind fail)"
    return ProbeReport(
        (
            Check("kv-port-released-before-native-bind", bool(released), detail),
            Check("worker-kv-port-not-its-listeners", worker[0], worker[1]),
            # Guard: port 0 is only right where MORI reports the port it auto-bound.
            Check(
                "kv-port-0-reported-by-mori",
                zero_unreported,
                f"local_kv_port 0 with {mori.describe()}: every worker would publish port 0"
                if zero_unreported
                else "",
                guard=True,
            ),
        )
    )
