"""Negative controls, positive checks and guards on the installed, real vLLM (spec §3.4).

Every scenario runs vLLM's real ``MoRIIOConnectorWorker.get_finished`` (READ consumer),
which calls ``_pop_done_transfers``; only the MORI engine is stood in for
(vllm_fix_testing). ``patched`` selects unpatched vLLM or vLLM under ``applied(FIX)``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from types import SimpleNamespace
from typing import Any

import pytest
from packaging.version import Version

from vllm_fix_core import (
    Answer,
    FixRefused,
    NotApplicable,
    PatchSet,
    Settings,
    UnknownShape,
    ast_fingerprint,
    evaluate,
    runtime,
)
from vllm_fix_core.patching import layers_of, original_of
from vllm_fix_read_failure_ownership import FIX, patch, probe
from vllm_fix_testing import (
    STRICT,
    FakeWrapper,
    applied,
    assert_hostile_wrapper_fails,
    done,
    failed,
    pending,
    vllm_version,
)

# 0.34.0 ships 0.33.0's _pop_done_transfers unchanged (same fingerprint, same _send_read_release).
EXPECTED_SHAPE = {
    Version("0.32.0"): "vllm-0.32.0",
    Version("0.33.0"): "vllm-0.33.0",
    Version("0.34.0"): "vllm-0.33.0",
}
EXPECTED_FINGERPRINT = {
    Version("0.32.0"): "e36833d400c2f75a",
    Version("0.33.0"): "692d6197971f9783",
    Version("0.34.0"): "692d6197971f9783",
}

# (statuses, seconds since the READ was posted): the four cases of §3.4.
NEGATIVE_CONTROLS = {
    "failed-pending": (["failed", "pending"], 1.0),
    "pending-failed": (["pending", "failed"], 1.0),
    "failed-done": (["failed", "done"], 1.0),
    "pending-121s": (["pending"], 121.0),
}
MAKE = {"failed": failed, "pending": pending, "done": done}


def fix_state(patched: bool) -> AbstractContextManager[Any]:
    if patched:
        return applied(FIX)
    runtime.revert(FIX)
    return nullcontext()


def one_read(kit: SimpleNamespace, states: list[str], *, hybrid: bool, age: float) -> Any:
    h = kit.build_worker(hybrid=hybrid)
    read = kit.Read("req", "tx", [7, 8], {"attn0": [MAKE[s]() for s in states]})
    h.add(read, started=kit.NOW - age)
    return h


def transfer_error(kit: SimpleNamespace) -> type[BaseException]:
    return kit.mc().TransferError  # type: ignore[no-any-return]


# -- negative controls and positive checks -------------------------------------------


def assert_fails_closed(kit: SimpleNamespace, h: Any) -> None:
    """The §3.3 hybrid row: TransferError, no release, tracking kept, no block ids."""
    raised = h.finish()
    assert isinstance(raised, transfer_error(kit)), f"did not fail closed: {raised!r}"
    assert "req" in str(raised)
    assert h.wrapper.sent == []
    assert h.tracked("req") == dict.fromkeys(("transfers", "callback", "start", "blocks"), True)
    assert h.worker.get_block_ids_with_load_errors() == set()


@pytest.mark.parametrize("case", list(NEGATIVE_CONTROLS))
def test_negative_control_unpatched(kit: SimpleNamespace, clock: Any, case: str) -> None:
    """Negative control: on vLLM as shipped (both releases) the check fails, with the bug's outcome."""
    states, age = NEGATIVE_CONTROLS[case]
    with fix_state(False):
        h = one_read(kit, states, hybrid=True, age=age)
        with pytest.raises(AssertionError, match="did not fail closed"):
            assert_fails_closed(kit, h)
    # What happened instead: tracking dropped silently, nothing reported; the failure
    # branch also released the producer's blocks while a read may be in flight.
    assert h.tracked("req") == dict.fromkeys(("transfers", "callback", "start", "blocks"), False)
    assert h.worker.get_block_ids_with_load_errors() == set()
    expected = [] if case == "pending-121s" else [("tx", p) for p in kit.holders()]
    assert h.releases() == expected


@pytest.mark.parametrize("case", list(NEGATIVE_CONTROLS))
def test_positive_check_patched(kit: SimpleNamespace, clock: Any, case: str) -> None:
    """Positive check: the same scenario and check under the fix."""
    states, age = NEGATIVE_CONTROLS[case]
    with fix_state(True):
        h = one_read(kit, states, hybrid=True, age=age)
        assert_fails_closed(kit, h)
        # Still failing closed on the next step: nothing was consumed.
        assert_fails_closed(kit, h)


# -- regression guards: same outcome unpatched and patched ---------------------------


