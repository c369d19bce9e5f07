"""Speculative KV output readiness on real vLLM: the real MRV2 sample_tokens with the real
ActiveKVConnector, negative controls (c3a, c3b), the fix, and what must not change."""

from __future__ import annotations

from typing import Any

import pytest
from packaging.version import Version

from vllm_fix_core import Answer, layers_of, original_of
from vllm_fix_core.declaration import static_lookup
from vllm_fix_spec_kv_readiness import FIX, readiness
from vllm_fix_testing import applied, assert_hostile_wrapper_fails, vllm_version
from vllm_fix_testing.spec_runner import DRAFT_DONE, DRAIN, SpecRunner, StepResult

V033 = vllm_version() >= Version("0.33.0")


def runner(**kwargs: Any) -> SpecRunner:
    return SpecRunner(event_seam=readiness.override_events, **kwargs)


def finished(result: StepResult) -> set[str]:
    return set(result.kv_output.finished_sending or ())


def ready(result: StepResult) -> bool:
    """get_output waited on something recorded after the draft's last kernel."""
    last_kernel = result.log.at(DRAFT_DONE)
    return any(event.recorded_at > last_kernel for event in result.log.synced)


def test_c3a_kv_output_collected_before_draft_and_wait_for_save() -> None:
    """c3a. Negative control on 0.33.0 (0.32.0 collects after the draft): the step's
    KVConnectorOutput must report the saves of the target and draft forwards, completed by
    wait_for_save, and get_transfer_results must run after both."""
    result = runner().step()
    log = result.log
    if V033:
        assert log.at(DRAIN) < log.at(DRAFT_DONE) and log.at(DRAIN) < log.at("wait_for_save"), log.entries
        assert finished(result) == set()
    else:
        assert log.at("wait_for_save") < log.at(DRAIN) and finished(result) == {"t1", "d1"}
    with applied(FIX):
        result = runner().step()
    log = result.log
    assert log.at(DRAFT_DONE) < log.at("wait_for_save") < log.at(DRAIN) < log.at("clear_connector_metadata")
    assert finished(result) == {"t1", "d1"}
    assert log.count(DRAIN) == 1


def test_c3b_output_visible_before_draft_kv_on_both() -> None:
    """c3b. Negative control on both releases: the output becomes visible once the copy event
    (recorded before the draft) completes. Patched, get_output also waits on an event recorded
    after the draft's last kernel, for a connector that publishes blocks for READ."""
    result = runner().step()
    assert [e.name for e in result.log.synced] == ["copy"]
    assert not ready(result), result.log.entries
    with applied(FIX):
        result = runner().step()
    assert ready(result), result.log.entries
    assert [e.name for e in result.log.synced] == ["copy", "step-done"]


def test_every_step_reports_its_own_saves_exactly_once() -> None:
    """Across consecutive speculative steps, each output carries its own step's completions,
    drained once per step, in the same order as a non-speculative step."""
    with applied(FIX):
        spec = runner()
        results = [spec.step() for _ in range(4)]
    assert [finished(r) for r in results] == [{f"t{i}", f"d{i}"} for i in range(1, 5)]
    assert [r.log.count(DRAIN) for r in results] == [1, 1, 1, 1]
    assert all(r.log.synced[-1].name == "step-done" for r in results)
    assert len(readiness.STEP_DONE) == 0  # every step-done event was taken by its get_output


def test_async_loads_still_start_before_the_draft() -> None:
    """Pending async loads start at the deferred post_forward (0.33.0), as vLLM does: the
    fix holds only the drain, not load submission."""
    with applied(FIX):
        result = runner().step()
    log = result.log
    assert log.count("start_load_kv") == 1
    if V033:
        assert log.at("start_load_kv") < log.at(DRAFT_DONE)


def test_non_read_connector_keeps_the_overlap() -> None:
    """A connector that does not publish blocks for READ: no extra wait in get_output."""
    with applied(FIX):
        result = runner(read_publisher=False).step()
    assert [e.name for e in result.log.synced] == ["copy"]
    assert finished(result) == {"t1", "d1"}


def test_non_speculative_step_unchanged() -> None:
    def order() -> tuple[list[str], set[str], list[str]]:
        result = runner(speculative=False).step()
        return result.log.entries, finished(result), [e.name for e in result.log.synced]

    before = order()
    with applied(FIX):
        after = order()
    assert before == after
    assert before[1] == {"t1"}


