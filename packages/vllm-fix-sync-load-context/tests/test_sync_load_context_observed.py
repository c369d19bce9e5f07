"""Issue 22 on real vLLM: every patched target is observed by the probe, the probe's answer does
not come from the fix's rule (breaking the rule makes verification fail), and the patched
``pre_forward`` never raises where vLLM's own does not, for any input shape its types allow."""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_fix_core import Answer, Settings, UnknownShape, evaluate, layers_of, original_of
from vllm_fix_core.declaration import static_lookup
from vllm_fix_sync_load_context import FIX, patch
from vllm_fix_sync_load_context.stand_ins import attention_metadata
from vllm_fix_testing import STRICT, assert_every_target_observed, assert_verification_fails
from vllm_fix_testing.hostile import patched_targets
from vllm_fix_testing.runner import (
    LAYER,
    RecordingLoader,
    Timeline,
    active_connector,
    step_batch,
    step_output,
)

LADDER = Settings(disabled=frozenset(), strict=False)
TARGET = "ActiveKVConnector.pre_forward"


@pytest.fixture(autouse=True)
def _fix_applies_here() -> None:
    """vLLM 0.24-0.31 hand pre_forward no input batch: the fix refuses there (nothing patched,
    nothing to observe); those releases are covered by the refusal tests."""
    from vllm_fix_sync_load_context.patch import recognize

    try:
        recognize()
    except UnknownShape as exc:
        pytest.skip(f"the fix does not apply on this vLLM (refused: {exc})")


def _active_cls() -> Any:
    from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

    return ActiveKVConnector


# --- 1. every patched target observed ---------------------------------------------------------


def test_every_patched_target_is_observed() -> None:
    """vLLM's original layered over pre_forward alone (the only target): "failed to fix", and
    FixFailed under strict; the target restored exactly."""
    assert patched_targets(FIX) == [TARGET]
    decisions = assert_every_target_observed(FIX)
    assert list(decisions) == [TARGET]
    assert "full-replay-sync-load-outside-step-context" in decisions[TARGET].reason


# --- 2. the oracle is not the rule: break the rule, verification fails -------------------------


def _unpadded(real: Any) -> Any:
    """Context built from the scheduled count instead of the padded graph size."""

    def rule(vllm_config: Any, attn_metadata: Any, input_batch: Any) -> Any:
        batch = copy.copy(input_batch)
        batch.num_tokens_after_padding = input_batch.num_tokens
        batch.num_reqs_after_padding = input_batch.num_reqs
        return real(vllm_config, attn_metadata, batch)

    return rule


def _eager(real: Any) -> Any:
    """The step's context, but told NONE (what vLLM's fallback says)."""
    from vllm.config import CUDAGraphMode

    def rule(vllm_config: Any, attn_metadata: Any, input_batch: Any) -> Any:
        return dataclasses.replace(
            real(vllm_config, attn_metadata, input_batch), cudagraph_runtime_mode=CUDAGraphMode.NONE
        )

    return rule


def _no_metadata(real: Any) -> Any:
    def rule(vllm_config: Any, attn_metadata: Any, input_batch: Any) -> Any:
        return real(vllm_config, None, input_batch)

    return rule


def _no_padding_mask(real: Any) -> Any:
    def rule(vllm_config: Any, attn_metadata: Any, input_batch: Any) -> Any:
        return dataclasses.replace(real(vllm_config, attn_metadata, input_batch), is_padding=None)

    return rule


def _raises(real: Any) -> Any:
    def rule(vllm_config: Any, attn_metadata: Any, input_batch: Any) -> Any:
        raise RuntimeError("rule broken")

    return rule


@pytest.mark.parametrize("broken", [_unpadded, _eager, _no_metadata, _no_padding_mask, _raises])
def test_a_broken_rule_fails_verification(monkeypatch: pytest.MonkeyPatch, broken: Any) -> None:
    """The rule the patch calls (``patch.full_step_context``, the reference the wrapper looks
    up at call time) is broken; the probe's expected answer comes from the step it built, so
    the ladder must say "failed to fix" and put vLLM's pre_forward back."""
    cls = _active_cls()
    original = static_lookup(cls, "pre_forward")
    monkeypatch.setattr(patch, "full_step_context", broken(patch.full_step_context))
    assert_verification_fails(FIX, {"full-replay-sync-load-outside-step-context"})
    assert static_lookup(cls, "pre_forward") is original and layers_of(cls, "pre_forward") == []


