"""Idempotence, exact revert, the hostile wrapper, the shape checks, and the ladder's answer."""

from __future__ import annotations

import ast
import textwrap
from typing import Any

import pytest

from vllm_fix_core import Answer, Settings, UnknownShape, evaluate, layers_of, runtime
from vllm_fix_core.declaration import static_lookup
from vllm_fix_sync_load_context import FIX
from vllm_fix_sync_load_context.patch import full_branch_problem, recognize
from vllm_fix_testing import STRICT, applied, assert_hostile_wrapper_fails


def _active() -> Any:
    from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

    return ActiveKVConnector


def test_apply_twice_is_a_no_op_and_revert_is_exact() -> None:
    cls = _active()
    original = static_lookup(cls, "pre_forward")
    first = runtime.apply(FIX, STRICT)
    assert first.answer is Answer.AFFECTED_FIXED
    installed = cls.__dict__["pre_forward"]
    second = runtime.apply(FIX, STRICT)
    assert second is first
    assert cls.__dict__["pre_forward"] is installed
    assert layers_of(cls, "pre_forward") == ["sync-load-context"]
    assert runtime.revert(FIX)
    assert cls.__dict__["pre_forward"] is original
    assert layers_of(cls, "pre_forward") == []


def test_patches_only_the_declared_method() -> None:
    cls = _active()
    before = {name: value for name, value in vars(cls).items()}
    with applied(FIX):
        changed = {name for name, value in vars(cls).items() if before.get(name) is not value}
    assert changed == {"pre_forward"}
    assert [t.qualname for t in FIX.targets] == ["ActiveKVConnector.pre_forward"]


def test_probe_observes_vllm_not_the_fix() -> None:
    decision = assert_hostile_wrapper_fails(FIX)
    assert "full-replay-sync-load-outside-step-context" in decision.reason


def test_verify_affected_then_fixed_with_guards_kept() -> None:
    decision = evaluate(FIX, Settings(disabled=frozenset(), strict=True), apply=True)
    try:
        assert decision.answer is Answer.AFFECTED_FIXED, decision.message
        assert decision.before is not None and decision.after is not None
        assert decision.before.names(True) == ["full-replay-sync-load-outside-step-context"]
        assert decision.before.broken_guards == decision.after.broken_guards == []
        assert not decision.after.affected
    finally:
        assert decision.patch is not None
        decision.patch.revert()


def test_recognizes_the_installed_shape() -> None:
    assert recognize() in ("vllm-0.32.0/0.33.0", "structural")


def test_refuses_a_pre_forward_that_gets_no_input_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """pre_forward(scheduler_output[, **kwargs]) (the 0.15-0.31 signature) while this runner's FULL
    branch passes it an input batch: neither shape, refused."""
    cls = _active()

    def pre_forward(self: Any, scheduler_output: Any, **kwargs: Any) -> None:
        pass

    monkeypatch.setattr(cls, "pre_forward", pre_forward)
    with pytest.raises(UnknownShape, match="carries no input batch and the FULL branch passes"):
        recognize()


def _execute_model(body: str) -> Any:
    source = "def execute_model(self, scheduler_output):\n" + textwrap.indent(textwrap.dedent(body), "    ")
    namespace: dict[str, Any] = {}
    exec(compile(ast.parse(source), "<drifted execute_model>", "exec"), namespace)
    fn = namespace["execute_model"]
    fn.__source__ = source
    return fn


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (
            """
            if batch_desc.cg_mode == CUDAGraphMode.FULL:
                with set_forward_context(attn_metadata, self.vllm_config):
                    self.kv_connector.pre_forward(scheduler_output, input_batch, attn_metadata=attn_metadata)
                out = self.cudagraph_manager.run_fullgraph(batch_desc)
            """,
            "already opens a context",
        ),
        (
            """
            if batch_desc.cg_mode == CUDAGraphMode.FULL:
                self.kv_connector.pre_forward(scheduler_output)
                out = self.cudagraph_manager.run_fullgraph(batch_desc)
            """,
            "without the input batch",
        ),
        ("out = self.model()\n", "no FULL branch"),
    ],
)
def test_refuses_an_execute_model_of_another_shape(
    monkeypatch: pytest.MonkeyPatch, body: str, reason: str
) -> None:
    import inspect

    fn = _execute_model(body)
    real_getsource = inspect.getsource
    monkeypatch.setattr(
        inspect, "getsource", lambda obj: obj.__source__ if obj is fn else real_getsource(obj)
    )
    problem = full_branch_problem(fn)
    assert problem is not None and reason in problem


@pytest.mark.parametrize("order", ["other-first", "fix-first"])
def test_composes_with_another_layer_on_active_kv_connector(order: str) -> None:
    """Another fix wrapping ActiveKVConnector (pre_forward itself, and a method next to it):
    either order, the fix still works, and each reverts alone to the exact objects."""
    from vllm_fix_core import PatchSet
    from vllm_fix_testing.runner import RecordingLoader, Timeline, run_step

    cls = _active()
    originals = {name: static_lookup(cls, name) for name in ("pre_forward", "post_forward")}
    calls: list[str] = []

    def passthrough(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        calls.append(wrapped.__name__)
        return wrapped(*args, **kwargs)

    other = PatchSet("other-fix")

    def apply_other() -> None:
        other.wrap(cls, "pre_forward", passthrough)
        other.wrap(cls, "post_forward", passthrough)

    try:
        if order == "other-first":
            apply_other()
        assert runtime.apply(FIX, STRICT).answer is Answer.AFFECTED_FIXED
        if order == "fix-first":
            apply_other()
        calls.clear()  # the probe ran through the other layer too
        timeline = Timeline()
        runner = run_step(RecordingLoader(timeline))
        assert timeline.loads[0]["attn_metadata"] is runner.attn_metadata
        assert calls == ["pre_forward"]
        runtime.revert(FIX)
        assert layers_of(cls, "pre_forward") == ["other-fix"]
    finally:
        runtime.revert(FIX)
        other.revert()
    assert {name: cls.__dict__[name] for name in originals} == originals