@pytest.mark.parametrize("patched", [False, True], ids=["unpatched", "patched"])
def test_hybrid_success_releases_once_per_holder(kit: SimpleNamespace, clock: Any, patched: bool) -> None:
    with fix_state(patched):
        h = one_read(kit, ["done", "done"], hybrid=True, age=1.0)
        assert h.finish() is None
        assert h.releases() == [("tx", p) for p in kit.holders()]
        assert [n.message_fields for n in h.wrapper.sent] == [{"consumer_tp_size": 1}] * len(kit.holders())
        assert h.wrapper.sent[0].host == kit.HOST
        assert not any(h.tracked("req").values())
        assert h.finish() is None
        assert len(h.releases()) == len(kit.holders())  # never a second release


@pytest.mark.parametrize("patched", [False, True], ids=["unpatched", "patched"])
def test_hybrid_pending_at_timeout_changes_nothing(kit: SimpleNamespace, clock: Any, patched: bool) -> None:
    with fix_state(patched):
        h = one_read(kit, ["pending"], hybrid=True, age=kit.TIMEOUT)
        assert h.finish() is None
        assert h.wrapper.sent == []
        assert all(h.tracked("req").values())
        assert h.worker.get_block_ids_with_load_errors() == set()


@pytest.mark.parametrize("patched", [False, True], ids=["unpatched", "patched"])
def test_attention_failure_reports_once_and_releases(kit: SimpleNamespace, clock: Any, patched: bool) -> None:
    with fix_state(patched):
        h = one_read(kit, ["failed", "pending"], hybrid=False, age=1.0)
        assert h.finish() is None
        assert h.releases() == [("tx", p) for p in kit.holders()]
        assert not any(h.tracked("req").values())
        assert h.worker.get_block_ids_with_load_errors() == {7, 8}
        assert h.worker.get_block_ids_with_load_errors() == set()
        assert h.finish() is None
        assert len(h.releases()) == len(kit.holders())


@pytest.mark.parametrize("patched", [False, True], ids=["unpatched", "patched"])
def test_attention_timeout_reports_without_release(kit: SimpleNamespace, clock: Any, patched: bool) -> None:
    with fix_state(patched):
        h = one_read(kit, ["pending"], hybrid=False, age=kit.TIMEOUT + 1)
        assert h.finish() is None
        assert h.wrapper.sent == []
        assert not any(h.tracked("req").values())
        assert h.worker.get_block_ids_with_load_errors() == {7, 8}


@pytest.mark.parametrize("patched", [False, True], ids=["unpatched", "patched"])
def test_attention_release_error_is_logged_not_raised(
    kit: SimpleNamespace, clock: Any, patched: bool, caplog: pytest.LogCaptureFixture
) -> None:
    with fix_state(patched):
        h = one_read(kit, ["failed"], hybrid=False, age=1.0)
        h.wrapper.notify_error = OSError("socket gone")
        with caplog.at_level(logging.ERROR):
            assert h.finish() is None
        assert any(r.exc_info and "req" in r.getMessage() for r in caplog.records)
        assert not any(h.tracked("req").values())
        assert h.worker.get_block_ids_with_load_errors() == {7, 8}


# -- beyond the four cases ------------------------------------------------------------


def test_mixed_step_completes_done_reads_then_fails_closed(kit: SimpleNamespace, clock: Any) -> None:
    with fix_state(True):
        h = kit.build_worker(hybrid=True)
        h.add(kit.Read("ok", "tx-ok", [1], {"a": [done()], "m": [done()]}), started=kit.NOW - 1)
        bad = {"a": [failed("cq error", 12)], "m": [pending()]}
        h.add(kit.Read("bad", "tx-bad", [2], bad), started=kit.NOW - 1)
        h.add(kit.Read("slow", "tx-slow", [3], {"a": [pending()]}), started=kit.NOW - 500)
        raised = h.finish()
        assert isinstance(raised, transfer_error(kit))
        assert "bad" in str(raised) and "cq error" in str(raised) and "slow" in str(raised)
        # The completed transfer is released once and forgotten; the others are untouched.
        assert h.releases() == [("tx-ok", p) for p in kit.holders()]
        assert not any(h.tracked("ok").values())
        assert all(h.tracked("bad").values()) and all(h.tracked("slow").values())
        assert h.worker.get_block_ids_with_load_errors() == set()
        assert isinstance(h.finish(), transfer_error(kit))
        assert h.releases() == [("tx-ok", p) for p in kit.holders()]


def test_status_failing_between_polls(kit: SimpleNamespace, clock: Any) -> None:
    """A status that turns failed after a pending poll fails closed on the next poll."""
    from vllm_fix_testing import FakeStatus

    with fix_state(True):
        h = kit.build_worker(hybrid=True)
        flipping = FakeStatus(script=["pending", "failed"])
        h.add(kit.Read("req", "tx", [7], {"a": [done(), flipping]}), started=kit.NOW - 1)
        assert h.finish() is None
        assert all(h.tracked("req").values())
        assert isinstance(h.finish(), transfer_error(kit))
        assert h.wrapper.sent == [] and all(h.tracked("req").values())