def test_the_real_rule_verifies() -> None:
    """The positive twin of the test above (same call, rule intact)."""
    decision = evaluate(FIX, LADDER, apply=True, honour_disable=False)
    try:
        assert decision.answer is Answer.AFFECTED_FIXED, decision.message
    finally:
        assert decision.patch is not None
        decision.patch.revert()


# --- 3. patched never raises where vLLM does not ------------------------------------------------

MISSING = "<missing>"


@functools.cache
def _configs() -> tuple[Any, Any]:
    """The probe's VllmConfig, and one with DP=2 (MoE-capable: DP metadata is built), both
    vLLM's own at its defaults, built without platform hooks."""
    from vllm.config import DeviceConfig, VllmConfig

    from vllm_fix_core.guest import build
    from vllm_fix_sync_load_context.probe import probe_config

    dp = build(VllmConfig, device_config=build(DeviceConfig))
    dp.parallel_config.data_parallel_size = 2
    return probe_config(), dp


@dataclasses.dataclass
class Call:
    dp: bool
    disabled: bool
    context_open: bool
    sync: bool
    metadata: bool
    batch: dict[str, Any] | None  # None: no input batch (the no-forward path)
    attn: str  # "none", "empty", "layer"
    form: str  # how the runner passes the arguments


def _batches() -> st.SearchStrategy[dict[str, Any] | None]:
    counts = st.one_of(st.just(MISSING), st.none(), st.integers(-1, 12))
    return st.one_of(
        st.none(),
        st.fixed_dictionaries(
            {
                "num_reqs": st.integers(0, 6),
                "pad": st.integers(0, 6),
                "num_tokens_after_padding": st.one_of(st.just("padded"), counts),
                "num_reqs_after_padding": st.one_of(st.just("padded"), counts),
                "is_padding": st.sampled_from(["mask", None, MISSING]),
            }
        ),
    )


calls = st.builds(
    Call,
    dp=st.booleans(),
    disabled=st.booleans(),
    context_open=st.booleans(),
    sync=st.booleans(),
    metadata=st.booleans(),
    batch=_batches(),
    attn=st.sampled_from(["none", "empty", "layer"]),
    form=st.sampled_from(["runner", "positional", "keywords", "scheduler-only"]),
)


def _build_batch(spec: dict[str, Any]) -> Any:
    n, pad = spec["num_reqs"], spec["pad"]
    batch = step_batch(num_reqs=n, padded_to=n + pad)
    for name in ("num_tokens_after_padding", "num_reqs_after_padding", "is_padding"):
        value = spec[name]
        if value == MISSING:
            delattr(batch, name)
        elif value not in ("padded", "mask"):
            setattr(batch, name, value)
    return batch


@dataclasses.dataclass
class Outcome:
    error: tuple[type[BaseException], tuple[Any, ...]] | None
    loads: list[tuple[Any, ...]]
    pending: Any


def _scheduler_output(call: Call, batch: Any) -> Any:
    scheduler_output = step_output(batch if batch is not None else step_batch(), sync=call.sync)
    if not call.metadata:
        scheduler_output.kv_connector_metadata = None
    return scheduler_output


