"""Shared helpers: the loopback port race (real processes, vLLM's real MoRIIOConnectorWorker.__init__).

Each rank is a process forked from the test process (which already imported vLLM). It
stands in for a TP worker on one host: the plugin loads (patched case: the fix goes
through the ladder like in a vLLM process), then vLLM's REAL
``MoRIIOConnectorWorker.__init__`` runs with MORI stood in (vllm_fix_testing.mori_io:
the engine binds exactly like MORI's ``TCPContext::Listen``). All ranks meet at a
Barrier right before the native bind (the stand-in's ``before_bind`` hook), as TP
workers initialising in parallel do. MORI would ``exit(-1)`` on a bind failure; here it
is counted. Listeners stay open until every rank has bound, so distinct published
ports really coexist.

Fakes: MORI (absent here), the world / TP groups (a torch.distributed group needs a GPU
per rank: ``rank_in_group`` / ``world_size`` are set on vLLM's own ``parallel_state``
in the child) and the attention-backend lookup at the end of ``__init__``.
"""

from __future__ import annotations

import ctypes
import fcntl
import multiprocessing as mp
import os
import socket
import struct
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

CLONE_NEWNET = 0x40000000
TIMEOUT = 120.0


def worker_configs(backend: str = "rdma") -> tuple[Any, Any]:
    """(vllm_config, kv_cache_config) for vLLM's real MoRIIOConnectorWorker.__init__ on CPU."""
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from vllm_fix_core import moriio_probe
    from vllm_fix_listener_port import probe

    vllm_config = moriio_probe.with_worker_configs(
        probe.vllm_config(dict(probe.EXTRA_CONFIG, backend=backend)), dtype="bfloat16", head_size=128
    )
    kv_cache_config = KVCacheConfig(num_blocks=1, kv_cache_tensors=[], kv_cache_groups=[])
    return vllm_config, kv_cache_config


def close_worker(worker: Any) -> None:
    executor = getattr(worker, "_handshake_initiation_executor", None)
    if executor is not None:
        executor.shutdown(wait=False)
    context = getattr(worker, "zmq_context", None)
    if context is not None:
        context.term()


def install_fix_in_this_process() -> None:
    """What a vLLM process does at plugin load: the fix goes through the ladder."""
    from vllm_fix_core import Answer, runtime
    from vllm_fix_listener_port import plugin

    plugin.register()
    decision = runtime.decisions()["listener-port"]
    if decision.answer is not Answer.AFFECTED_FIXED:
        raise RuntimeError(decision.message)


def _rank(
    rank: int, n: int, patched: bool, env_port: int | None, mori_version: str, barrier: Any, out: Any
) -> None:
    reported = False
    try:
        if env_port is None:
            os.environ.pop("VLLM_PORT", None)
        else:
            os.environ["VLLM_PORT"] = str(env_port)
        from vllm.distributed import parallel_state
        from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector

        from vllm_fix_core import layers_of
        from vllm_fix_testing import mori_io

        mori_io.put_mori(mori_version)  # this child exits afterwards
        mori_io.install_in_vllm(mori_io.plain_setattr)
        parallel_state._TP = SimpleNamespace(rank_in_group=rank, world_size=n)
        parallel_state._WORLD = SimpleNamespace(rank=rank, local_rank=rank)
        if patched:
            install_fix_in_this_process()
        elif "listener-port" in layers_of(moriio_connector.MoRIIOConnectorWorker, "__init__"):
            raise RuntimeError("a fix leaked into an unpatched rank")
        mori_io.IOEngine.before_bind = lambda engine: barrier.wait(TIMEOUT)  # all ranks bind together

        vllm_config, kv_cache_config = worker_configs()
        report: dict[str, Any] = {"rank": rank}
        try:
            worker = moriio_connector.MoRIIOConnectorWorker(vllm_config, f"engine-{rank}", kv_cache_config)
        except OSError as exc:  # the native bind failed: MORI would exit(-1) here
            engine = mori_io.IOEngine.instances[-1]
            report.update(allocated=engine.config.port, published=None, error=exc.strerror)
        else:
            engine = worker.moriio_engine
            report.update(
                allocated=engine.config.port,
                published=engine.get_engine_desc().port,
                worker_port=worker.local_kv_port,
                config_port=worker.moriio_config.local_kv_port,
                error=None,
            )
        barrier.wait(TIMEOUT)  # every listener that could bind is up at the same time
        out.put(report)
        reported = True
        barrier.wait(TIMEOUT)  # keep listening until every rank has reported
    except BaseException as exc:
        barrier.abort()
        if not reported:
            out.put({"rank": rank, "fatal": repr(exc)})
    finally:
        from vllm_fix_testing import mori_io

        mori_io.IOEngine.close_all()


