"""The probe is a guest (issue 33): it builds vLLM's own objects without platform hooks, changes
nothing in the process, and the rule builds the batch descriptor of whichever release is installed
(0.34 dropped ``BatchDescriptor.has_lora``)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from typing import Any

import pytest

from vllm_fix_sync_load_context import probe, rule, stand_ins


@pytest.fixture
def fresh_config() -> Iterator[None]:
    """The probe's config built anew in the test (it is kept once per process otherwise)."""
    probe.probe_config.cache_clear()
    yield
    probe.probe_config.cache_clear()


def test_probe_runs_no_platform_hook_and_leaves_the_environment_alone(
    monkeypatch: pytest.MonkeyPatch, fresh_config: None
) -> None:
    """vLLM 0.34's x86 CPU platform raises from check_and_update_config without triton-cpu, and
    every release's hook rewrites os.environ: the probe must never reach it."""
    from vllm.platforms import current_platform

    def hook(*args: Any, **kwargs: Any) -> None:
        os.environ["LOCAL_WORLD_SIZE"] = "1"
        raise RuntimeError("vLLM on x86 CPUs requires Triton (triton-cpu).")

    monkeypatch.setattr(type(current_platform), "check_and_update_config", classmethod(hook))
    before = dict(os.environ)
    report = probe.probe()  # outside the ladder's guest(): nothing is put back for it
    assert dict(os.environ) == before
    symptom = report.checks[0]
    assert symptom.name == "full-replay-sync-load-outside-step-context"
    assert symptom.affected  # unpatched vLLM: the bug is seen


def test_the_probe_step_is_built_from_vllms_own_classes() -> None:
    """What execute_model reads is vLLM's own where a CPU can build it (a release that reads one
    more field finds vLLM's default); only the GPU-only objects are stand-ins."""
    import torch
    from vllm.config import ObservabilityConfig, VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.worker.gpu import model_runner
    from vllm.v1.worker.gpu.input_batch import InputBatch

    config = probe.probe_config()
    assert type(config) is VllmConfig
    batch = stand_ins.step_batch()
    assert type(batch) is InputBatch
    for f in dataclasses.fields(InputBatch):
        assert hasattr(batch, f.name), f.name
    (metadata,) = stand_ins.attention_metadata(batch).values()
    assert type(metadata).__name__ == "CommonAttentionMetadata"
    assert metadata.num_actual_tokens == batch.num_tokens == stand_ins.NUM_REQS
    graphs = stand_ins.Graphs(None, stand_ins.Seen(), torch.zeros(batch.num_tokens, 4))
    runner = stand_ins.StandInRunner(config, None, graphs, batch, {})
    assert type(runner.kv_cache_config) is KVCacheConfig
    assert type(runner.observability_config) is ObservabilityConfig
    assert type(runner.input_buffers) is model_runner.InputBuffers
    for name, attr in (("EPLBController", "eplb"), ("StepTimingCollector", "step_timing")):
        cls = getattr(model_runner, name, None)
        assert cls is None or type(getattr(runner, attr)) is cls, name
    if hasattr(model_runner, "BatchReqState"):
        state, _ = runner.gather_batch_req_state(stand_ins.step_output(batch), False)
        assert type(state) is model_runner.BatchReqState
        assert (state.num_tokens, state.has_prefill) == (stand_ins.NUM_REQS, False)


@dataclasses.dataclass(frozen=True)
class DescriptorWithoutLora:
    """vLLM 0.34's BatchDescriptor: no has_lora field."""

    num_tokens: int
    num_reqs: int | None = None
    uniform: bool = False
    num_active_loras: int = 0


def test_rule_builds_a_descriptor_without_has_lora(monkeypatch: pytest.MonkeyPatch) -> None:
    """The context is built with the installed BatchDescriptor's own fields: a release without
    has_lora gets the padded batch's descriptor, not a TypeError (which the patch would turn into
    vLLM's fallback context, i.e. the bug)."""
    import vllm.forward_context as fc

    monkeypatch.setattr(fc, "BatchDescriptor", DescriptorWithoutLora)
    batch = stand_ins.step_batch()
    context = rule.full_step_context(probe.probe_config(), {}, batch)
    padded = stand_ins.PADDED_TO
    assert context.batch_descriptor == DescriptorWithoutLora(num_tokens=padded, num_reqs=padded)
