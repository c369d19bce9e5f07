"""The WRITE-mode "blocks ready" notify of ``update_state_after_alloc``, and the probe's view of it.

The sender is vLLM's real ``MoRIIOConnectorScheduler.update_state_after_alloc`` on a
decode-side scheduler as the engine core holds it: no TP group in that process (vLLM's own
``get_tensor_model_parallel_world_size`` is put back over the stand-in, so it raises as it
does there). The listeners are real prefill workers (real ``MoRIIOConnectorWorker.__init__``);
the port each binds is its ``notify_port``. ``send_notify_block`` is a recorder on the
instance, as vLLM's own scheduler tests do. The spec's answer (README, "The rule") is
written out here: prefill rank (dp, tp) listens on ``base + dp * tp_size + tp``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_fix_core import Answer, PatchSet, Settings, evaluate
from vllm_fix_handshake_port import FIX, listener, offset, patch, probe, senders
from vllm_fix_testing import applied, assert_every_target_observed
from vllm_fix_testing.hostile import target_objects

BASE = 26005
GRIDS = [(2, 2), (2, 4), (3, 2), (1, 4), (4, 1)]
LADDER = Settings(disabled=frozenset(), strict=False)


def _decode_scheduler(mods: SimpleNamespace, tp_size: int, sent: list[tuple[str, int]]) -> Any:
    """vLLM's scheduler, built by its own __init__ (the probe's builder), WRITE mode."""
    sched = probe._decode_scheduler(mods.connector, mods.common, tp_size)

    def send_notify_block(*args: Any, **kwargs: Any) -> None:
        sent.append((kwargs["host"], int(kwargs["port"])))

    sched.send_notify_block = send_notify_block
    return sched


def _blocks_ready_ports(mods: SimpleNamespace, dp: int, dp_local: int, tp_size: int) -> list[int]:
    """Where vLLM's update_state_after_alloc sends "blocks ready" for a prefill on DP rank dp."""
    sent: list[tuple[str, int]] = []
    sched = _decode_scheduler(mods, tp_size, sent)
    params = {
        "do_remote_prefill": True,
        "transfer_id": f"alloc-dp{dp}",
        "remote_dp_rank": dp,
        "is_request_leader": True,
        "remote_host": "127.0.0.1",
        "remote_notify_port": BASE,
        "remote_tp_size": tp_size,
        "remote_dp_size": dp_local,
        "remote_dp_size_local": dp_local,
    }
    request = probe._request(f"plain-request-{dp}", params)
    sched.update_state_after_alloc(request, probe._blocks(3, 4), 32)
    assert {host for host, _ in sent} <= {"127.0.0.1"}
    return sorted(port for _, port in sent)


def _prefill_listeners(
    make_worker: Callable[..., Any], dp_local: int, tp_size: int
) -> dict[tuple[int, int], int]:
    return {
        (dp, tp): int(make_worker(dp, tp, dp_local, tp_size, notify=BASE).notify_port)
        for dp in range(dp_local)
        for tp in range(tp_size)
    }


def _misses(
    mods: SimpleNamespace, listen: dict[tuple[int, int], int], dp_local: int, tp_size: int
) -> dict[int, tuple[list[int], list[int]]]:
    """DP rank -> (ports the notify went to, ports its prefill ranks listen on), where they differ."""
    misses = {}
    for dp in range(dp_local):
        want = sorted(listen[(dp, tp)] for tp in range(tp_size))
        got = _blocks_ready_ports(mods, dp, dp_local, tp_size)
        if got != want:
            misses[dp] = (got, want)
    return misses