def run_race(n: int, patched: bool, env_port: int | None, mori_version: str = "1.2.2") -> dict[str, Any]:
    """Race n forked ranks; returns per-rank reports and the figures."""
    # Import vLLM (and this package) once here: the ranks are forked from this process.
    import vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_connector  # noqa: F401

    import vllm_fix_listener_port.patch  # noqa: F401
    from vllm_fix_listener_port import probe

    probe.vllm_config()  # the config classes' first build is slow: once here, not in every rank
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(n)
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_rank, args=(r, n, patched, env_port, mori_version, barrier, out), daemon=True)
        for r in range(n)
    ]
    for proc in procs:
        proc.start()
    try:
        reports = [out.get(timeout=TIMEOUT) for _ in range(n)]
    finally:
        for proc in procs:
            proc.join(TIMEOUT)
            if proc.is_alive():
                proc.kill()
    fatal = [r for r in reports if "fatal" in r]
    if fatal:
        raise AssertionError(f"ranks failed outside the bind: {fatal}")
    published = [r["published"] for r in reports if r["published"] is not None]
    return {
        "n": n,
        "patched": patched,
        "reports": sorted(reports, key=lambda r: r["rank"]),
        "bind_failures": sum(r["error"] is not None for r in reports),
        "errors": sorted({r["error"] for r in reports if r["error"]}),
        "published": published,
        "distinct": len(set(published)),
        "allocated": sorted({r["allocated"] for r in reports}),
    }


def describe(result: dict[str, Any]) -> str:
    allocated = result["allocated"]
    shown = allocated if len(allocated) <= 4 else f"{len(allocated)} distinct values"
    return (
        f"N={result['n']} {'patched' if result['patched'] else 'unpatched'}: "
        f"{result['bind_failures']} bind failures {result['errors']}, "
        f"{result['distinct']} distinct published ports; local_kv_port from from_vllm_config: {shown}"
    )


def _loopback_up() -> None:
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sh22x", b"lo", 0)
        flags = struct.unpack("16sh22x", fcntl.ioctl(sock, siocgifflags, request))[1]
        fcntl.ioctl(sock, siocsifflags, struct.pack("16sh22x", b"lo", flags | iff_up))


def _connect_steals(patched: bool, mori_version: str = "1.2.2") -> dict[str, Any]:
    """One rank: vLLM's real __init__, and an unrelated outgoing connect() right before the native bind."""
    from vllm.distributed import parallel_state
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector

    from vllm_fix_testing import mori_io

    os.environ.pop("VLLM_PORT", None)
    mori_io.put_mori(mori_version)  # the namespace leader exits afterwards
    mori_io.install_in_vllm(mori_io.plain_setattr)
    parallel_state._TP = SimpleNamespace(rank_in_group=0, world_size=1)
    if patched:
        install_fix_in_this_process()
    server = socket.socket()
    server.bind(("127.0.0.1", 50000))  # outside the ephemeral range
    server.listen(1)
    client = socket.socket()
    report: dict[str, Any] = {}

    def connect_first(engine: Any) -> None:
        report["allocated"] = engine.config.port
        client.connect(("127.0.0.1", 50000))  # auto-binds a local port from the same pool
        report["client_port"] = client.getsockname()[1]

    mori_io.IOEngine.before_bind = connect_first
    vllm_config, kv_cache_config = worker_configs()
    try:
        worker = moriio_connector.MoRIIOConnectorWorker(vllm_config, "engine-0", kv_cache_config)
        report.update(error=None, published=worker.moriio_engine.get_engine_desc().port)
        report["worker_port"] = worker.local_kv_port
    except OSError as exc:
        report.update(error=exc.strerror, published=None)
    finally:
        mori_io.IOEngine.close_all()
        client.close()
        server.close()
    return report


