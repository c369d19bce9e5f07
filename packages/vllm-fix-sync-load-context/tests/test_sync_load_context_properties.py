"""Property-based: for any batch size, padding, cudagraph mode and load kind, the patched step
gives the connector exactly what the rule says, and everything else exactly what vLLM gives."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_fix_sync_load_context import FIX
from vllm_fix_testing import applied
from vllm_fix_testing.runner import RecordingLoader, Timeline, run_step, step_batch


def _step(mode: str, sync: bool, num_reqs: int, pad: int) -> tuple[Any, Timeline]:
    timeline = Timeline()
    batch = step_batch(num_reqs=num_reqs, padded_to=num_reqs + pad)
    runner = run_step(RecordingLoader(timeline), mode=mode, sync=sync, batch=batch)
    return runner, timeline


def _view(runner: Any, timeline: Timeline) -> list[Any]:
    return [
        (
            load["mode"],
            load["attn_metadata"] is runner.attn_metadata,
            load["batch_descriptor"],
            load["is_padding"] is runner.input_batch.is_padding,
        )
        for load in timeline.loads
    ] + [timeline.events, timeline.context_at_run]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    mode=st.sampled_from(["FULL", "PIECEWISE", "NONE"]),
    sync=st.booleans(),
    num_reqs=st.integers(1, 8),
    pad=st.integers(0, 8),
)
def test_patched_step_follows_the_rule(mode: str, sync: bool, num_reqs: int, pad: int) -> None:
    from vllm.config import CUDAGraphMode

    unpatched = _view(*_step(mode, sync, num_reqs, pad))
    with applied(FIX):
        runner, timeline = _step(mode, sync, num_reqs, pad)
    patched = _view(runner, timeline)
    if mode == "FULL" and sync:
        (load,) = timeline.loads
        assert load["mode"] == CUDAGraphMode.FULL
        assert load["attn_metadata"] is runner.attn_metadata
        assert load["batch_descriptor"].num_tokens == num_reqs + pad
        assert load["is_padding"] is runner.input_batch.is_padding
        assert timeline.before("load_done", "replay") and timeline.context_at_run == [False]
    else:
        assert patched == unpatched
