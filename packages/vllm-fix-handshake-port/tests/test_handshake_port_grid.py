"""The (DP, TP) grid on real vLLM: who binds which port, and whom each dialer reaches.

Workers are built by the real MoRIIOConnectorWorker.__init__ (which calls the real
MoRIIOConfig.from_vllm_config) and started by the real register_kv_caches, which
starts the real handshake and notify listeners on loopback. Only MORI is faked.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_fix_core import PatchSet, original_of
from vllm_fix_core.patching import layers_of
from vllm_fix_handshake_port import FIX, probe
from vllm_fix_handshake_port.patch import recognize
from vllm_fix_handshake_port.rule import listening_tp_size
from vllm_fix_handshake_port.sites import KNOWN_SITES, callers
from vllm_fix_testing import applied, assert_hostile_wrapper_fails, vllm_version

GRIDS = [(2, 2), (2, 4), (3, 2), (4, 8), (1, 8), (4, 1)]
# The caller inventory each release line has (see the README, "Releases").
SHAPE = {
    "0.31.0": "vllm-0.31-0.32",
    "0.32.0": "vllm-0.31-0.32",
    "0.33.0": "vllm-0.33",
    "0.34.0": "vllm-0.33",  # the same seven callers as 0.33.0
}


def test_probe_says_affected_then_fixed() -> None:
    before = FIX.run_probe()
    assert before.affected  # every release 0.24-0.33 carries the defect
    assert set(before.names(True)) == {
        "listener-ports-collide",
        "handshake-dial-misses-listener",
        "overlapping-port-blocks-accepted",
    }
    assert not before.broken_guards  # unpatched, senders and listeners agree (on colliding ports)
    assert "(0, 1) and (1, 0) both bind" in before.checks[0].detail
    with applied(FIX):
        after = FIX.run_probe()
        assert not after.affected and not after.broken_guards, after.summary()
    assert FIX.run_probe().affected


def test_hostile_wrapper_over_every_target_is_seen() -> None:
    assert_hostile_wrapper_fails(FIX)


def test_listener_site_wrapper_forcing_tp_size_1_is_seen(mods: SimpleNamespace) -> None:
    """The issue's scenario: another layer makes the listener site compute with TP size 1."""

    def tp1(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        with listening_tp_size(1):
            return wrapped(*args, **kwargs)

    with applied(FIX):
        layer = PatchSet("tp-size-1-at-the-listener")
        layer.wrap(mods.common.MoRIIOConfig, "from_vllm_config", tp1)
        try:
            report = FIX.run_probe()
        finally:
            layer.revert()
        assert "listener-ports-collide" in report.names(True), report.summary()


def test_sender_that_skips_the_fix_is_seen(mods: SimpleNamespace) -> None:
    """A layer that runs vLLM's original release sender (without the fix's TP size) misses the
    patched listeners: a broken guard, so the ladder would say "failed to fix"."""
    sched = mods.connector.MoRIIOConnectorScheduler
    original = original_of(sched, "_release_write_prefill_blocks")

    def skip_fix(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        return original(instance, *args, **kwargs)

    with applied(FIX):
        layer = PatchSet("original-sender")
        layer.wrap(sched, "_release_write_prefill_blocks", skip_fix)
        try:
            report = FIX.run_probe()
        finally:
            layer.revert()
        assert report.broken_guards == ["release-misses-listener"], report.summary()


def test_recognized_shape_is_this_release() -> None:
    shape = SHAPE[str(vllm_version())]
    assert recognize() == shape
    assert set(callers()) == KNOWN_SITES[shape]  # upstream drift guard: every caller known


def test_every_caller_reaches_the_patched_offset(mods: SimpleNamespace) -> None:
    originals = {name: getattr(mods, name).get_port_offset for name in ("common", "connector", "engine")}
    assert len({id(f) for f in originals.values()}) == 1  # three cached references to one function
    with applied(FIX):
        for name in originals:
            module = getattr(mods, name)
            assert layers_of(module, "get_port_offset") == ["handshake-port"]
            assert module.get_port_offset is not originals[name]
    for name, fn in originals.items():
        assert getattr(mods, name).get_port_offset is fn


def _grid(
    make_worker: Callable[..., Any], dp_size: int, tp_size: int, **bases: int
) -> dict[tuple[int, int], Any]:
    return {
        (dp, tp): make_worker(dp, tp, dp_size, tp_size, **bases)
        for dp in range(dp_size)
        for tp in range(tp_size)
    }


def _ports(workers: dict[tuple[int, int], Any]) -> dict[tuple[int, int], tuple[int, int]]:
    return {rank: (w.side_channel_port, w.notify_port) for rank, w in workers.items()}


@pytest.mark.parametrize(("dp_size", "tp_size"), GRIDS)
def test_listener_ports_unpatched_vs_patched(
    make_worker: Callable[..., Any], dp_size: int, tp_size: int
) -> None:
    hb, nb = 16301, 26005
    unpatched = _ports(_grid(make_worker, dp_size, tp_size, handshake=hb, notify=nb))
    with applied(FIX):
        patched = _ports(_grid(make_worker, dp_size, tp_size, handshake=hb, notify=nb))
    n = dp_size * tp_size
    # Patched: every rank its own port, exactly base + dp * tp_size + tp, both bases.
    assert patched == {
        (dp, tp): (hb + dp * tp_size + tp, nb + dp * tp_size + tp)
        for dp in range(dp_size)
        for tp in range(tp_size)
    }
    assert len({p for p, _ in patched.values()}) == n and len({p for _, p in patched.values()}) == n
    dup_hs = n - len({p for p, _ in unpatched.values()})
    dup_nt = n - len({p for _, p in unpatched.values()})
    if dp_size > 1 and tp_size > 1:
        # Negative control: unpatched listeners collide (offset dp + tp ignores tp_size).
        assert dup_hs > 0 and dup_nt > 0
        assert unpatched[(0, 1)] == unpatched[(1, 0)] == (hb + 1, nb + 1)
    else:
        # One DP rank or one TP rank: both conventions give the same ports (mixing is safe).
        assert unpatched == patched
    print(
        f"grid {dp_size}x{tp_size}: unpatched {dup_hs} duplicate handshake / {dup_nt} notify ports, patched 0"
    )


def _write_task(mods: SimpleNamespace, **fields: Any) -> Any:
    names = {f.name for f in dataclasses.fields(mods.common.WriteTask)}
    base = {
        "request_id": "req",
        "transfer_id": "xfer",
        "dst_engine_id": "decode",
        "local_block_ids": [[0]],
        "remote_block_ids_hint": None,
        "layer_name": "layer",
        "event": None,
    }
    return mods.common.WriteTask(**{k: v for k, v in {**base, **fields}.items() if k in names})


def _write_notify_port(
    mods: SimpleNamespace, writer: Any, decode_dp: int, base: int, dp_size: int, tp_size: int
) -> int:
    """The decode notify port a prefill writer sends its completion to (real vLLM code)."""
    task = _write_task(
        mods,
        remote_notify_port=base,
        remote_ip="127.0.0.1",
        remote_tp_size=tp_size,
        remote_dp_size_local=dp_size,
        remote_dp_size=dp_size,
        transfer_id=f"xfer-{decode_dp}",
    )
    if hasattr(writer, "_resolve_notify_endpoint"):  # 0.33.0
        return int(writer._resolve_notify_endpoint(task, decode_dp)[1])
    alloc = mods.common.RemoteAllocInfo(block_ids=None, decode_dp_rank=decode_dp)  # 0.32.0
    writer.worker.moriio_wrapper.done_remote_allocate_req_dict[task.transfer_id] = alloc
    writer._execute_write_task(task)
    return int(alloc.completion_notify_port)


def _scheduler(mods: SimpleNamespace, tp_size: int) -> Any:
    """vLLM's decode-side scheduler in WRITE mode, built by its own __init__ (the probe's builder)."""
    return probe._decode_scheduler(mods.connector, mods.common, tp_size)


def _released(worker: Any) -> set[str]:
    return {getattr(ack, "transfer_id", ack) for ack in list(worker.moriio_wrapper.done_req_ids)}


def _wait(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def _start_all(
    workers: dict[tuple[int, int], Any], startup: Callable[[Any], Any]
) -> dict[tuple[int, int], Any]:
    return {rank: startup(w) for rank, w in workers.items()}


@pytest.mark.parametrize(
    ("dp_size", "tp_size"),
    [(2, 2), (2, 4), (4, 8)]
    + [
        pytest.param(d, t, marks=pytest.mark.stress)
        for d in (1, 2, 3, 4)
        for t in (1, 2, 3, 5, 8)
        if (d, t) not in {(2, 2), (4, 8)}
    ],
)
def test_every_dialer_reaches_its_listener(
    mods: SimpleNamespace,
    make_worker: Callable[..., Any],
    startup: Callable[[Any], Any],
    free_bases: Callable[[int], tuple[int, int]],
    dp_size: int,
    tp_size: int,
) -> None:
    hb, nb = free_bases(dp_size * tp_size)
    with applied(FIX):
        workers = _grid(make_worker, dp_size, tp_size, handshake=hb, notify=nb)
        started = _start_all(workers, startup)
        for rank, s in started.items():
            assert s.wait(10) and s.error is None, (rank, s.error)
        dialer = make_worker(0, 0, 1, 1, handshake=hb + 4000, notify=nb + 4000)
        sched = _scheduler(mods, tp_size)
        for (dp, tp), w in workers.items():
            # Handshake dialer (real _moriio_handshake) gets the metadata of the rank it means.
            agents = dialer._moriio_handshake("127.0.0.1", hb, tp_size, f"p_dp{dp}", dp, tp)
            assert agents == {w.moriio_engine.key}
            assert w.moriio_engine.key.endswith(f":tp{tp}:dp{dp}")
            # WRITE completion notify (real writer code) targets that rank's notify listener.
            assert _write_notify_port(mods, w._writer, dp, nb, dp_size, tp_size) == w.notify_port
        print(f"grid {dp_size}x{tp_size}: {len(workers)} handshake dials and WRITE notify targets correct")
        for dp in range(dp_size):
            # Scheduler release (real sender, real notify listeners): exactly DP rank dp's TP ranks.
            transfer = f"release-dp{dp}"
            params = {
                "transfer_id": transfer,
                "remote_dp_rank": dp,
                "remote_host": "127.0.0.1",
                "remote_notify_port": nb,
                "remote_tp_size": tp_size,
            }
            sched._release_write_prefill_blocks(f"req-{dp}", params)
            mine = [w for (d, _), w in workers.items() if d == dp]
            assert _wait(lambda mine=mine, t=transfer: all(t in _released(w) for w in mine))
        time.sleep(0.2)
        for (dp, _), w in workers.items():
            assert _released(w) == {f"release-dp{dp}"}


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_unpatched_grid_hangs_and_misroutes(
    mods: SimpleNamespace,
    make_worker: Callable[..., Any],
    startup: Callable[[Any], Any],
    free_bases: Callable[[int], tuple[int, int]],
) -> None:
    hb, nb = free_bases(4)
    workers = _grid(make_worker, 2, 2, handshake=hb, notify=nb)
    started = {}
    for rank in [(0, 0), (0, 1), (1, 1), (1, 0)]:  # (1, 0) starts last: its ports are taken
        started[rank] = startup(workers[rank])
        if rank != (1, 0):
            assert started[rank].wait(10) and started[rank].error is None
    # Negative control, the hang: (1, 0)'s listener died on "Address already in use";
    # register_kv_caches still waits on the ready event.
    assert not started[(1, 0)].wait(3)
    assert not workers[(1, 0)]._moriio_handshake_listener_t.is_alive()
    dialer = make_worker(0, 0, 1, 1, handshake=hb + 4000, notify=nb + 4000)
    # Negative control, misrouting: the dialer for (1, 0) reaches (1, 1)'s listener.
    assert dialer._moriio_handshake("127.0.0.1", hb, 2, "p_dp1", 1, 0) == {workers[(1, 1)].moriio_engine.key}
    # ... and a release for DP rank 1 lands on (0, 1), a DP rank 0 listener.
    _scheduler(mods, 2)._release_write_prefill_blocks(
        "req",
        {"transfer_id": "r1", "remote_dp_rank": 1, "remote_host": "127.0.0.1", "remote_notify_port": nb},
    )
    assert _wait(lambda: "r1" in _released(workers[(0, 1)]))
    assert _write_notify_port(mods, workers[(0, 0)]._writer, 1, nb, 2, 2) == workers[(0, 1)].notify_port


def _write_scheduler(mods: SimpleNamespace, tp_size: int) -> Any:
    """A decode-side scheduler in WRITE mode."""
    return _scheduler(mods, tp_size)


def _allocate(mods: SimpleNamespace, sched: Any, dp: int, nb: int, tp_size: int) -> str:
    """Real update_state_after_alloc for a WRITE request whose prefill ran on DP rank dp."""
    transfer = f"alloc-dp{dp}"
    params = {
        "do_remote_prefill": True,
        "transfer_id": transfer,
        "remote_dp_rank": dp,
        "is_request_leader": True,
        "remote_host": "127.0.0.1",
        "remote_notify_port": nb,
        "remote_tp_size": tp_size,
    }
    sched.update_state_after_alloc(probe._request(f"plain-request-{dp}", params), probe._blocks(3, 4), 32)
    return transfer


def _allocated(worker: Any) -> set[str]:
    return set(worker.moriio_wrapper.done_remote_allocate_req_dict)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("patched", [False, True])
def test_write_allocation_notify_reaches_the_prefill_dp_rank(
    mods: SimpleNamespace,
    make_worker: Callable[..., Any],
    startup: Callable[[Any], Any],
    free_bases: Callable[[int], tuple[int, int]],
    engine_core_tp_group: Callable[[], None],
    patched: bool,
) -> None:
    """Decode scheduler -> every prefill TP rank of the chosen DP rank (real sender, real listeners).

    The scheduler runs as in the engine core, without a TP group (vLLM's getters raise): a
    sender that leaves the TP size to this process's TP group would be seen here."""
    hb, nb = free_bases(4)
    order = [(0, 0), (0, 1), (1, 1), (1, 0)]
    with applied(FIX) if patched else _nothing():
        workers = _grid(make_worker, 2, 2, handshake=hb, notify=nb)
        for rank in order:  # one after the other: unpatched, (1, 0) loses the race for its ports
            s = startup(workers[rank])
            if patched or rank != (1, 0):
                assert s.wait(10) and s.error is None
        engine_core_tp_group()
        sched = _write_scheduler(mods, 2)
        transfer = _allocate(mods, sched, 1, nb, 2)
        if patched:
            assert _wait(lambda: all(transfer in _allocated(workers[(1, tp)]) for tp in range(2)))
            time.sleep(0.2)
            assert not _allocated(workers[(0, 0)]) and not _allocated(workers[(0, 1)])
        else:
            # Negative control: DP rank 1's allocation lands on (0, 1); (1, 0) has no listener.
            assert _wait(lambda: transfer in _allocated(workers[(0, 1)]))
            assert transfer not in _allocated(workers[(1, 0)])


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
