"""Real vLLM, whichever release is installed (0.14.1-0.33.0): the fix attaches where the bug lives.

MoRIIO entered vLLM in 0.14.0; MultiConnector's anonymous completion counting is in every
release since, in three scheduler-side shapes (read in each release's multi_connector.py):

* 0.14.1-0.17.1: ``request_finished`` counts the children's answers itself and
  ``update_connector_output`` hands every child the same output (no per-child worker metadata);
* 0.18.1-0.20.2: ``request_finished`` still counts itself; each child gets its own worker metadata;
* 0.21.0-0.33.0: ``request_finished`` delegates to ``_aggregate_request_finished``.

The table below is written from those sources (not from patch.py). The package's sessions run
this file on 0.17.1, 0.32.0 and 0.33.0; every other release is covered by the matrix sessions.
"""

from __future__ import annotations

from typing import Any

import pytest
from packaging.version import Version

from vllm_fix_completion_ownership import FIX
from vllm_fix_core import Answer, Settings, UnknownShape, evaluate, layers_of
from vllm_fix_testing import vllm_version
from vllm_fix_testing.hostile import assert_every_target_observed

COMMON = {
    "get_num_new_matched_tokens",
    "build_connector_meta",
    "update_connector_output",
    "bind_connector_metadata",
}
# (first release of the era, shape the ladder reports, MultiConnector methods the fix patches there)
ERAS: list[tuple[str, str, set[str]]] = [
    ("0.14.0", "get-finished+request-finished+shared-output", COMMON | {"request_finished", "get_finished"}),
    ("0.18.0", "get-finished+request-finished", COMMON | {"request_finished", "get_finished"}),
    ("0.21.0", "get-finished", COMMON | {"_aggregate_request_finished", "get_finished"}),
    (
        "0.30.0",
        "transfer-results",
        COMMON | {"_aggregate_request_finished", "register_finished_partial_tail", "get_transfer_results"},
    ),
]
# What the probe reports before the fix (partial tails exist from 0.30.0 on).
BUG = {"swallowed-completion", "early-completion", "stray-completion", "stray-recving"}


def era() -> tuple[str, set[str]]:
    installed = vllm_version()
    matching = [(shape, names) for first, shape, names in ERAS if installed >= Version(first)]
    if not matching:
        pytest.skip(f"vLLM {installed} has no MoRIIO (it entered in 0.14.0)")
    return matching[-1]


def multi_connector_class() -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1 import multi_connector

    return multi_connector.MultiConnector


def ladder() -> Any:
    return evaluate(FIX, Settings(disabled=frozenset(), strict=False), apply=True, honour_disable=False)


def test_affected_then_fixed_with_this_releases_shape() -> None:
    shape, names = era()
    report = FIX.run_probe()
    expected_bug = BUG | ({"partial-tail-owner-ignored"} if vllm_version() >= Version("0.30.0") else set())
    assert set(report.names(True)) == expected_bug, report.summary()
    decision = ladder()
    try:
        assert decision.answer is Answer.AFFECTED_FIXED, decision.reason
        assert decision.shape == shape
        assert decision.patch is not None
        assert {attr for _, attr in decision.patch.targets} == names
    finally:
        if decision.patch is not None:
            decision.patch.revert()
    assert FIX.run_probe().affected  # reverted


def test_every_patched_target_is_observed_on_this_release() -> None:
    _, names = era()
    assert set(assert_every_target_observed(FIX)) == {f"MultiConnector.{n}" for n in names}


def test_request_finished_patched_only_where_it_counts_itself() -> None:
    # 0.21.0+: request_finished only delegates; the per-request hot path there is
    # _aggregate_request_finished, and request_finished keeps vLLM's own function object.
    era()
    cls = multi_connector_class()
    own = cls.__dict__["request_finished"]
    decision = ladder()
    try:
        assert decision.answer is Answer.AFFECTED_FIXED, decision.reason
        if "_aggregate_request_finished" in cls.__dict__:
            assert cls.__dict__["request_finished"] is own
            assert layers_of(cls, "request_finished") == []
        else:
            assert layers_of(cls, "request_finished") == [FIX.id]
    finally:
        if decision.patch is not None:
            decision.patch.revert()
    assert cls.__dict__["request_finished"] is own


def _other_counting(self: Any, request: Any, blocks: list[int]) -> tuple[bool, dict[str, Any] | None]:
    saves = [c.request_finished(request, blocks) for c in self._connectors]
    return any(s for s, _ in saves), None


def test_unknown_counting_request_finished_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # A MultiConnector without _aggregate_request_finished whose request_finished counts the
    # children in a body we have not read (a fork's): that body would be replaced, so the
    # ladder refuses and patches nothing.
    era()
    from vllm_fix_completion_ownership.patch import recognize

    cls = multi_connector_class()
    for helper in ("_aggregate_request_finished", "request_finished_all_groups"):  # 0.21.0+
        if helper in cls.__dict__:
            monkeypatch.delattr(cls, helper)
    monkeypatch.setattr(cls, "request_finished", _other_counting)
    assert FIX.run_probe().affected  # the bug is seen; the body is what cannot be recognised
    with pytest.raises(UnknownShape, match="request_finished"):
        recognize()
    decision = ladder()
    assert decision.answer is Answer.REFUSED, decision.reason
    assert decision.patch is None


def test_broken_owner_recording_makes_verify_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    # The rule the fix uses, broken at the reference state.py holds: finished requests are recorded
    # with no owner. Whatever records them on this release (request_finished or
    # _aggregate_request_finished), the probe must see the bug and the ladder revert.
    _, names = era()
    from vllm_fix_completion_ownership import state as state_module
    from vllm_fix_completion_ownership.ledger import SchedulerLedger

    class Broken(SchedulerLedger):
        def record_finished(self, req_id: str, owners: int) -> tuple[int, ...]:
            return super().record_finished(req_id, 0)

    cls = multi_connector_class()
    originals = {n: cls.__dict__[n] for n in names}
    with monkeypatch.context() as m:
        m.setattr(state_module, "SchedulerLedger", Broken)
        decision = ladder()
    assert decision.answer is Answer.FAILED_TO_FIX, decision.reason
    assert "swallowed-completion=affected" in decision.reason
    assert all(cls.__dict__[n] is originals[n] for n in names)
    assert all(layers_of(cls, n) == [] for n in names)
