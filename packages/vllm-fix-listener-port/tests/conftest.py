"""Shared helpers: the loopback port race (real processes, real vLLM from_vllm_config).

Each rank is a process forked from the test process (which already imported vLLM).
It stands in for a TP worker on one host: the plugin loads (patched case), the
REAL ``MoRIIOConfig.from_vllm_config`` runs, then the kv-port steps of
``MoRIIOConnectorWorker.__init__`` in their order (config -> IOEngine(ip, port)
-> create_backend, where MORI binds). All ranks meet at a Barrier right before the
native bind, as TP workers initialising in parallel do. The native listener is
emulated exactly (SO_REUSEADDR, bind, listen(128)); MORI would exit(-1) on a bind
failure, here it is counted. Listeners stay open until every rank has bound, so
distinct published ports really coexist.

Fakes: only the TP group (a torch.distributed group needs a GPU per rank: its
``rank_in_group`` / ``world_size`` are set on vLLM's own ``parallel_state._TP`` in
the child) and the MORI engine (vllm_fix_listener_port.emulation).
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


def _rank(rank: int, n: int, patched: bool, env_port: int | None, barrier: Any, out: Any) -> None:
    engine = None
    reported = False
    try:
        if env_port is None:
            os.environ.pop("VLLM_PORT", None)
        else:
            os.environ["VLLM_PORT"] = str(env_port)
        from vllm.distributed import parallel_state
        from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_common

        from vllm_fix_core import runtime
        from vllm_fix_listener_port import patch, plugin, probe
        from vllm_fix_listener_port.emulation import RDMA, IOEngine, IOEngineConfig

        parallel_state._TP = SimpleNamespace(rank_in_group=rank, world_size=n)
        if patched:
            plugin.register()
            decision = runtime.decisions()["listener-port"]
            if decision.rung.value != "applied":
                raise RuntimeError(decision.message)
        elif any(probe.installed()):
            raise RuntimeError("the fix leaked into an unpatched rank")

        worker = SimpleNamespace()
        allocated: list[int] = []

        def init() -> None:  # MoRIIOConnectorWorker.__init__'s kv-port steps, in its order
            worker.moriio_config = moriio_common.MoRIIOConfig.from_vllm_config(probe.vllm_config())
            worker.local_kv_port = worker.moriio_config.local_kv_port
            allocated.append(worker.local_kv_port)
            worker.moriio_engine = IOEngine(
                f"rank{rank}",
                IOEngineConfig(worker.moriio_config.local_ip, worker.moriio_config.local_kv_port),
            )
            barrier.wait(TIMEOUT)  # every rank reaches the native bind together
            worker.moriio_engine.create_backend(RDMA)  # MORI: exit(-1) on failure

        report: dict[str, Any] = {"rank": rank}
        try:
            if patched:
                patch.worker_init_wrapper(init, worker, (), {})
            else:
                init()
        except OSError as exc:  # the native bind failed: MORI would exit(-1) here
            report.update(allocated=allocated[0], published=None, error=exc.strerror)
        else:
            report.update(
                allocated=allocated[0],
                published=worker.moriio_engine.get_engine_desc().port,
                worker_port=worker.local_kv_port,
                config_port=worker.moriio_config.local_kv_port,
                error=None,
            )
        engine = getattr(worker, "moriio_engine", None)
        barrier.wait(TIMEOUT)  # every listener that could bind is up at the same time
        out.put(report)
        reported = True
        barrier.wait(TIMEOUT)  # keep listening until every rank has reported
    except BaseException as exc:
        barrier.abort()
        if not reported:
            out.put({"rank": rank, "fatal": repr(exc)})
    finally:
        if engine is not None:
            engine.close()


def run_race(n: int, patched: bool, env_port: int | None) -> dict[str, Any]:
    """Race n forked ranks; returns per-rank reports and the two figures."""
    # Import vLLM (and this package) once here: the ranks are forked from this process.
    import vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_connector  # noqa: F401

    import vllm_fix_listener_port.patch  # noqa: F401

    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(n)
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_rank, args=(r, n, patched, env_port, barrier, out), daemon=True) for r in range(n)
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


def _connect_steals(patched: bool) -> dict[str, Any]:
    """One rank: from_vllm_config, then an unrelated outgoing connect(), then the native bind."""
    import vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_connector  # noqa: F401
    from vllm.distributed import parallel_state
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_common

    from vllm_fix_core import runtime
    from vllm_fix_listener_port import patch, plugin, probe
    from vllm_fix_listener_port.emulation import RDMA, IOEngine, IOEngineConfig

    os.environ.pop("VLLM_PORT", None)
    parallel_state._TP = SimpleNamespace(rank_in_group=0, world_size=1)
    if patched:
        plugin.register()
        decision = runtime.decisions()["listener-port"]
        if decision.rung.value != "applied":
            raise RuntimeError(decision.message)
    server = socket.socket()
    server.bind(("127.0.0.1", 50000))  # outside the ephemeral range
    server.listen(1)
    client = socket.socket()
    worker = SimpleNamespace()
    report: dict[str, Any] = {}

    def init() -> None:
        worker.moriio_config = moriio_common.MoRIIOConfig.from_vllm_config(probe.vllm_config())
        worker.local_kv_port = worker.moriio_config.local_kv_port
        report["allocated"] = worker.local_kv_port
        client.connect(("127.0.0.1", 50000))  # auto-binds a local port from the same pool
        report["client_port"] = client.getsockname()[1]
        config = IOEngineConfig(worker.moriio_config.local_ip, worker.local_kv_port)
        worker.moriio_engine = IOEngine("r0", config)
        worker.moriio_engine.create_backend(RDMA)

    try:
        if patched:
            patch.worker_init_wrapper(init, worker, (), {})
        else:
            init()
        report.update(error=None, published=worker.moriio_engine.get_engine_desc().port)
        report["worker_port"] = worker.local_kv_port
        worker.moriio_engine.close()
    except OSError as exc:
        report.update(error=exc.strerror, published=None)
    finally:
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
def race() -> Callable[[int, bool, int | None], dict[str, Any]]:
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


def _make_real_worker(monkeypatch: pytest.MonkeyPatch, backend: str, report_port: int | None) -> Any:
    """Run vLLM's REAL MoRIIOConnectorWorker.__init__ with MORI emulated.

    Fakes: the names vLLM imports from ``mori.io`` (absent here), the world / TP
    groups (torch.distributed groups need GPUs) and the attention-backend lookup
    at the end of __init__ (a GPU platform question). Everything else is vLLM's.
    """
    import functools

    from vllm.distributed import parallel_state
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector, moriio_engine
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from vllm_fix_listener_port import emulation, probe

    backend_type = SimpleNamespace(RDMA=emulation.RDMA, XGMI=emulation.XGMI)
    engine_cls = functools.partial(emulation.IOEngine, report_port=report_port)
    monkeypatch.setattr(moriio_connector, "MoRIIO_enabled", True)
    for module in (moriio_connector, moriio_engine):
        monkeypatch.setattr(module, "BackendType", backend_type, raising=False)
    monkeypatch.setattr(moriio_connector, "IOEngine", engine_cls, raising=False)
    monkeypatch.setattr(moriio_connector, "IOEngineConfig", emulation.IOEngineConfig, raising=False)
    monkeypatch.setattr(moriio_engine, "RdmaBackendConfig", lambda *a, **k: (a, k), raising=False)
    monkeypatch.setattr(moriio_engine, "XgmiBackendConfig", lambda *a, **k: (a, k), raising=False)
    monkeypatch.setattr(moriio_engine, "PollCqMode", SimpleNamespace(POLLING="polling"), raising=False)
    monkeypatch.setattr(
        moriio_connector, "get_attn_backend", lambda *a, **k: SimpleNamespace(get_name=lambda: "EMULATED")
    )
    monkeypatch.setattr(parallel_state, "_WORLD", SimpleNamespace(rank=0, local_rank=0))
    monkeypatch.setattr(parallel_state, "_TP", SimpleNamespace(rank_in_group=0, world_size=1))
    extra = dict(probe.EXTRA_CONFIG, backend=backend)
    vllm_config = probe.vllm_config(extra)
    vllm_config.cache_config = SimpleNamespace(block_size=16, cache_dtype="auto")
    vllm_config.model_config = SimpleNamespace(use_mla=False, dtype="bfloat16", get_head_size=lambda: 128)
    kv_cache_config = KVCacheConfig(num_blocks=1, kv_cache_tensors=[], kv_cache_groups=[])
    return moriio_connector.MoRIIOConnectorWorker(vllm_config, "engine-0", kv_cache_config)


@pytest.fixture
def real_worker(monkeypatch: pytest.MonkeyPatch) -> Any:
    from vllm_fix_listener_port import emulation

    made: list[Any] = []

    def make(backend: str = "rdma", report_port: int | None = None) -> Any:
        worker = _make_real_worker(monkeypatch, backend, report_port)
        made.append(worker)
        return worker

    yield make
    for worker in made:
        executor = getattr(worker, "_handshake_initiation_executor", None)
        if executor is not None:
            executor.shutdown(wait=False)
        context = getattr(worker, "zmq_context", None)
        if context is not None:
            context.term()
    for engine in emulation.IOEngine.instances:
        engine.close()
    emulation.IOEngine.instances.clear()
