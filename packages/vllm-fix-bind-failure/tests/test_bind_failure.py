"""A listener that cannot bind: start-up on real vLLM, unpatched vs patched.

Workers are built by the real MoRIIOConnectorWorker.__init__ and started by the real
register_kv_caches, which starts the real handshake and notify listeners on loopback.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_fix_bind_failure import FIX
from vllm_fix_bind_failure.patch import recognize
from vllm_fix_bind_failure.rule import ListenerBindError
from vllm_fix_core import UnknownShape, runtime
from vllm_fix_core.patching import layers_of
from vllm_fix_testing import STRICT, applied, assert_hostile_wrapper_fails

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")


def test_probe_says_affected_then_fixed() -> None:
    before = FIX.run_probe()
    assert set(before.names(True)) == {
        "handshake-bind-failure-unseen",
        "start-up-waits-on-dead-handshake-listener",
        "notify-bind-failure-unseen",
    }
    assert "without setting its ready event" in before.checks[0].detail
    with applied(FIX):
        after = FIX.run_probe()
        assert not after.affected, after.summary()
    assert FIX.run_probe().affected


def test_hostile_wrapper_over_every_target_is_seen() -> None:
    assert_hostile_wrapper_fails(FIX)


def test_prebound_handshake_port_hangs_unpatched_and_raises_patched(
    make_worker: Callable[..., Any],
    startup: Callable[[Any], Any],
    held_port: Callable[[], int],
    free_bases: Callable[[int], tuple[int, int]],
) -> None:
    port = held_port()
    _, nb = free_bases(4)
    # Negative control: unpatched, the listener thread dies and start-up waits forever.
    hung = startup(make_worker(0, 0, 1, 1, handshake=port, notify=nb))
    assert not hung.wait(3)
    assert not hung.worker._moriio_handshake_listener_t.is_alive()
    _, nb = free_bases(4)
    with applied(FIX):
        worker = make_worker(0, 0, 1, 1, handshake=port, notify=nb)
        s = startup(worker)
        assert s.wait(10), "start-up still waiting: the patched worker hangs"
        assert isinstance(s.error, ListenerBindError), repr(s.error)
        for part in (f"port {port}", "dp0/tp0", f"handshake_port={port}", "kv_connector_extra_config"):
            assert part in str(s.error)
        assert s.error.role == "handshake" and s.error.port == port
        assert worker.moriio_wrapper.notify_thread is None  # nothing more started
        print(
            f"pre-bound handshake port: error after {s.seconds * 1000:.0f} ms (unpatched: waiting after 3 s)"
        )


def test_prebound_notify_port_is_silent_unpatched_and_raises_patched(
    make_worker: Callable[..., Any],
    startup: Callable[[Any], Any],
    held_port: Callable[[], int],
    free_bases: Callable[[int], tuple[int, int]],
) -> None:
    port = held_port()
    hb, _ = free_bases(4)
    # Negative control: unpatched start-up "succeeds" and the notify thread is dead.
    quiet = startup(make_worker(0, 0, 1, 1, handshake=hb, notify=port))
    assert quiet.wait(10) and quiet.error is None
    quiet.worker.moriio_wrapper.notify_thread.join(3)
    assert not quiet.worker.moriio_wrapper.notify_thread.is_alive()
    hb, _ = free_bases(4)
    with applied(FIX):
        s = startup(make_worker(0, 0, 1, 1, handshake=hb, notify=port))
        assert s.wait(15)
        assert isinstance(s.error, ListenerBindError), repr(s.error)
        for part in (f"port {port}", "dp0/tp0", f"notify_port={port}"):
            assert part in str(s.error)
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


def _targets(mods: SimpleNamespace) -> list[tuple[Any, str]]:
    worker, wrapper = mods.connector.MoRIIOConnectorWorker, mods.engine.MoRIIOWrapper
    return [
        (worker, "_moriio_handshake_listener"),
        (worker, "register_kv_caches"),
        (wrapper, "async_wait_reqid"),
        (mods.engine, "zmq_ctx"),
    ]


def test_apply_twice_is_a_noop_and_revert_is_exact(mods: SimpleNamespace) -> None:
    targets = _targets(mods)
    before = [owner.__dict__[attr] for owner, attr in targets]
    with applied(FIX) as decision:
        assert decision.patch is not None
        assert {(id(o), a) for o, a in decision.patch._touched} == {(id(o), a) for o, a in targets}
        assert all(layers_of(owner, attr) == [FIX.id] for owner, attr in targets)
        assert runtime.apply(FIX, STRICT) is decision
    assert all(owner.__dict__[attr] is b for (owner, attr), b in zip(targets, before, strict=True))


def test_refuses_a_changed_listener(mods: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        mods.connector.MoRIIOConnectorWorker, "_moriio_handshake_listener", staticmethod(lambda port: None)
    )
    with pytest.raises(UnknownShape, match="_moriio_handshake_listener"):
        recognize()


def test_plugin_entry_points_are_declared() -> None:
    from importlib.metadata import entry_points

    plugins = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert plugins.get(FIX.entry_point) == "vllm_fix_bind_failure.plugin:register"
    fixes = {ep.name: ep.load() for ep in entry_points(group="vllm_fixes") if ep.name == FIX.id}
    assert fixes[FIX.id] is FIX
