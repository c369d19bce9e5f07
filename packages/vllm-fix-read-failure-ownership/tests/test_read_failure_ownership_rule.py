"""The ownership rule alone (no vLLM)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_fix_read_failure_ownership.rule import (
    COMPLETE,
    FAIL_CLOSED,
    RECOVER_FAILED,
    RECOVER_TIMED_OUT,
    WAIT,
    Outcome,
    classify,
    ownership,
)


@pytest.mark.parametrize(
    ("outcome", "hybrid", "expected"),
    [
        (Outcome.DONE, False, COMPLETE),
        (Outcome.DONE, True, COMPLETE),
        (Outcome.FAILED, False, RECOVER_FAILED),
        (Outcome.FAILED, True, FAIL_CLOSED),
        (Outcome.TIMED_OUT, False, RECOVER_TIMED_OUT),
        (Outcome.TIMED_OUT, True, FAIL_CLOSED),
        (Outcome.PENDING, False, WAIT),
        (Outcome.PENDING, True, WAIT),
    ],
)
def test_ownership_table(outcome: Outcome, hybrid: bool, expected: object) -> None:
    assert ownership(outcome, hybrid=hybrid) == expected


def test_fail_closed_touches_nothing() -> None:
    assert FAIL_CLOSED.fail_closed
    assert not (FAIL_CLOSED.release or FAIL_CLOSED.report or FAIL_CLOSED.drop or FAIL_CLOSED.completed)


def pending_at(age: float | None, *, has_statuses: bool = True, done: bool = False) -> Outcome:
    return classify(has_statuses=has_statuses, done=done, failed=False, age=age, timeout=120.0)


def test_timeout_is_strict() -> None:
    assert pending_at(120.0) is Outcome.PENDING
    assert pending_at(121.0) is Outcome.TIMED_OUT
    assert pending_at(None) is Outcome.PENDING


def test_no_statuses_is_never_done() -> None:
    assert pending_at(1.0, has_statuses=False, done=True) is Outcome.PENDING
    assert pending_at(200.0, has_statuses=False, done=True) is Outcome.TIMED_OUT


@given(
    has_statuses=st.booleans(),
    verdict=st.sampled_from(["done", "failed", "pending"]),
    age=st.none() | st.floats(min_value=0, max_value=1e6),
    timeout=st.floats(min_value=0, max_value=1e3),
    hybrid=st.booleans(),
)
def test_rule_invariants(
    has_statuses: bool, verdict: str, age: float | None, timeout: float, hybrid: bool
) -> None:
    outcome = classify(
        has_statuses=has_statuses,
        done=verdict == "done",
        failed=verdict == "failed",
        age=age,
        timeout=timeout,
    )
    plan = ownership(outcome, hybrid=hybrid)
    # A failure is never completed or waited out; success never depends on age.
    if verdict == "failed":
        assert outcome is Outcome.FAILED
    if verdict == "done" and has_statuses:
        assert outcome is Outcome.DONE
    # Hybrid: never reports block ids, only releases a completed transfer, drops only then.
    if hybrid:
        assert not plan.report
        assert plan.release == plan.drop == plan.completed == (outcome is Outcome.DONE)
        assert plan.fail_closed == (outcome in (Outcome.FAILED, Outcome.TIMED_OUT))
    # Nothing is dropped silently: a drop is a completion or a report.
    if plan.drop:
        assert plan.completed or plan.report
    # A fail-closed verdict does nothing else.
    if plan.fail_closed:
        assert (plan.release, plan.report, plan.drop) == (False, False, False)
