"""Bind failures at start-up, config guards, idempotence, exact revert, composition, shape guards.

Start-up runs the real MoRIIOConnectorWorker.__init__ and register_kv_caches (real
handshake and notify listeners on loopback); only MORI is faked.
"""

from __future__ import annotations

import socket
import types
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_fix_core import PatchSet, Rung, UnknownShape, runtime
from vllm_fix_core.ladder import evaluate
from vllm_fix_core.patching import layers_of
from vllm_fix_core.settings import Settings
from vllm_fix_handshake_port import FIX
from vllm_fix_handshake_port.patch import KNOWN_SITES, ListenerBindError, check_sites, recognize
from vllm_fix_handshake_port.rule import PortLayoutError
from vllm_fix_testing import STRICT, applied

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")


def _targets(mods: SimpleNamespace) -> list[tuple[Any, str]]:
    worker, wrapper = mods.connector.MoRIIOConnectorWorker, mods.engine.MoRIIOWrapper
    sched, writer = mods.connector.MoRIIOConnectorScheduler, mods.engine.MoRIIOWriter
    writer_attr = (
        "_resolve_notify_endpoint" if "_resolve_notify_endpoint" in writer.__dict__ else "_execute_write_task"
    )
    return [
        (mods.common, "get_port_offset"),
        (mods.connector, "get_port_offset"),
        (mods.engine, "get_port_offset"),
        (mods.engine, "zmq_ctx"),
        (mods.common.MoRIIOConfig, "from_vllm_config"),
        (worker, "__init__"),
        (worker, "_moriio_handshake_listener"),
        (worker, "register_kv_caches"),
        (worker, "_moriio_handshake"),
        (wrapper, "async_wait_reqid"),
        (wrapper, "register_remote_engine"),
        (sched, "_release_write_prefill_blocks"),
        (sched, "update_state_after_alloc"),
        (writer, writer_attr),
    ]


# --------------------------------------------------------------------------- start-up


def test_prebound_handshake_port_hangs_unpatched_and_raises_patched(
    make_worker: Callable[..., Any],
    startup: Callable[[Any], Any],
    held_port: Callable[[], tuple[socket.socket, int]],
    free_bases: Callable[[int], tuple[int, int]],
) -> None:
    _, port = held_port()
    _, nb = free_bases(4)
    # Negative control: unpatched, the listener thread dies and start-up waits forever.
    hung = startup(make_worker(0, 0, 1, 1, handshake=port, notify=nb))
    assert not hung.wait(3)
    assert not hung.worker._moriio_handshake_listener_t.is_alive()
    with applied(FIX):
        # Rank (1, 1) of a 2 x 2 host, whose handshake port (base + 3) is taken.
        worker = make_worker(1, 1, 2, 2, handshake=port - 3, notify=nb)
        assert worker.side_channel_port == port
        s = startup(worker)
        assert s.wait(10), "start-up still waiting: the patched worker hangs"
        assert isinstance(s.error, ListenerBindError), repr(s.error)
        text = str(s.error)
        for part in (f"port {port}", "dp1/tp1", f"handshake_port={port - 3}", "kv_connector_extra_config"):
            assert part in text
        assert s.error.role == "handshake" and s.error.port == port
        assert s.seconds < 5
        assert worker.moriio_wrapper.notify_thread is None  # nothing more started
        print(
            f"pre-bound handshake port: error after {s.seconds * 1000:.0f} ms "
            "(unpatched: still waiting after 3 s)"
        )


def test_prebound_notify_port_is_silent_unpatched_and_raises_patched(
    make_worker: Callable[..., Any],
    startup: Callable[[Any], Any],
    held_port: Callable[[], tuple[socket.socket, int]],
    free_bases: Callable[[int], tuple[int, int]],
) -> None:
    _, port = held_port()
    hb, _ = free_bases(8)
    # Negative control: unpatched start-up "succeeds" and the notify thread is dead.
    quiet = startup(make_worker(0, 0, 1, 1, handshake=hb, notify=port))
    assert quiet.wait(10) and quiet.error is None
    quiet.worker.moriio_wrapper.notify_thread.join(3)
    assert not quiet.worker.moriio_wrapper.notify_thread.is_alive()
    with applied(FIX):
        worker = make_worker(0, 1, 1, 2, handshake=hb + 4, notify=port - 1)
        assert worker.notify_port == port
        s = startup(worker)
        assert s.wait(15)
        assert isinstance(s.error, ListenerBindError), repr(s.error)
        for part in (f"port {port}", "dp0/tp1", f"notify_port={port - 1}"):
            assert part in str(s.error)
        assert s.seconds < 5
        print(f"pre-bound notify port: error after {s.seconds * 1000:.0f} ms (unpatched: silent)")