def _netns_leader(scenario: str, n: int, patched: bool, port_range: tuple[int, int], out: Any) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            out.put({"skip": f"cannot create a private network namespace: unshare: {os.strerror(err)}"})
            return
        _loopback_up()
        with open("/proc/sys/net/ipv4/ip_local_port_range", "w") as fh:
            fh.write(f"{port_range[0]} {port_range[1]}")
    except OSError as exc:
        out.put({"skip": f"cannot set up the private network namespace: {exc}"})
        return
    try:
        if scenario == "connect":
            out.put({"result": _connect_steals(patched)})
        else:
            out.put({"result": run_race(n, patched, None)})
    except BaseException as exc:
        out.put({"fatal": repr(exc)})


def run_in_netns(scenario: str, n: int, patched: bool, port_range: tuple[int, int]) -> dict[str, Any]:
    """VLLM_PORT unset, inside a private netns with a tiny ephemeral range.

    scenario "race": the N-rank race; "connect": one rank whose probed port an unrelated
    outgoing connect() takes before the native bind.
    """
    import vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_connector  # noqa: F401

    ctx = mp.get_context("fork")
    out = ctx.Queue()
    leader = ctx.Process(target=_netns_leader, args=(scenario, n, patched, port_range, out))
    leader.start()
    try:
        report: dict[str, Any] = out.get(timeout=TIMEOUT * 2)
    finally:
        leader.join(TIMEOUT)
        if leader.is_alive():
            leader.kill()
    if "skip" in report:
        pytest.skip(report["skip"])
    if "fatal" in report:
        raise AssertionError(report["fatal"])
    result: dict[str, Any] = report["result"]
    return result


@pytest.fixture
def race() -> Callable[..., dict[str, Any]]:
    return run_race


@pytest.fixture
def netns() -> Callable[[str, int, bool, tuple[int, int]], dict[str, Any]]:
    return run_in_netns


@pytest.fixture
def race_text() -> Callable[[dict[str, Any]], str]:
    return describe


@pytest.fixture
def fresh_port_base() -> int:
    """A VLLM_PORT base below the usual ephemeral range, free for 200 ports."""
    import random

    for _ in range(50):
        base = random.randrange(20000, 30000)
        ok = True
        for port in range(base, base + 200):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind(("", port))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free port range for the race")


@pytest.fixture
def real_worker(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Build vLLM's REAL MoRIIOConnectorWorker (its __init__ as installed) with MORI stood in."""
    from vllm.distributed import parallel_state
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector

    from vllm_fix_testing import mori_io

    mori_io.install_in_vllm(monkeypatch.setattr)
    monkeypatch.setattr(parallel_state, "_TP", SimpleNamespace(rank_in_group=0, world_size=1))
    made: list[Any] = []

    def make(backend: str = "rdma") -> Any:
        vllm_config, kv_cache_config = worker_configs(backend)
        worker = moriio_connector.MoRIIOConnectorWorker(vllm_config, "engine-0", kv_cache_config)
        made.append(worker)
        return worker

    yield make
    for worker in made:
        close_worker(worker)
    mori_io.IOEngine.close_all()
    mori_io.IOEngine.before_bind = None
