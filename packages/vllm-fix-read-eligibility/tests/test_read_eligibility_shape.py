"""Recognize, apply twice, revert exactly, refuse drift, observe vLLM (not the fix)."""

from __future__ import annotations

from typing import Any

import pytest
from packaging.version import Version

from vllm_fix_core import (
    Answer,
    FixRefused,
    PatchSet,
    Settings,
    UnknownShape,
    ast_fingerprint,
    evaluate,
    layers_of,
    original_of,
    runtime,
)
from vllm_fix_read_eligibility import FIX, patch
from vllm_fix_read_eligibility.probe import PROMPT, consumer, matched
from vllm_fix_read_eligibility.rule import BlockLayout
from vllm_fix_testing import (
    STRICT,
    applied,
    assert_every_target_observed,
    assert_hostile_wrapper_fails,
    vllm_version,
)

FINGERPRINT = {
    Version("0.32.0"): "c98f56e1ca0f0001",
    Version("0.33.0"): "0a8992648f2c81ed",
    Version("0.34.0"): "0a8992648f2c81ed",  # 0.33.0's body, unchanged
}
# The shape each release's body is logged as (the release that first shipped it).
SHAPE = {Version("0.32.0"): "vllm-0.32.0", Version("0.33.0"): "vllm-0.33.0", Version("0.34.0"): "vllm-0.33.0"}
LENIENT = Settings(disabled=frozenset(), strict=False)


def scheduler_class() -> Any:
    return patch._mc().MoRIIOConnectorScheduler


def test_installed_vllm_has_a_known_shape() -> None:
    """Upstream-drift guard: fails when this release's method changes shape."""
    method = scheduler_class().__dict__[patch.TARGET]
    assert ast_fingerprint(method) == FINGERPRINT[vllm_version()]
    assert patch.block_layout() is BlockLayout.PER_GROUP  # HMA connector since 0.30.0
    assert patch.recognize() == f"{SHAPE[vllm_version()]}/per-group"


def test_apply_twice_is_a_no_op_and_revert_is_exact() -> None:
    cls = scheduler_class()
    original = cls.__dict__[patch.TARGET]
    with applied(FIX) as first:
        installed = cls.__dict__[patch.TARGET]
        assert installed is not original and original_of(cls, patch.TARGET) is original
        assert runtime.apply(FIX, STRICT) is first  # the runtime does not apply twice
        again = PatchSet(FIX.id)
        patch.apply(again, first.shape or "")  # the patch itself is idempotent per target
        assert cls.__dict__[patch.TARGET] is installed
        assert layers_of(cls, patch.TARGET) == [FIX.id]
        assert matched(consumer(), {"do_remote_prefill": True}) == (0, False)
    assert cls.__dict__[patch.TARGET] is original
    assert layers_of(cls, patch.TARGET) == []
    assert matched(consumer(), {"do_remote_prefill": True}) == (PROMPT - 1, False)


def drifted_body(self: Any, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
    """A vLLM we do not know: claims N-1 for every request (so the probe, which calls it
    like vLLM's scheduler does, runs and sees the bug) and no longer decides by
    is_producer / mode (so the wrapper's assumptions do not hold)."""
    return max(request.num_prompt_tokens - num_computed_tokens - 1, 0), False


def test_drifted_body_is_refused_by_recognize_not_by_a_crashing_probe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cls = scheduler_class()
    monkeypatch.setattr(cls, patch.TARGET, drifted_body)
    before = FIX.run_probe()  # runs fine on the drifted body, and sees the bug
    assert before.affected and before.broken_guards == []
    with pytest.raises(UnknownShape, match=r"no longer decides by self\.is_producer / self\.mode"):
        patch.recognize()
    decision = evaluate(FIX, LENIENT, apply=True)
    assert decision.answer is Answer.REFUSED
    assert "this vLLM has the bug" in decision.reason and "unknown target shape" in decision.reason
    assert cls.__dict__[patch.TARGET] is drifted_body and layers_of(cls, patch.TARGET) == []
    with pytest.raises(FixRefused):
        evaluate(FIX, STRICT, apply=True)
    assert cls.__dict__[patch.TARGET] is drifted_body


def test_drifted_signature_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    def body(self: Any, request: Any, num_computed_tokens: int, extra: int = 0) -> tuple[int, bool]:
        if self.is_producer or self.mode is None:
            return 0, False
        return drifted_body(self, request, num_computed_tokens)

    monkeypatch.setattr(scheduler_class(), patch.TARGET, body)
    assert FIX.run_probe().affected
    with pytest.raises(UnknownShape, match="unexpected signature"):
        patch.recognize()


def test_probe_observes_vllm_not_the_fix() -> None:
    """vLLM's original layered back over the fix: the ladder says "failed to fix" and
    reverts exactly (strict: FixFailed)."""
    decision = assert_hostile_wrapper_fails(FIX)
    assert decision.after is not None and decision.after.names(True) == symptoms_on_this_release()


def symptoms_on_this_release() -> list[str]:
    if vllm_version() < Version("0.33.0"):
        return ["plain-request-claims-remote-kv", "malformed-params-claim-remote-kv"]
    return ["malformed-params-claim-remote-kv"]


def test_decision_on_this_release() -> None:
    decision = runtime.apply(FIX, STRICT)
    try:
        assert decision.answer is Answer.AFFECTED_FIXED
        assert decision.before is not None and decision.before.names(True) == symptoms_on_this_release()
        assert decision.after is not None and not decision.after.affected
    finally:
        runtime.revert(FIX)


def test_every_patched_target_is_observed() -> None:
    """vLLM's original layered over each patched target alone: "failed to fix" every time
    (the fix is needed on every supported release: malformed params claim everywhere)."""
    decisions = assert_every_target_observed(FIX)
    assert list(decisions) == ["MoRIIOConnectorScheduler.get_num_new_matched_tokens"]


@pytest.mark.parametrize("broken", ["malformed_reason", "routing_reason", "needed_blocks"])
def test_a_broken_rule_fails_verification(monkeypatch: pytest.MonkeyPatch, broken: str) -> None:
    """Break what the patch module decides by, at the reference it holds: the probe, whose
    expectations come from the rule table, must say "failed to fix" and the ladder reverts."""
    answers: dict[str, object] = {"malformed_reason": None, "routing_reason": None, "needed_blocks": None}

    def accept_all(*args: object, **kwargs: object) -> object:
        return answers[broken]

    monkeypatch.setattr(patch, broken, accept_all)
    cls = scheduler_class()
    original = cls.__dict__[patch.TARGET]
    decision = evaluate(FIX, LENIENT, apply=True, honour_disable=False)
    assert decision.answer is Answer.FAILED_TO_FIX, decision.reason
    assert decision.after is not None and "malformed-params-claim-remote-kv" in decision.after.names(True)
    assert cls.__dict__[patch.TARGET] is original and layers_of(cls, patch.TARGET) == []
