"""Runners whose execute_model collects the KV connector output before the drafter runs
(vLLM 0.15 - 0.21 and forks built from them), on the real installed vLLM.

These run only where the installed runner has that shape (the package sessions use 0.32.0 and
0.33.0, where they skip; run them ad hoc on an older base, e.g. 0.20.2). The step is the probe's
(its stand-ins: ``stand_ins.py``): vLLM's real ``ActiveKVConnector.post_forward`` called as
execute_model calls it, then vLLM's real ``GPUModelRunner.sample_tokens`` and
``AsyncOutput.get_output``.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_fix_core import Answer, PatchSet, Settings, evaluate
from vllm_fix_spec_kv_readiness import FIX, patch, probe, stand_ins
from vllm_fix_testing import assert_every_target_observed

LADDER = Settings(disabled=frozenset(), strict=False)


def _shape() -> str:
    try:
        return patch.recognize()
    except Exception as exc:
        return f"refused: {exc!r}"


pytestmark = pytest.mark.skipif(
    not _shape().startswith(patch.IN_EXECUTE),
    reason="this vLLM's sample_tokens collects the KV connector output itself (0.22+)",
)


@pytest.fixture
def applied() -> Iterator[PatchSet]:
    patches = PatchSet(FIX.id)
    patch.apply(patches, patch.recognize())
    try:
        yield patches
    finally:
        patches.revert()


def test_ladder_fixes_and_every_target_is_observed() -> None:
    decisions = assert_every_target_observed(FIX)
    assert list(decisions) == [
        "ActiveKVConnector.post_forward",
        "GPUModelRunner.sample_tokens",
        "AsyncOutput.get_output",
    ]
    decision = evaluate(FIX, LADDER, apply=True, honour_disable=False)
    try:
        assert decision.answer is Answer.AFFECTED_FIXED, decision.reason
        assert "kv-output-misses-step-saves" in decision.reason
    finally:
        if decision.patch is not None:
            decision.patch.revert()


def test_negative_control_unpatched_output_misses_the_draft_save() -> None:
    outcome = probe.run_step(speculative=True, read_publisher=True)
    assert set(outcome.kv_output.finished_sending or ()) == {"r-target"}
    assert outcome.step.at(stand_ins.DRAIN) < outcome.step.at(stand_ins.DRAFT_DONE)


def test_patched_output_covers_target_and_draft_saves(applied: PatchSet) -> None:
    outcome = probe.run_step(speculative=True, read_publisher=True)
    assert set(outcome.kv_output.finished_sending or ()) == {"r-target", "r-draft"}
    log = outcome.step.entries
    assert log.count(stand_ins.DRAIN) == 1
    assert log.index(stand_ins.DRAFT_DONE) < log.index("wait_for_save") < log.index(stand_ins.DRAIN)
    assert log.index(stand_ins.DRAIN) < log.index("clear_connector_metadata")
    assert any(
        e.name == "step-done" and e.recorded_at > log.index(stand_ins.DRAFT_DONE) for e in outcome.step.synced
    )


def test_non_speculative_step_and_no_forward_call_are_not_deferred(applied: PatchSet) -> None:
    plain = probe.run_step(speculative=False, read_publisher=True)
    assert plain.step.count(stand_ins.DRAIN) == 1
    assert plain.step.at(stand_ins.DRAIN) < plain.step.at("record:copy")
    step = stand_ins.Step()
    active = stand_ins.active_connector(stand_ins.Connector(step, read_publisher=True), speculative=True)
    out = active.post_forward(SimpleNamespace(finished_req_ids=set()), wait_for_save=False)
    assert step.entries == [stand_ins.DRAIN, "invalid_blocks_collected", "clear_connector_metadata"]
    assert out is not None and not patch._PENDING


def test_pipeline_parallel_keeps_vllms_order(applied: PatchSet) -> None:
    step = stand_ins.Step()
    active = stand_ins.active_connector(stand_ins.Connector(step, read_publisher=True), speculative=True)
    active.vllm_config.parallel_config = SimpleNamespace(pipeline_parallel_size=2)
    active.post_forward(SimpleNamespace(finished_req_ids=set()))
    assert step.count(stand_ins.DRAIN) == 1 and not patch._PENDING


class _DraftFailed(Exception):
    pass


def _failing_drafter(monkeypatch: pytest.MonkeyPatch) -> None:
    def propose(self: Any, *args: Any, **kwargs: Any) -> Any:
        self.connector.save_kv_layer(stand_ins.DRAFT_LAYER, None, None)
        raise _DraftFailed

    monkeypatch.setattr(stand_ins.Drafter, "propose", propose)


def test_failing_draft_still_collects_once(applied: PatchSet, monkeypatch: pytest.MonkeyPatch) -> None:
    """sample_tokens raising: the same exception, and the deferred collection still ran (saves
    waited for, metadata cleared), as vLLM had done before the draft."""
    _failing_drafter(monkeypatch)
    with pytest.raises(_DraftFailed):
        probe.run_step(speculative=True, read_publisher=True)
    assert not patch._PENDING


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    form=st.sampled_from(["positional", "keyword", "wait-false", "clear-false", "none-finished"]),
    disabled=st.booleans(),
    speculative=st.booleans(),
    pipeline=st.sampled_from([1, 2, None]),
)
def test_post_forward_raises_patched_exactly_where_vllm_does(
    form: str, disabled: bool, speculative: bool, pipeline: Any
) -> None:
    """Every call form post_forward's signature allows: patched raises where vLLM's own raises."""
    from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

    params = ActiveKVConnector.post_forward.__code__.co_varnames
    finished = None if form == "none-finished" else set()
    sched = SimpleNamespace(finished_req_ids=finished)
    calls = {
        "positional": ((sched,), {}),
        "keyword": ((), {"scheduler_output": sched}),
        "wait-false": ((sched,), {"wait_for_save": False}),
        "clear-false": ((sched,), {"clear_metadata": False} if "clear_metadata" in params else {}),
        "none-finished": ((sched,), {}),
    }
    args, kwargs = calls[form]

    def run() -> tuple[str, Any]:
        step = stand_ins.Step()
        active = stand_ins.active_connector(stand_ins.Connector(step, read_publisher=True), speculative)
        active.vllm_config.parallel_config = SimpleNamespace(pipeline_parallel_size=pipeline)
        active._disabled = disabled
        try:
            active.post_forward(*args, **kwargs)
        except Exception as exc:
            return type(exc).__name__, None
        return "ok", None

    unpatched = run()
    patches = PatchSet(FIX.id)
    patch.apply(patches, patch.recognize())
    try:
        patched = run()
    finally:
        patches.revert()
    assert patched[0] in ("ok", unpatched[0]), (unpatched, patched)


@pytest.mark.parametrize(
    ("name", "broken"),
    [
        ("defers_collection", lambda active: False),  # never defers: the early drain stays
        ("needs_step_done", lambda active: False),  # never waits: the output stays unready
        ("copy_into", lambda placeholder, fresh: None),  # the stored output is never filled
    ],
)
def test_breaking_the_rule_the_patch_uses_fails_verification(
    name: str, broken: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe's answer does not come from the rule: broken at the reference patch.py holds,
    the ladder says "failed to fix" (and reverts)."""
    monkeypatch.setattr(patch, name, broken)
    decision = evaluate(FIX, LADDER, apply=True, honour_disable=False)
    if decision.patch is not None and decision.answer is Answer.AFFECTED_FIXED:
        decision.patch.revert()
    assert decision.answer is Answer.FAILED_TO_FIX, decision.reason