def test_probe_sees_the_bug_unpatched_and_not_patched() -> None:
    report = FIX.run_probe()
    assert report.names(True) == (
        ["kv-output-misses-step-saves", "output-visible-before-draft-kv"]
        if V033
        else ["output-visible-before-draft-kv"]
    )
    assert not report.broken_guards
    with applied(FIX) as decision:
        assert decision.answer is Answer.AFFECTED_FIXED
        after = FIX.run_probe()
    assert not after.affected and not after.broken_guards, after.summary()


def test_hostile_wrapper_makes_verification_fail() -> None:
    assert_hostile_wrapper_fails(FIX)


def _targets() -> dict[str, Any]:
    out = {}
    for target in FIX.targets:
        try:
            owner, attr, raw = target.resolve()
        except AttributeError:
            assert target.optional
            continue
        out[target.path] = (owner, attr, raw)
    return out


def test_apply_twice_is_a_no_op_and_revert_is_exact() -> None:
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    from vllm_fix_core import PatchSet, runtime
    from vllm_fix_spec_kv_readiness.patch import apply, recognize
    from vllm_fix_testing import STRICT

    # sample_tokens is patched only where execute_model collects the KV output (0.15 - 0.21).
    declared = _targets()
    sample_tokens = declared.pop("vllm.v1.worker.gpu.model_runner:GPUModelRunner.sample_tokens")
    before = declared
    assert len(before) == (3 if V033 else 2)  # finalize_step only exists from 0.33.0
    first = runtime.apply(FIX, STRICT)
    assert layers_of(GPUModelRunner, "sample_tokens") == []
    assert static_lookup(GPUModelRunner, "sample_tokens") is sample_tokens[2]
    installed = {path: static_lookup(owner, attr) for path, (owner, attr, _) in before.items()}
    assert runtime.apply(FIX, STRICT) is first
    for path, (owner, attr, raw) in before.items():
        assert static_lookup(owner, attr) is installed[path]
        assert layers_of(owner, attr) == ["spec-kv-readiness"]
        assert original_of(owner, attr) is raw
    runtime.revert(FIX)
    for owner, attr, raw in before.values():
        assert static_lookup(owner, attr) is raw and layers_of(owner, attr) == []
    # The fix's own apply, twice through one PatchSet: one layer per target, exact revert.
    patch = PatchSet(FIX.id)
    apply(patch, recognize())
    apply(patch, recognize())
    assert all(layers_of(owner, attr) == ["spec-kv-readiness"] for owner, attr, _ in before.values())
    patch.revert()
    for owner, attr, raw in before.values():
        assert static_lookup(owner, attr) is raw and layers_of(owner, attr) == []


def test_recognized_shape_names_the_release() -> None:
    from vllm_fix_spec_kv_readiness.patch import recognize

    shape = recognize()
    assert shape == (
        "deferred-finalize, vllm-0.33.0" if V033 else "post-forward-after-draft, vllm-0.31.0..0.32.0"
    )


@pytest.mark.parametrize("drift", ["finalize-before-propose", "post-forward-before-propose"])
def test_unknown_sample_tokens_order_is_refused(drift: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """If sample_tokens no longer runs the calls in an order the fix understands: refused."""
    from vllm_fix_core import UnknownShape
    from vllm_fix_spec_kv_readiness import patch

    real = patch.call_order

    def drifted(func: Any) -> list[tuple[str, frozenset[str]]]:
        order = real(func)
        names = [n for n, _ in order]
        moved = "finalize_step" if drift == "finalize-before-propose" else "post_forward"
        if moved not in names:
            pytest.skip(f"{moved} is not called by this release's sample_tokens")
        keep = [c for c in order if c[0] != moved]
        first = next(c for c in order if c[0] == moved)
        return [first, *keep]

    monkeypatch.setattr(patch, "call_order", drifted)
    if (drift == "finalize-before-propose") != V033:
        pytest.skip("the other release's shape")
    with pytest.raises(UnknownShape):
        patch.recognize()


def test_a_failing_draft_loses_no_completion() -> None:
    """Bad input: the draft forward raises mid-step. That step produces no output, but the saves
    it had issued are reported by the next step, once, and nothing stays pending in the fix."""
    with applied(FIX):
        spec = runner()
        first = spec.step()
        assert spec.drafter is not None
        spec.drafter.error = RuntimeError("draft forward failed")
        with pytest.raises(RuntimeError, match="draft forward failed"):
            spec.step()
        third = spec.step()
    assert finished(first) == {"t1", "d1"}
    assert finished(third) == {"t2", "t3", "d3"}
    assert third.log.count(DRAIN) == 1