def test_pending_then_done_releases_once(kit: SimpleNamespace, clock: Any) -> None:
    with fix_state(True):
        h = kit.build_worker(hybrid=True)
        late = pending()
        h.add(kit.Read("req", "tx", [7], {"a": [done(), late]}), started=kit.NOW - 1)
        assert h.finish() is None and h.wrapper.sent == []
        late.succeed()
        assert h.finish() is None
        assert h.releases() == [("tx", p) for p in kit.holders()]


# -- no more worker state than vLLM's own body reads ------------------------------------


def bare_worker(states: list[str], ports: Any) -> tuple[Any, FakeWrapper]:
    """A worker as vLLM's own tests build one for the completion path: ``__new__`` plus
    exactly what vLLM's ``_pop_done_transfers`` reads there (no ``_has_mamba``)."""
    cls = patch._mc().MoRIIOConnectorWorker
    worker = cls.__new__(cls)
    wrapper = FakeWrapper()
    worker.world_size = 8
    worker.moriio_config = SimpleNamespace(recv_abort_timeout=600.0)
    worker.moriio_wrapper = wrapper
    worker._recving_transfers = {"req": {"layer0": [MAKE[s]() for s in states]}}
    worker._recving_transfers_callback_addr = {"req": ("127.0.0.1", ports, "tx")}
    worker._recving_transfers_start = {"req": float("inf")}
    worker._recving_local_blocks = {"req": [1, 2]}
    worker._invalid_block_ids = set()
    return worker, wrapper


@pytest.mark.parametrize("patched", [False, True], ids=["unpatched", "patched"])
def test_completed_and_pending_reads_need_no_hybrid_flag(kit: SimpleNamespace, patched: bool) -> None:
    """vLLM decides a completed or still-pending READ without reading ``_has_mamba``;
    the fix must too (it reads the flag only for a READ that failed or timed out)."""
    ports = kit.holder_ports() if isinstance(kit.holder_ports(), tuple) else "7000"
    with fix_state(patched):
        worker, wrapper = bare_worker(["done", "done"], ports)
        assert worker._pop_done_transfers() == {"tx"}
        assert len(wrapper.releases()) == len(kit.holders())
        assert [n.message_fields for n in wrapper.sent] == [{"consumer_tp_size": 8}] * len(kit.holders())
        worker, wrapper = bare_worker(["done", "pending"], ports)
        assert worker._pop_done_transfers() == set()
        assert "req" in worker._recving_transfers and wrapper.sent == []


# -- probe, shape, idempotence, revert ---------------------------------------------------


def test_probe_observes_vllm_not_the_fix() -> None:
    """With vLLM's original body layered back over the fix, the ladder must say
    "failed to fix" and revert exactly (strict: FixFailed)."""
    runtime.revert(FIX)
    decision = assert_hostile_wrapper_fails(FIX)
    assert decision.after is not None and decision.after.affected


def test_no_hybrid_read_is_not_applicable(monkeypatch: pytest.MonkeyPatch) -> None:
    """A vLLM without hybrid READ (before 0.31.0) has no code this bug lives in: the
    answer is "not applicable", not "refused", and nothing is patched."""
    runtime.revert(FIX)
    cls = patch._mc().MoRIIOConnectorWorker
    original = cls.__dict__["_pop_done_transfers"]
    monkeypatch.delattr(cls, probe.HYBRID_READ)
    with pytest.raises(NotApplicable, match="hybrid"):
        probe.probe()
    decision = evaluate(FIX, Settings(disabled=frozenset(), strict=True), apply=True)
    assert decision.answer is Answer.NOT_APPLICABLE
    assert cls.__dict__["_pop_done_transfers"] is original
    assert layers_of(cls, "_pop_done_transfers") == []


def test_probe_says_affected_then_fixed() -> None:
    runtime.revert(FIX)
    before = FIX.run_probe()
    assert before.affected
    assert before.names(True) == ["hybrid-failure-fails-open", "hybrid-timeout-fails-open"]
    assert before.broken_guards == []
    with applied(FIX) as decision:
        assert decision.shape == EXPECTED_SHAPE[vllm_version()]
        after = FIX.run_probe()
        assert not after.affected and after.broken_guards == []


def test_probe_leaves_no_global_state_behind() -> None:
    mc = patch._mc()
    monotonic = time.monotonic
    filters = (list(mc.logger.filters), list(logging.getLogger(probe.FIX_LOGGER).filters))
    probe.probe()
    assert time.monotonic is monotonic
    assert (list(mc.logger.filters), list(logging.getLogger(probe.FIX_LOGGER).filters)) == filters


