"""MRV2 FULL synchronous-load context on real vLLM: the real GPUModelRunner.execute_model FULL
branch (stand-in ``self`` only for what needs a GPU, the replay recorded), the real
ActiveKVConnector, and real connectors behind it."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from packaging.version import Version

from vllm_fix_core.guest import build
from vllm_fix_sync_load_context import FIX
from vllm_fix_sync_load_context.probe import probe_config
from vllm_fix_testing import FakeWrapper, applied, pending, vllm_version
from vllm_fix_testing.runner import (
    LAYER,
    RecordingLoader,
    RecordingMoriWrapper,
    Timeline,
    active_connector,
    run_step,
    step_batch,
    step_output,
)

V032 = vllm_version() < Version("0.33.0")


def _full(mode: Any) -> bool:
    from vllm.config import CUDAGraphMode

    return bool(mode == CUDAGraphMode.FULL)


# --- (a) a recording synchronous loader -------------------------------------------------------


def test_full_replay_sync_load_sees_none_context_unpatched() -> None:
    """Negative control (both releases): start_load_kv is told NONE / attn_metadata=None while
    the step replays a FULL graph."""
    from vllm.config import CUDAGraphMode

    timeline = Timeline()
    run_step(RecordingLoader(timeline))
    (load,) = timeline.loads
    assert load["mode"] == CUDAGraphMode.NONE
    assert load["attn_metadata"] is None
    assert load["batch_descriptor"] is None
    assert timeline.events[:2] == ["start_load_kv", "load_done"] and "replay" in timeline.events


def test_full_replay_sync_load_sees_the_steps_own_context_patched() -> None:
    timeline = Timeline()
    batch = step_batch(num_reqs=3, padded_to=4)
    with applied(FIX):
        runner = run_step(RecordingLoader(timeline), batch=batch)
    (load,) = timeline.loads
    assert _full(load["mode"])
    assert load["attn_metadata"] is runner.attn_metadata
    assert load["batch_descriptor"].num_tokens == 4  # the padded batch the graph replays
    assert load["batch_descriptor"].num_reqs == 4
    assert load["is_padding"] is batch.is_padding
    assert load["dp_metadata"] is None  # DP=1: nothing to agree on
    assert load["no_compile_layers"] is runner.vllm_config.compilation_config.static_forward_context
    # The load kwargs vLLM builds are unchanged (attn_metadata still passed as before).
    assert load["kwargs"]["attn_metadata"] is runner.attn_metadata
    assert load["kwargs"]["num_tokens"] == 3


def test_context_is_closed_before_the_replay_and_the_load_completes_first() -> None:
    timeline = Timeline()
    with applied(FIX):
        run_step(RecordingLoader(timeline))
    assert timeline.before("load_done", "replay")
    assert timeline.context_at_run == [False]


@pytest.mark.parametrize("mode", ["PIECEWISE", "NONE"])
def test_piecewise_and_eager_steps_are_unchanged(mode: str) -> None:
    def seen() -> tuple[Any, ...]:
        timeline = Timeline()
        runner = run_step(RecordingLoader(timeline), mode=mode)
        (load,) = timeline.loads
        assert load["attn_metadata"] is runner.attn_metadata
        return load["mode"], load["batch_descriptor"], timeline.events, timeline.context_at_run

    before = seen()
    with applied(FIX):
        after = seen()
    assert before == after
    assert before[3] == [True]  # the model runs inside vLLM's own context


def test_async_loads_are_not_started_before_the_replay() -> None:
    for patched in (False, True):
        timeline = Timeline()
        if patched:
            with applied(FIX):
                run_step(RecordingLoader(timeline), sync=False)
        else:
            run_step(RecordingLoader(timeline), sync=False)
        assert timeline.loads == [] and timeline.events == ["replay", "finish_forward"], patched


def test_no_forward_step_is_unchanged() -> None:
    """no_forward calls pre_forward(scheduler_output) with no batch: vLLM's own fallback."""
    from vllm.config import CUDAGraphMode

    timeline = Timeline()
    config = probe_config()
    with applied(FIX):
        active = active_connector(config, RecordingLoader(timeline))
        active.pre_forward(step_output(step_batch()))
    (load,) = timeline.loads
    assert load["mode"] == CUDAGraphMode.NONE and load["attn_metadata"] is None


