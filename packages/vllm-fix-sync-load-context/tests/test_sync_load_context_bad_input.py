"""Bad input: a connector whose start_load_kv raises under the override context.

The context is closed, the error reaches vLLM exactly as unpatched, and nothing stays bound for
the next step."""

from __future__ import annotations

from typing import Any

import pytest

from vllm_fix_sync_load_context import FIX
from vllm_fix_testing import applied
from vllm_fix_testing.runner import RecordingLoader, Timeline, run_step


class LoadFailed(RuntimeError):
    pass


def _failing_step() -> tuple[BaseException, Timeline]:
    timeline = Timeline()
    with pytest.raises(LoadFailed) as info:
        run_step(RecordingLoader(timeline, fail=LoadFailed("remote prefill instance went away")))
    return info.value, timeline


def test_a_failing_load_reaches_vllm_exactly_as_unpatched() -> None:
    from vllm.forward_context import is_forward_context_available

    unpatched, unpatched_timeline = _failing_step()
    with applied(FIX):
        patched, patched_timeline = _failing_step()
        assert not is_forward_context_available()  # closed although the connector raised
    assert type(patched) is type(unpatched) and patched.args == unpatched.args
    # The step stops where vLLM stops it: no replay after a failed synchronous load.
    assert unpatched_timeline.events == patched_timeline.events == ["start_load_kv"]
    # Patched, the failing load did see the step's own context.
    assert patched_timeline.loads[0]["attn_metadata"] is not None


def test_nothing_stays_bound_for_the_next_step() -> None:
    """After a failed FULL step, the next FULL step sees its own metadata, and a PIECEWISE step
    its own context (no leftover of the failed step's)."""
    with applied(FIX):
        _failed, timeline = _failing_step()
        failed_metadata = timeline.loads[0]["attn_metadata"]
        for mode in ("FULL", "PIECEWISE"):
            nxt = Timeline()
            runner: Any = run_step(RecordingLoader(nxt), mode=mode)
            (load,) = nxt.loads
            assert load["attn_metadata"] is runner.attn_metadata is not failed_metadata
            assert nxt.context_at_run == [mode != "FULL"]
            assert runner.kv_connector._pending_load_kwargs is None