def _run(pre_forward: Any, call: Call, scheduler_output: Any, batch: Any, attn: Any) -> Outcome:
    import vllm.forward_context as fc

    plain, dp = _configs()
    config = dp if call.dp else plain
    timeline = Timeline()
    active = active_connector(config, RecordingLoader(timeline))
    active._disabled = call.disabled
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    if call.form == "runner":
        args, kwargs = (scheduler_output, batch), {"attn_metadata": attn}
    elif call.form == "positional":
        args, kwargs = (scheduler_output, batch, attn), {}
    elif call.form == "keywords":
        args, kwargs = (), {"scheduler_output": scheduler_output, "input_batch": batch, "attn_metadata": attn}
    else:
        args, kwargs = (scheduler_output,), {}
    error = None
    try:
        if call.context_open:
            with fc.override_forward_context(fc.create_forward_context(attn, plain)):
                pre_forward(active, *args, **kwargs)
        else:
            pre_forward(active, *args, **kwargs)
    except Exception as exc:
        error = (type(exc), exc.args)
    loads = [
        (
            load["mode"],
            id(load["attn_metadata"]) if load["attn_metadata"] is not None else None,
            load["batch_descriptor"],
            id(load["is_padding"]) if load["is_padding"] is not None else None,
            load["dp_metadata"] is None,
            {k: id(v) for k, v in load["kwargs"].items()},
        )
        for load in timeline.loads
    ]
    return Outcome(error, loads, active._pending_load_kwargs)


@pytest.fixture
def patched() -> Iterator[Any]:
    from vllm_fix_core import runtime

    cls = _active_cls()
    assert runtime.apply(FIX, STRICT).answer is Answer.AFFECTED_FIXED
    try:
        yield cls
    finally:
        runtime.revert(FIX)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(call=calls)
def test_patched_pre_forward_never_raises_where_vllm_does_not(patched: Any, call: Call) -> None:
    """Every input shape the runner's types allow (and None / missing where a field could be
    absent): vLLM's own pre_forward (``original_of``) and the installed one on the same objects.
    Where vLLM raises, the patched one raises the same; where it does not, neither does the
    patched one; and wherever the rule says "untouched" the connector sees exactly what vLLM
    gives it."""
    from vllm.config import CUDAGraphMode

    cls = patched
    batch = None if call.batch is None else _build_batch(call.batch)
    # vLLM's metadata of a one-request step (the batch under test may lack the fields it reads).
    attn = {"none": None, "empty": {}, "layer": attention_metadata(step_batch(num_reqs=1), LAYER)}[call.attn]
    out = _scheduler_output(call, batch)
    unpatched = _run(original_of(cls, "pre_forward"), call, out, batch, attn)
    installed = _run(cls.pre_forward, call, out, batch, attn)
    assert installed.error == unpatched.error
    padded = getattr(batch, "num_tokens_after_padding", None)
    applies = (
        call.form != "scheduler-only"
        and batch is not None
        and call.sync
        and call.metadata
        and not call.disabled
        and not call.context_open
        and padded is not None
    )
    if not applies:
        assert installed == unpatched
        return
    assert unpatched.error is None
    ((mode, meta, desc, mask, _no_dp, kwargs),) = installed.loads
    assert mode == CUDAGraphMode.FULL
    assert meta == (id(attn) if attn is not None else None)
    assert desc.num_tokens == padded
    is_padding = getattr(batch, "is_padding", None)
    assert mask == (id(is_padding) if is_padding is not None else None)
    assert kwargs == unpatched.loads[0][5]  # the load's own arguments are vLLM's


def test_no_padded_count_runs_in_vllms_fallback_context(patched: Any) -> None:
    """The issue's row: ``num_tokens_after_padding=None`` (or the attribute absent) on a FULL
    step with a synchronous load: no TypeError, and the connector sees what unpatched vLLM
    gives it (the fallback context)."""
    from vllm.config import CUDAGraphMode

    for value in (None, MISSING):
        call = Call(False, False, False, True, True, None, "layer", "runner")
        batch = step_batch(num_reqs=2, padded_to=4)
        if value is None:
            batch.num_tokens_after_padding = None
        else:
            del batch.num_tokens_after_padding
        attn = attention_metadata(step_batch(num_reqs=2, padded_to=4), LAYER)
        out = _scheduler_output(call, batch)
        unpatched = _run(original_of(patched, "pre_forward"), call, out, batch, attn)
        installed = _run(patched.pre_forward, call, out, batch, attn)
        assert installed == unpatched and installed.error is None
        assert installed.loads[0][0] == CUDAGraphMode.NONE