def test_healthy_startup_is_unchanged(
    make_worker: Callable[..., Any],
    startup: Callable[[Any], Any],
    free_bases: Callable[[int], tuple[int, int]],
) -> None:
    hb, nb = free_bases(4)
    with applied(FIX):
        s = startup(make_worker(0, 0, 1, 1, handshake=hb, notify=nb))
        assert s.wait(10) and s.error is None
        assert s.worker.moriio_wrapper.notify_thread.is_alive()
        assert s.worker._moriio_handshake_listener_t.is_alive()


def test_overlapping_bases_are_rejected(mods: SimpleNamespace, ranks: Callable[[int, int], None]) -> None:
    from_vllm_config = mods.common.MoRIIOConfig.from_vllm_config

    ranks(0, 8)
    cfg = _config(dp_local=4, tp_size=8, handshake=6301, notify=6320)
    assert from_vllm_config(cfg).notify_port == 6320  # unpatched: accepted, ranks collide later
    with applied(FIX):
        with pytest.raises(PortLayoutError, match="overlap"):
            mods.common.MoRIIOConfig.from_vllm_config(cfg)
        ok = mods.common.MoRIIOConfig.from_vllm_config(
            _config(dp_local=4, tp_size=8, handshake=6301, notify=6333)
        )
        assert ok.notify_port == 6333


def _config(dp_local: int, tp_size: int, handshake: int, notify: int, dp: int = 0) -> Any:
    extra = {
        "handshake_port": str(handshake),
        "notify_port": str(notify),
        "http_port": "8000",
        "host_ip": "127.0.0.1",
    }
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra),
        parallel_config=SimpleNamespace(
            data_parallel_rank=dp, data_parallel_size_local=dp_local, data_parallel_size=dp_local
        ),
    )


# --------------------------------------------------------------------------- patch hygiene


def test_apply_twice_is_a_noop_and_revert_is_exact(mods: SimpleNamespace) -> None:
    targets = _targets(mods)
    before = [owner.__dict__[attr] for owner, attr in targets]
    with applied(FIX) as decision:
        assert decision.shape == recognize()
        installed = [owner.__dict__[attr] for owner, attr in targets]
        assert all(a is not b for a, b in zip(installed, before, strict=True))
        assert all(layers_of(owner, attr) == [FIX.id] for owner, attr in targets)
        assert runtime.apply(FIX, STRICT) is decision  # runtime: no second application
        again = PatchSet(FIX.id)
        FIX.run_apply(again, decision.shape or "")  # PatchSet: one layer per fix per target
        assert [owner.__dict__[attr] for owner, attr in targets] == installed
        assert all(layers_of(owner, attr) == [FIX.id] for owner, attr in targets)
        again.revert()  # it installed nothing, so it removes nothing
        assert [owner.__dict__[attr] for owner, attr in targets] == installed
    after = [owner.__dict__[attr] for owner, attr in targets]
    assert all(a is b for a, b in zip(after, before, strict=True))


