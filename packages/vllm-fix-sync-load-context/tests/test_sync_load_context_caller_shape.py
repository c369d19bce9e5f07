"""The 0.15-0.31 shape (pre_forward gets no input batch), on the installed vLLM's own connector.

The real runners of that era are proved on their own releases (README "Releases");
here a runner of that shape is written as a drifted-shape fixture (as in the patching tests) in
front of the installed ActiveKVConnector, forward context and recording connector, to pin down
the frame recipe: the step is read from the FULL branch's call only, never elsewhere.
"""

from __future__ import annotations

import itertools
import linecache
import textwrap
from typing import Any

import pytest

from vllm_fix_core import PatchSet
from vllm_fix_sync_load_context import patch as fix_patch
from vllm_fix_sync_load_context import shapes
from vllm_fix_sync_load_context.probe import probe_config
from vllm_fix_sync_load_context.stand_ins import (
    PADDED_TO,
    Graphs,
    RecordingLoader,
    Seen,
    StandInRunner,
    active_connector,
    attention_metadata,
    step_batch,
    step_output,
)

OLD_RUNNER = """
def execute_model(self, scheduler_output, input_batch, attn_metadata, mode):
    if mode is None:
        self.kv_connector.pre_forward(scheduler_output)
        return None
    if mode == CUDAGraphMode.FULL:
        self.kv_connector.pre_forward(scheduler_output)
        out = self.cudagraph_manager.run_fullgraph(None)
    else:
        with set_forward_context(
            attn_metadata,
            self.vllm_config,
            num_tokens=input_batch.num_tokens_after_padding,
            cudagraph_runtime_mode=mode,
        ):
            self.kv_connector.pre_forward(scheduler_output)
            out = self.cudagraph_manager.run_pw_graph(None, None)
    return out
"""
_COUNTER = itertools.count()


def _old_runner() -> Any:
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import set_forward_context

    filename = f"<old-shape execute_model {next(_COUNTER)}>"
    source = textwrap.dedent(OLD_RUNNER).lstrip()
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace: dict[str, Any] = {"CUDAGraphMode": CUDAGraphMode, "set_forward_context": set_forward_context}
    exec(compile(source, filename, "exec"), namespace)
    return namespace["execute_model"]


def _bare_pre_forward() -> Any:
    """pre_forward(scheduler_output, **kwargs), as 0.30/0.31 declare it: the installed one, no batch."""
    from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

    vllm_pre_forward_then_start_load_kv = ActiveKVConnector.pre_forward

    def pre_forward(self: Any, scheduler_output: Any, **kwargs: Any) -> None:
        # vLLM's own pre_forward with no batch: it binds the metadata and, for a step with
        # synchronous loads, starts them (its _start_load_kv), as 0.29-0.31's pre_forward does.
        vllm_pre_forward_then_start_load_kv(self, scheduler_output, None)

    return pre_forward


def _run(fn: Any, mode_name: str | None, *, sync: bool = True) -> tuple[Seen, Any, Any]:
    import torch
    from vllm.config import CUDAGraphMode

    config = probe_config()
    seen = Seen()
    batch = step_batch()
    attn = attention_metadata(batch)
    mode = None if mode_name is None else getattr(CUDAGraphMode, mode_name)
    graphs = Graphs(mode or CUDAGraphMode.NONE, seen, torch.zeros(batch.num_tokens, 4))
    runner = StandInRunner(config, active_connector(config, RecordingLoader(seen)), graphs, batch, attn)
    fn(runner, step_output(batch, sync=sync), batch, attn, mode)
    return seen, batch, attn


@pytest.fixture
def old_shape(monkeypatch: pytest.MonkeyPatch) -> Any:
    from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    fn = _old_runner()
    monkeypatch.setattr(ActiveKVConnector, "pre_forward", _bare_pre_forward())
    monkeypatch.setattr(GPUModelRunner, "execute_model", fn)
    return fn


def test_recognised_as_the_caller_shape(old_shape: Any) -> None:
    assert fix_patch.recognize() == fix_patch.CALLER_SHAPE
    recipe = shapes.caller_recipe(old_shape, _bare_pre_forward())
    assert isinstance(recipe, shapes.CallerRecipe)
    assert (recipe.attn_metadata, recipe.input_batch, recipe.sync_only) == (
        ("attn_metadata",),
        "input_batch",
        False,
    )


def test_full_step_reads_the_step_from_the_runner_frame(old_shape: Any) -> None:
    from vllm.config import CUDAGraphMode

    unpatched, _, _ = _run(old_shape, "FULL")
    assert unpatched.loads[0]["mode"] == CUDAGraphMode.NONE and unpatched.loads[0]["attn_metadata"] is None
    patch = PatchSet("sync-load-context-test")
    fix_patch.apply(patch, fix_patch.recognize())
    try:
        seen, batch, attn = _run(old_shape, "FULL")
        load = seen.loads[0]
        assert load["mode"] == CUDAGraphMode.FULL and load["attn_metadata"] is attn
        assert (load["batch_descriptor"].num_tokens, load["batch_descriptor"].num_reqs) == (
            PADDED_TO,
            PADDED_TO,
        )
        assert load["is_padding"] is batch.is_padding
        assert seen.events == ["start_load_kv", "replay"] and seen.context_at_run == [False]
        # The other branch keeps vLLM's own context; a call from elsewhere in the runner (no
        # forward) is not the FULL call and keeps vLLM's fallback.
        pw, _, pw_attn = _run(old_shape, "PIECEWISE")
        assert pw.loads[0]["mode"] == CUDAGraphMode.PIECEWISE and pw.loads[0]["attn_metadata"] is pw_attn
        elsewhere, _, _ = _run(old_shape, None)
        assert (
            elsewhere.loads[0]["mode"] == CUDAGraphMode.NONE and elsewhere.loads[0]["attn_metadata"] is None
        )
    finally:
        patch.revert()
    again, _, _ = _run(old_shape, "FULL")
    assert again.loads[0]["attn_metadata"] is None


def test_a_call_outside_the_runner_is_vllms_own_path(old_shape: Any) -> None:
    """pre_forward called directly (no runner frame above it) under the wrapper: untouched."""
    from vllm.config import CUDAGraphMode

    patch = PatchSet("sync-load-context-test")
    fix_patch.apply(patch, fix_patch.recognize())
    try:
        seen = Seen()
        config = probe_config()
        active_connector(config, RecordingLoader(seen)).pre_forward(step_output(step_batch()))
        assert seen.loads[0]["mode"] == CUDAGraphMode.NONE and seen.loads[0]["attn_metadata"] is None
    finally:
        patch.revert()


def test_refuses_an_old_runner_whose_other_branch_hides_the_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    source = OLD_RUNNER.replace("input_batch.num_tokens_after_padding", "self.padded(input_batch)")
    monkeypatch.setattr(shapes, "_parsed", lambda func: (__import__("ast").parse(source).body[0], 0))
    problem = shapes.caller_recipe(_old_runner(), _bare_pre_forward())
    assert isinstance(problem, str) and "num_tokens_after_padding" in problem