@contextmanager
def _call_through_alloc_wrapper(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The fix's update_state_after_alloc wrapper edited into a plain call-through (all else as is)."""
    real = senders.context_wrapper

    def context_wrapper(func: Any, resolver: Any) -> Any:
        if getattr(func, "__name__", "") != "update_state_after_alloc":
            return real(func, resolver)

        def call_through(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            return wrapped(*args, **kwargs)

        return call_through

    with monkeypatch.context() as m:
        m.setattr(senders, "context_wrapper", context_wrapper)
        yield


def test_every_patched_target_is_observed() -> None:
    if not FIX.run_probe().affected:
        pytest.skip("this vLLM is not affected: the fix does not apply, nothing is patched")
    decisions = assert_every_target_observed(FIX)
    assert "MoRIIOConnectorScheduler.update_state_after_alloc" in decisions
    reason = decisions["MoRIIOConnectorScheduler.update_state_after_alloc"].reason
    assert "alloc-notify-misses-listener=BROKEN" in reason, reason


@pytest.mark.parametrize(("dp_local", "tp_size"), GRIDS)
def test_blocks_ready_notify_reaches_every_prefill_listener(
    mods: SimpleNamespace,
    make_worker: Callable[..., Any],
    engine_core_tp_group: Callable[[], None],
    dp_local: int,
    tp_size: int,
) -> None:
    """Patched, DP rank d's notify goes to exactly the ports its prefill TP ranks bind."""
    with applied(FIX):
        listen = _prefill_listeners(make_worker, dp_local, tp_size)
        engine_core_tp_group()
        assert listen == {(d, t): BASE + d * tp_size + t for d, t in listen}  # the spec's table
        assert _misses(mods, listen, dp_local, tp_size) == {}


def test_unpatched_blocks_ready_notify_matches_colliding_listeners(
    mods: SimpleNamespace, make_worker: Callable[..., Any], engine_core_tp_group: Callable[[], None]
) -> None:
    """Negative control: unpatched, sender and listeners agree on vLLM's dp + tp, which collides."""
    listen = _prefill_listeners(make_worker, 2, 2)
    engine_core_tp_group()
    assert listen[(0, 1)] == listen[(1, 0)] == BASE + 1
    assert _misses(mods, listen, 2, 2) == {}


def test_call_through_alloc_wrapper_misses_the_listeners(
    mods: SimpleNamespace,
    make_worker: Callable[..., Any],
    engine_core_tp_group: Callable[[], None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The issue's case: with that one wrapper a call-through, DP rank 1's notify goes to
    26006/26007 while its prefill ranks listen on 26007/26008 (2 x 2)."""
    with _call_through_alloc_wrapper(monkeypatch):
        layer = PatchSet(FIX.id)
        patch.apply(layer, patch.recognize())
    try:
        listen = _prefill_listeners(make_worker, 2, 2)
        engine_core_tp_group()
        assert _misses(mods, listen, 2, 2) == {1: ([BASE + 1, BASE + 2], [BASE + 2, BASE + 3])}
    finally:
        layer.revert()


def test_call_through_alloc_wrapper_fails_verification(monkeypatch: pytest.MonkeyPatch) -> None:
    before = target_objects(FIX)
    with _call_through_alloc_wrapper(monkeypatch):
        decision = evaluate(FIX, LADDER, apply=True, honour_disable=False)
    assert decision.answer is Answer.FAILED_TO_FIX, decision.reason
    assert "alloc-notify-misses-listener=BROKEN" in decision.reason
    after = target_objects(FIX)
    assert all(after[k] is v for k, v in before.items())  # the ladder reverted exactly


class _IgnoredSize:
    """listening_tp_size broken: the block runs, the size is never set."""

    def __init__(self, size: Any) -> None:
        del size

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


# The rule functions the fix calls, each broken at the reference the fix's module holds.
BROKEN_RULES: dict[str, tuple[Any, Any]] = {
    "current_listening_tp_size": (offset, lambda: None),  # senders never see the peer's TP size
    "listening_tp_size": (senders, _IgnoredSize),
    "check_layout": (listener, lambda *args, **kwargs: None),  # never rejects overlapping blocks
}


@pytest.mark.parametrize("name", sorted(BROKEN_RULES))
def test_a_broken_rule_fails_verification(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """The probe's expected answers come from vLLM's listener sites and the spec, not from
    rule.py: break what the fix calls and the ladder says "failed to fix"."""
    if not FIX.run_probe().affected:
        pytest.skip("this vLLM is not affected: the fix does not apply")
    before = target_objects(FIX)
    with monkeypatch.context() as m:
        module, broken = BROKEN_RULES[name]
        m.setattr(module, name, broken)
        decision = evaluate(FIX, LADDER, apply=True, honour_disable=False)
    assert decision.answer is Answer.FAILED_TO_FIX, decision.reason
    after = target_objects(FIX)
    assert all(after[k] is v for k, v in before.items())
    assert FIX.run_probe().affected  # nothing left applied


def test_probe_drives_the_real_handshake_dialer(mods: SimpleNamespace) -> None:
    """The dial check reads the port vLLM's own _moriio_handshake dials: a layer that makes it
    dial as if the listening engine had TP size 1 is seen."""

    def tp1(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        host, port, _, *rest = args
        return wrapped(host, port, 1, *rest, **kwargs)

    with applied(FIX):
        layer = PatchSet("dial-with-tp-size-1")
        layer.wrap(mods.connector.MoRIIOConnectorWorker, "_moriio_handshake", tp1)
        try:
            report = FIX.run_probe()
        finally:
            layer.revert()
        assert "handshake-dial-misses-listener" in report.names(True), report.summary()
        assert not FIX.run_probe().affected


def test_probe_scheduler_has_what_vllms_init_sets(
    mods: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 32: vLLM 0.34's update_state_after_alloc reads ``_is_hma_required``, which only its
    ``__init__`` sets, and the probe's scheduler (built without ``__init__``) could not be checked.
    A release whose sender reads one more attribute set in ``__init__`` is still probed."""
    cls = mods.connector.MoRIIOConnectorScheduler
    init, alloc = cls.__init__, cls.update_state_after_alloc

    @functools.wraps(init)  # the installed signature: 0.30+ take a kv_cache_config
    def init_one_more(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self._set_only_in_init = True

    def alloc_reading_it(self: Any, *args: Any, **kwargs: Any) -> Any:
        assert self._set_only_in_init  # AttributeError on a scheduler __init__ did not build
        return alloc(self, *args, **kwargs)

    monkeypatch.setattr(cls, "__init__", init_one_more)
    monkeypatch.setattr(cls, "update_state_after_alloc", alloc_reading_it)
    report = FIX.run_probe()
    assert "alloc-notify-misses-listener" not in report.names(True), report.summary()


@pytest.mark.parametrize("role", ["NOTINIT", "PRODUCER"])
def test_probe_leaves_the_moriio_role_as_it_was(mods: SimpleNamespace, role: str) -> None:
    """The scheduler's ``__init__`` sets MoRIIO's process-wide role (a decode scheduler: CONSUMER);
    after the probe, the role is the one the process had (a prefill engine core: PRODUCER)."""
    before = mods.common.get_role()
    mods.common.set_role(mods.common.ROLE[role])
    try:
        FIX.run_probe()
        assert mods.common.get_role() is mods.common.ROLE[role]
    finally:
        mods.common.set_role(before)
