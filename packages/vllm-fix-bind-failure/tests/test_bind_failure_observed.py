"""Real vLLM: every patched target observed, an oracle of its own, and no new exceptions.

* Each target the fix patches, undone alone (vLLM's original layered over it): the ladder
  says "failed to fix" (``FixFailed`` strict) and restores exactly.
* The rule the patch uses, broken at the reference the patch module holds: the probe (whose
  answer is vLLM's behaviour and the specification's table, not the patch's code) makes the
  ladder fail to fix.
* The patched entry points, fed the shapes vLLM's own types allow, raise nothing that vLLM's
  originals do not (the one specified new error: a listener whose port is taken).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_fix_bind_failure import FIX, patch, watch
from vllm_fix_bind_failure.probe_worker import kv_caches
from vllm_fix_core import Answer, PatchSet, Settings, evaluate
from vllm_fix_testing import applied
from vllm_fix_testing.hostile import assert_every_target_observed, patched_targets

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")

LADDER = Settings(disabled=frozenset(), strict=False)


def test_every_patched_target_is_observed() -> None:
    """0.14.1 - 0.33.0 are all affected: every target, undone alone, is seen."""
    before = set(threading.enumerate())
    assert FIX.run_probe().affected
    decisions = assert_every_target_observed(FIX)
    assert set(decisions) == set(patched_targets(FIX)) and len(decisions) == 4
    assert all(d.answer is Answer.FAILED_TO_FIX for d in decisions.values())
    assert set(threading.enumerate()) <= before  # the probe's threads all ended


def test_probe_starts_up_a_real_worker_and_leaves_nothing_behind() -> None:
    before = set(threading.enumerate())
    report = FIX.run_probe()
    check = {c.name: c for c in report.checks}["start-up-waits-on-dead-handshake-listener"]
    assert check.affected and "waited forever" in check.detail
    with applied(FIX):
        assert not FIX.run_probe().affected
    assert set(threading.enumerate()) <= before


def _no_message(*args: Any) -> str:
    return "MoRIIO listener failed"


def _no_report(outcome: watch.Outcome, thread: threading.Thread | None = None) -> None:
    return None


@pytest.mark.parametrize(
    ("owner", "name", "broken"),
    [
        (patch, "bind_error_message", _no_message),  # the error no longer names port, setting, cause
        (watch, "report", _no_report),  # listener outcomes never reach the waiting thread
    ],
    ids=["bind_error_message", "watch.report"],
)
def test_breaking_the_rule_the_patch_uses_fails_verification(
    owner: Any, name: str, broken: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(owner, name, broken)  # where patch.py looks it up
    decision = evaluate(FIX, LADDER, apply=True, honour_disable=False)
    assert decision.answer is Answer.FAILED_TO_FIX, decision.reason
    monkeypatch.undo()
    with applied(FIX):  # nothing leaked: the intact fix still fixes
        assert not FIX.run_probe().affected


# --------------------------------------------------------------------------- never raises


@pytest.fixture(scope="module")
def held() -> Iterator[list[int]]:
    """Ports held by another party (a ZMQ bind to them fails with EADDRINUSE)."""
    socks = []
    for _ in range(2):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("0.0.0.0", 0))
        sock.listen(1)
        socks.append(sock)
    yield [int(s.getsockname()[1]) for s in socks]
    for sock in socks:
        sock.close()


def _outcome(call: Callable[[], Any]) -> str | None:
    try:
        call()
    except Exception as exc:
        return type(exc).__name__
    return None


def _both(target: Callable[[], Callable[[], Any]]) -> tuple[str | None, str | None]:
    """(unpatched, patched) outcome of the same call."""
    unpatched = _outcome(target())
    patchset = PatchSet(FIX.id)
    try:
        patch.apply(patchset, patch.recognize())
        patched = _outcome(target())
    finally:
        patchset.revert()
    return unpatched, patched


SOCKET_TYPES = st.sampled_from([zmq.ROUTER, zmq.DEALER, zmq.REQ, zmq.PUB, zmq.PAIR, -1])
ADDRESSES = st.sampled_from(["held", "tcp://*:-1", "tcp://*:70000", "tcp://nowhere", "", "inproc://x"])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(socket_type=SOCKET_TYPES, address=ADDRESSES)
def test_zmq_ctx_never_raises_where_vllm_does_not(
    mods: Any, held: list[int], socket_type: int, address: str
) -> None:
    addr = f"tcp://*:{held[0]}" if address == "held" else address

    def target() -> Callable[[], Any]:
        ctx = mods.engine.zmq_ctx

        def enter_and_leave() -> None:
            with ctx(socket_type, addr):
                pass

        return enter_and_leave

    unpatched, patched = _both(target)
    assert patched == unpatched


READY = st.sampled_from(["fresh", "already-set", "none"])
PORTS = st.sampled_from(["held", -1, 70000])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ready=READY, port=PORTS)
def test_handshake_listener_never_raises_where_vllm_does_not(
    mods: Any, held: list[int], ready: str, port: Any
) -> None:
    """The listener as vLLM's thread runs it; a fresh event on a taken port is the fix's case."""
    base_port = held[0] if port == "held" else port

    def target() -> Callable[[], Any]:
        listener = mods.connector.MoRIIOConnectorWorker._moriio_handshake_listener
        event = None if ready == "none" else threading.Event()
        if ready == "already-set" and event is not None:
            event.set()
        return lambda: listener({}, event, base_port, 0, 0, {})

    unpatched, patched = _both(target)
    assert patched in (None, unpatched)  # None: the failure is recorded for the waiter instead


NOTIFY = st.sampled_from(["none", "already-running"])


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(notify=NOTIFY)
def test_async_wait_reqid_never_raises_where_vllm_does_not(mods: Any, notify: str) -> None:
    """notify_port None (vLLM asserts) and a listener already started (vLLM returns)."""

    def target() -> Callable[[], Any]:
        wrapper = mods.engine.MoRIIOWrapper.__new__(mods.engine.MoRIIOWrapper)
        wrapper.notify_port = None if notify == "none" else 1
        wrapper.notify_thread = threading.current_thread() if notify == "already-running" else None
        return lambda: wrapper.async_wait_reqid()

    unpatched, patched = _both(target)
    assert patched == unpatched


LAYERS = st.dictionaries(
    st.sampled_from(["model.layers.0.self_attn.attn", "model.layers.7.mlp", "other"]),
    st.sampled_from(["none", "int", "cache"]),
    max_size=3,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layers=LAYERS)
def test_register_kv_caches_never_raises_where_vllm_does_not(
    make_worker: Callable[..., Any], held: list[int], layers: dict[str, str]
) -> None:
    """kv_caches shapes that vLLM rejects before it starts a listener: the same error patched."""
    cache = kv_caches()["model.layers.0.self_attn.attn"]
    real = layers.get("model.layers.0.self_attn.attn")
    if real == "cache":  # reaches the listeners: the start-up tests cover it
        layers = {**layers, "model.layers.0.self_attn.attn": "none"}
    values = {"none": None, "int": 3, "cache": cache}
    caches = {name: values[kind] for name, kind in layers.items()}

    def target() -> Callable[[], Any]:
        worker = make_worker(0, 0, 1, 1, handshake=held[0], notify=held[1])
        return lambda: worker.register_kv_caches(caches)

    unpatched, patched = _both(target)
    assert patched == unpatched
    assert unpatched is not None  # vLLM rejected it before any listener started