def test_probe_lines_do_not_reach_the_log(caplog: pytest.LogCaptureFixture) -> None:
    runtime.revert(FIX)
    with caplog.at_level(logging.DEBUG):
        probe.run(["failed"], hybrid=True, age=1.0)  # unfiltered: caplog does see these lines
        assert [r for r in caplog.records if probe.REQ in r.getMessage()]
        caplog.clear()
        probe.probe()
        with applied(FIX):
            probe.probe()
    assert not [r for r in caplog.records if probe.REQ in r.getMessage()]


def test_shape_drift_guard() -> None:
    runtime.revert(FIX)
    cls = patch._mc().MoRIIOConnectorWorker
    assert ast_fingerprint(cls.__dict__["_pop_done_transfers"]) == EXPECTED_FINGERPRINT[vllm_version()]
    assert patch.recognize() == EXPECTED_SHAPE[vllm_version()]
    # The shape names the release path this vLLM really has.
    assert hasattr(cls, "_send_read_release") == (patch.recognize() == "vllm-0.33.0")


def _foreign_body(self: Any) -> set[str]:
    """Stands in for a vLLM build we do not know: swallows everything."""
    with self.moriio_wrapper.lock:
        self._recving_transfers.clear()
        self._recving_transfers_callback_addr.clear()
    return set()


def _fixed_body(self: Any) -> set[str]:
    """Stands in for an upstream build that already fails closed."""
    with self.moriio_wrapper.lock:
        for by_layer in self._recving_transfers.values():
            statuses = [s for layer in by_layer.values() for s in layer]
            if any(s.Failed() for s in statuses) and self._has_mamba:
                raise patch._mc().TransferError("upstream fails closed")
    return set()


def test_unknown_shape_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    runtime.revert(FIX)
    cls = patch._mc().MoRIIOConnectorWorker
    monkeypatch.setattr(cls, "_pop_done_transfers", _foreign_body)
    with pytest.raises(UnknownShape, match="fingerprint"):
        patch.recognize()
    with pytest.raises(FixRefused):
        runtime.apply(FIX, STRICT)
    runtime.revert(FIX)
    assert cls.__dict__["_pop_done_transfers"] is _foreign_body
    assert layers_of(cls, "_pop_done_transfers") == []


def test_already_fixed_marker(monkeypatch: pytest.MonkeyPatch) -> None:
    runtime.revert(FIX)
    cls = patch._mc().MoRIIOConnectorWorker
    assert not patch.fails_closed_for_hybrid(cls.__dict__["_pop_done_transfers"])
    assert patch.fails_closed_for_hybrid(_fixed_body)
    monkeypatch.setattr(cls, "_pop_done_transfers", _fixed_body)
    with pytest.raises(UnknownShape, match="already raises"):
        patch.recognize()


def test_missing_helper_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    runtime.revert(FIX)
    cls = patch._mc().MoRIIOConnectorWorker
    monkeypatch.delattr(cls, "_record_failed_recv")
    with pytest.raises(UnknownShape, match="_record_failed_recv"):
        patch.recognize()


def test_apply_is_idempotent_and_revert_exact() -> None:
    runtime.revert(FIX)
    cls = patch._mc().MoRIIOConnectorWorker
    original = cls.__dict__["_pop_done_transfers"]
    with applied(FIX) as first:
        installed = cls.__dict__["_pop_done_transfers"]
        assert installed is patch.REPLACEMENTS[EXPECTED_SHAPE[vllm_version()]]
        assert original_of(cls, "_pop_done_transfers") is original
        assert runtime.apply(FIX, STRICT) is first  # the runtime does not apply twice
        again = PatchSet(FIX.id)
        patch.apply(again, first.shape or "")
        assert cls.__dict__["_pop_done_transfers"] is installed
        assert layers_of(cls, "_pop_done_transfers") == [FIX.id]
        assert patch.recognize() == first.shape  # still the vLLM shape underneath
    assert cls.__dict__["_pop_done_transfers"] is original
    assert layers_of(cls, "_pop_done_transfers") == []


def test_unknown_shape_name_is_not_applied() -> None:
    with pytest.raises(UnknownShape):
        patch.apply(PatchSet(FIX.id), "vllm-9.9.9")


def test_decision_is_applied_in_strict_mode() -> None:
    runtime.revert(FIX)
    decision = runtime.apply(FIX, STRICT)
    try:
        assert decision.answer is Answer.AFFECTED_FIXED
        assert decision.before is not None and decision.before.affected
    finally:
        runtime.revert(FIX)


@pytest.fixture(autouse=True)
def _always_revert() -> Iterator[None]:
    yield
    runtime.revert(FIX)