def _listener_port_like(patch: PatchSet, mods: SimpleNamespace) -> None:
    """A second fix on the same targets, like vllm-fix-listener-port (local_kv_port = 0)."""

    def config_wrapper(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        config = wrapped(*args, **kwargs)
        config.local_kv_port = 0
        return config

    def init_wrapper(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        wrapped(*args, **kwargs)
        instance.other_fix_ran = True

    patch.wrap(mods.common.MoRIIOConfig, "from_vllm_config", config_wrapper)
    patch.wrap(mods.connector.MoRIIOConnectorWorker, "__init__", init_wrapper)


@pytest.fixture
def other_fix(mods: SimpleNamespace) -> Iterator[PatchSet]:
    patch = PatchSet("listener-port-like")
    yield patch
    patch.revert()


@pytest.mark.parametrize("ours_first", [True, False])
def test_composes_with_another_wrapper_in_either_order(
    mods: SimpleNamespace, make_worker: Callable[..., Any], other_fix: PatchSet, ours_first: bool
) -> None:
    original_config = mods.common.MoRIIOConfig.__dict__["from_vllm_config"]
    original_init = mods.connector.MoRIIOConnectorWorker.__dict__["__init__"]
    try:
        if ours_first:
            runtime.apply(FIX, STRICT)
            _listener_port_like(other_fix, mods)
        else:
            _listener_port_like(other_fix, mods)
            assert runtime.apply(FIX, STRICT).rung is Rung.APPLIED
        both = make_worker(1, 0, 2, 2, handshake=16301, notify=26005)
        assert (both.side_channel_port, both.notify_port) == (16303, 26007)  # ours
        assert both.moriio_config.local_kv_port == 0 and both.other_fix_ran  # theirs
        runtime.revert(FIX)
        theirs = make_worker(1, 0, 2, 2, handshake=16301, notify=26005)
        assert (theirs.side_channel_port, theirs.notify_port) == (16302, 26006)  # ours gone
        assert theirs.moriio_config.local_kv_port == 0 and theirs.other_fix_ran  # theirs kept
        runtime.apply(FIX, STRICT)
        other_fix.revert()
        ours = make_worker(1, 0, 2, 2, handshake=16301, notify=26005)
        assert ours.side_channel_port == 16303 and ours.moriio_config.local_kv_port != 0
        assert not hasattr(ours, "other_fix_ran")
    finally:
        runtime.revert(FIX)
        other_fix.revert()
    assert mods.common.MoRIIOConfig.__dict__["from_vllm_config"] is original_config
    assert mods.connector.MoRIIOConnectorWorker.__dict__["__init__"] is original_init


# --------------------------------------------------------------------------- shape guards


def test_refuses_a_changed_offset_function(mods: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    def get_port_offset(dp_rank: int, tp_rank: int, tp_size: int) -> int:
        return dp_rank * tp_size + tp_rank

    monkeypatch.setattr(mods.common, "get_port_offset", get_port_offset)
    with pytest.raises(UnknownShape, match="get_port_offset"):
        recognize()
    decision = evaluate(FIX, Settings(disabled=frozenset(), strict=False), apply=True)
    assert decision.rung is Rung.REFUSED and decision.patch is None


def test_refuses_a_cached_reference_to_another_function(
    mods: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = mods.engine.get_port_offset
    copy = types.FunctionType(
        original.__code__, original.__globals__, original.__name__, original.__defaults__
    )
    monkeypatch.setattr(mods.engine, "get_port_offset", copy)
    with pytest.raises(UnknownShape, match=r"moriio_engine\.get_port_offset is not"):
        recognize()


def test_refuses_a_changed_listener(mods: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        mods.connector.MoRIIOConnectorWorker, "_moriio_handshake_listener", staticmethod(lambda port: None)
    )
    with pytest.raises(UnknownShape, match="_moriio_handshake_listener"):
        recognize()


def test_refuses_an_unknown_call_site() -> None:
    for known in KNOWN_SITES.values():
        check_sites(known)
        with pytest.raises(UnknownShape, match=r"moriio_connector:Somewhere\.new"):
            check_sites(known | {("moriio_connector", "Somewhere.new", 2)})
        check_sites(known | {("moriio_connector", "Somewhere.new", 3)})  # names the TP size: fine


def test_plugin_entry_points_are_declared() -> None:
    from importlib.metadata import entry_points

    plugins = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert plugins.get(FIX.entry_point) == "vllm_fix_handshake_port.plugin:register"
    fixes = {ep.name: ep.load() for ep in entry_points(group="vllm_fixes") if ep.name == FIX.id}
    assert fixes[FIX.id] is FIX