def test_dp_counts_come_from_the_agreed_padded_batch_without_a_collective(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """DP=2 on a MoE-capable config: the override carries DP metadata with every rank at the
    padded count FULL dispatch agreed on; coordinate_batch_across_dp must not run."""
    import vllm.forward_context as fc
    from vllm.config import DeviceConfig, ParallelConfig, VllmConfig

    def collective(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a DP collective ran inside the connector's context")

    monkeypatch.setattr(fc, "coordinate_batch_across_dp", collective)
    config = build(VllmConfig, device_config=build(DeviceConfig))
    parallel: ParallelConfig = config.parallel_config
    monkeypatch.setattr(parallel, "data_parallel_size", 2)
    monkeypatch.setattr(parallel, "data_parallel_rank", 0)
    timeline = Timeline()
    with applied(FIX):
        run_step(RecordingLoader(timeline), vllm_config=config, batch=step_batch(num_reqs=3, padded_to=4))
    (load,) = timeline.loads
    assert load["dp_metadata"].num_tokens_across_dp_cpu.tolist() == [4, 4]


# --- (b) the real ExampleConnector ------------------------------------------------------------


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def example_connector(tmp_path: Path) -> Iterator[SimpleNamespace]:
    """A real ExampleConnector (worker role) with one saved 16-token block to load into
    block 1 of a real-layout layer cache, and its log captured."""
    import safetensors.torch
    from vllm.config import DeviceConfig, KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1 import example_connector as ex
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    config = build(
        VllmConfig,
        device_config=build(DeviceConfig),
        kv_transfer_config=KVTransferConfig(
            kv_connector="ExampleConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": str(tmp_path)},
        ),
    )
    config.cache_config.block_size = 16
    connector = ex.ExampleConnector(config, KVConnectorRole.WORKER, None)
    layer = SimpleNamespace(kv_cache=torch.zeros(4, 1, 16, 8))  # [blocks, heads, block, head_dim]
    config.compilation_config.static_forward_context[LAYER] = layer
    metadata = ex.ExampleConnectorMetadata()
    metadata.add_request(list(range(33)), [1], 16, is_store=False, mm_hashes=[])
    (request,) = metadata.requests
    saved = torch.randn(len(request.slot_mapping), 1, 8)
    path = connector._generate_filename_debug(LAYER, request.token_ids, request.mm_hashes)
    safetensors.torch.save_file({"kv_cache": saved}, path)
    capture = _Capture()
    log = logging.getLogger(ex.__name__)
    log.addHandler(capture)
    try:
        yield SimpleNamespace(
            config=config, connector=connector, layer=layer, metadata=metadata, saved=saved, log=capture
        )
    finally:
        log.removeHandler(capture)


def _example_step(ctx: SimpleNamespace) -> torch.Tensor:
    """One FULL step; returns block 1 of the layer cache as the replay found it."""
    at_replay: list[torch.Tensor] = []
    ctx.layer.kv_cache.zero_()
    run_step(
        ctx.connector,
        vllm_config=ctx.config,
        metadata=ctx.metadata,
        timeline=Timeline(),
        on_run=lambda: at_replay.append(ctx.layer.kv_cache[1].clone()),
    )
    return at_replay[0].permute(1, 0, 2)  # [slots, heads, head_dim], as saved


def test_example_connector_load_is_skipped_on_full_replay_unpatched(example_connector: Any) -> None:
    """Negative control (both releases): the load is skipped with vLLM's own warning and the
    replay runs on blocks nothing wrote."""
    block = _example_step(example_connector)
    assert any("attn_metadata is None" in m for m in example_connector.log.messages)
    assert not block.any()


def test_example_connector_loads_before_full_replay_patched(example_connector: Any) -> None:
    with applied(FIX):
        block = _example_step(example_connector)
    assert not any("attn_metadata is None" in m for m in example_connector.log.messages)
    assert torch.equal(block, example_connector.saved)


# --- (c) the real MoRIIO READ consumer --------------------------------------------------------


def _moriio_read_consumer(timeline: Timeline, in_flight: Any) -> Any:
    """vLLM's real MoRIIOConnector + MoRIIOConnectorWorker (built like vLLM's MoRIIO tests
    build them), READ consumer, with one attention READ issued this step and still in flight.
    Only the MORI engine is stood in for: its blocking wait lands the READ and records it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector as mc

    connector = mc.MoRIIOConnector.__new__(mc.MoRIIOConnector)
    connector.mode = mc.MoRIIOMode.READ
    connector._connector_metadata = None
    worker = mc.MoRIIOConnectorWorker.__new__(mc.MoRIIOConnectorWorker)
    worker.is_producer = False
    worker.mode = mc.MoRIIOMode.READ
    worker._has_mamba = False
    worker.moriio_wrapper = RecordingMoriWrapper(FakeWrapper(), timeline)
    worker._reads_issued_this_step = [in_flight]
    worker._mamba_reads_this_step = []
    worker._eager_handshaked_engines = set()
    connector.connector_worker = worker
    return connector


def _moriio_step() -> tuple[list[str], list[str]]:
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector as mc

    timeline = Timeline()
    read = pending()
    state_at_replay: list[str] = []
    run_step(
        _moriio_read_consumer(timeline, read),
        metadata=mc.MoRIIOConnectorMetadata(),
        timeline=timeline,
        on_run=lambda: state_at_replay.append(read.state),
    )
    return timeline.events, state_at_replay


def test_moriio_read_consumer_replays_before_attention_reads_land_unpatched() -> None:
    """Negative control on 0.32.0: the FULL graph replays while the READ is in flight.
    0.33.0 waits for every READ inside the connector (the guard: still waits patched)."""
    events, at_replay = _moriio_step()
    if V032:
        assert events[0] == "replay" and at_replay == ["pending"]
        assert not any(e.startswith("reads_awaited") for e in events)
    else:
        assert events[:2] == ["reads_awaited:1", "replay"] and at_replay == ["succeeded"]


def test_moriio_read_consumer_awaits_reads_before_full_replay_patched() -> None:
    with applied(FIX):
        events, at_replay = _moriio_step()
    assert events[:2] == ["reads_awaited:1", "replay"]
    assert at_replay == ["succeeded"]
