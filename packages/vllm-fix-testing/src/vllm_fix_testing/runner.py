"""A stand-in for the MRV2 GPUModelRunner's ``self``, to run the real ``execute_model`` on CPU.

``GPUModelRunner.execute_model`` is called unbound with a :class:`StandInRunner` as ``self``.
Only what needs a GPU is stood in for: request state (``add_requests`` and friends),
input preparation (``prepare_inputs`` / ``prepare_attn`` hand back a prepared batch and the
step's attention metadata) and the CUDA graph manager (:class:`ReplayRecorder`: it dispatches
the mode a test asks for and records the FULL replay, a PIECEWISE run or an eager forward
instead of launching kernels). Dispatch, the branch choice, the forward contexts, the real
``ActiveKVConnector`` and the connector behind it are vLLM's own.

Every moment that matters lands on one :class:`Timeline` (the connector under test can write
to it too), so a test asserts orderings such as "the load completed before the replay".
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

LAYER = "model.layers.0.self_attn.attn"


@dataclass
class Timeline:
    """Ordered events of one or more steps, and what the forward context was at the replay."""

    events: list[str] = field(default_factory=list)
    context_at_run: list[bool] = field(default_factory=list)
    loads: list[dict[str, Any]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, event: str) -> None:
        with self._lock:
            self.events.append(event)

    def index(self, event: str) -> int:
        return self.events.index(event)

    def before(self, first: str, second: str) -> bool:
        return first in self.events and second in self.events and self.index(first) < self.index(second)


def context_snapshot(forward_context: Any) -> dict[str, Any]:
    """The parts of a ForwardContext a connector's start_load_kv may read."""
    return {
        "mode": forward_context.cudagraph_runtime_mode,
        "attn_metadata": forward_context.attn_metadata,
        "batch_descriptor": forward_context.batch_descriptor,
        "is_padding": forward_context.is_padding,
        "dp_metadata": forward_context.dp_metadata,
        "no_compile_layers": forward_context.no_compile_layers,
    }


class RecordingLoader:
    """A synchronous-load connector that records the context each start_load_kv saw.

    ``fail`` makes start_load_kv raise (after recording), like a connector whose load
    breaks under the context it is given.
    """

    def __init__(self, timeline: Timeline, fail: BaseException | None = None) -> None:
        self.timeline = timeline
        self.fail = fail
        self.bound: list[Any] = []

    def handle_preemptions(self, metadata: Any) -> None:
        pass

    def bind_connector_metadata(self, metadata: Any) -> None:
        self.bound.append(metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.timeline.record("start_load_kv")
        self.timeline.loads.append({**context_snapshot(forward_context), "kwargs": kwargs})
        if self.fail is not None:
            raise self.fail
        self.timeline.record("load_done")

    def finish_forward(self) -> None:
        self.timeline.record("finish_forward")


class ReplayRecorder:
    """The CUDA graph manager: dispatches ``mode`` and records each run instead of replaying.

    ``on_run`` callbacks run at the moment the graph would launch (snapshot a KV cache, look
    at transfer statuses...).
    """

    def __init__(self, mode: str, timeline: Timeline, hidden: Any) -> None:
        from vllm.config import CUDAGraphMode

        self.mode = getattr(CUDAGraphMode, mode)
        self.timeline = timeline
        self.hidden = hidden
        self.on_run: list[Callable[[], None]] = []
        self.dispatched: list[Any] = []

    def dispatch(self, num_reqs: int, num_tokens: int, *args: Any, **kwargs: Any) -> Any:
        from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

        desc = BatchExecutionDescriptor(cg_mode=self.mode, num_tokens=num_tokens, num_reqs=num_reqs)
        self.dispatched.append(desc)
        return desc

    def ran(self, event: str) -> Any:
        from vllm.forward_context import is_forward_context_available

        for callback in self.on_run:
            callback()
        self.timeline.record(event)
        self.timeline.context_at_run.append(is_forward_context_available())
        return self.hidden

    def run_fullgraph(self, desc: Any) -> Any:
        return self.ran("replay")

    def run_pw_graph(self, model: Any, model_inputs: Any) -> Any:
        return self.ran("piecewise")


class _ModelState:
    def __init__(self, attn_metadata: Any) -> None:
        self.attn_metadata = attn_metadata

    def preprocess_state(self, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_attn(self, *args: Any, **kwargs: Any) -> Any:
        return self.attn_metadata

    def prepare_inputs(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return {}


def step_batch(num_reqs: int = 2, padded_to: int | None = None) -> Any:
    """A uniform-decode batch (one token per request) with MRV2 InputBatch's attributes."""
    import numpy as np
    import torch

    padded = padded_to or num_reqs
    is_padding = torch.zeros(padded, dtype=torch.bool)
    is_padding[num_reqs:] = True
    return SimpleNamespace(
        req_ids=[f"req-{i}" for i in range(num_reqs)],
        num_reqs=num_reqs,
        num_reqs_after_padding=padded,
        idx_mapping=torch.arange(num_reqs, dtype=torch.int32),
        idx_mapping_np=np.arange(num_reqs),
        num_scheduled_tokens=np.ones(num_reqs, dtype=np.int32),
        num_tokens=num_reqs,
        num_tokens_after_padding=padded,
        input_ids=torch.zeros(padded, dtype=torch.int64),
        positions=torch.zeros(padded, dtype=torch.int64),
        is_padding=is_padding,
        seq_lens=torch.ones(num_reqs, dtype=torch.int32),
        dcp_local_seq_lens=None,
    )


def step_output(batch: Any, *, sync: bool = True, metadata: Any = None, tokens: int = 1) -> Any:
    """A real SchedulerOutput scheduling ``batch``; ``sync`` sets has_sync_kv_loads."""
    from vllm.v1.core.sched.output import SchedulerOutput

    out = SchedulerOutput.make_empty()
    out.num_scheduled_tokens = {rid: tokens for rid in batch.req_ids}
    out.total_num_scheduled_tokens = tokens * len(batch.req_ids)
    out.kv_connector_metadata = object() if metadata is None else metadata
    out.has_sync_kv_loads = sync
    return out


def active_connector(vllm_config: Any, connector: Any) -> Any:
    """vLLM's real ActiveKVConnector around ``connector``, as its __init__ leaves it
    (minus registering KV caches with a connector that has none)."""
    from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

    active = ActiveKVConnector.__new__(ActiveKVConnector)
    active.vllm_config = vllm_config
    active.kv_connector = connector
    active._pending_load_kwargs = None
    active._disabled = False
    return active


class StandInRunner:
    """What GPUModelRunner.execute_model reads of ``self`` on its way through one step."""

    def __init__(
        self,
        vllm_config: Any,
        kv_connector: Any,
        *,
        mode: str = "FULL",
        batch: Any = None,
        attn_metadata: Any = None,
        timeline: Timeline | None = None,
        dp_size: int = 1,
        dp_rank: int = 0,
    ) -> None:
        import torch

        self.timeline = timeline or Timeline()
        self.input_batch = batch if batch is not None else step_batch()
        self.attn_metadata = (
            attn_metadata
            if attn_metadata is not None
            else {LAYER: SimpleNamespace(num_actual_tokens=self.input_batch.num_tokens)}
        )
        n = self.input_batch.num_tokens_after_padding
        self.vllm_config = vllm_config
        self.kv_connector = kv_connector
        self.cudagraph_manager = ReplayRecorder(mode, self.timeline, torch.zeros(n, 4))
        self.model_state = _ModelState(self.attn_metadata)
        self.model_config = vllm_config.model_config
        self.parallel_config = vllm_config.parallel_config
        self.lora_config = None
        self.encoder_cache = None
        self.aux_output_connector = None
        self.pcp_manager = None
        self.ubatch_runner = None
        self.is_encoder_decoder = False
        self.uses_inputs_embeds = False
        self.supports_mm_inputs = False
        self.is_first_pp_rank = True
        self.is_last_pp_rank = True
        self.use_aux_hidden_state_outputs = False
        self.dp_size, self.dp_rank = dp_size, dp_rank
        self.dcp_size, self.dcp_rank = 1, 0
        self.decode_query_len = 1
        self.req_states = SimpleNamespace(num_computed_tokens=SimpleNamespace(gpu=None))
        self.attn_groups: list[Any] = []
        self.kv_cache_config = SimpleNamespace(kv_cache_groups=[])
        self.observability_config = SimpleNamespace(cudagraph_metrics=False)
        self.block_tables = SimpleNamespace(apply_staged_writes=lambda: None)
        self.eplb = SimpleNamespace(prepare_forward=lambda *a, **k: None)
        self.step_timing = SimpleNamespace(record_batch=lambda *a, **k: None, forward_start=lambda: None)
        self.slot_mappings = torch.zeros((1, n), dtype=torch.int64)
        self.execute_model_state: Any = None

    def model(self, **inputs: Any) -> Any:
        """The eager (NONE) forward."""
        return self.cudagraph_manager.ran("eager")

    def update_pp_decode_requests(self) -> None:
        pass

    def finish_requests(self, scheduler_output: Any) -> None:
        pass

    def free_states(self, scheduler_output: Any) -> None:
        pass

    def add_requests(self, scheduler_output: Any) -> None:
        pass

    def update_requests(self, scheduler_output: Any) -> None:
        pass

    def gather_batch_req_state(self, scheduler_output: Any, dummy_run: bool) -> tuple[Any, int]:
        batch = self.input_batch
        state = SimpleNamespace(
            num_tokens=batch.num_tokens,
            has_prefill=False,
            num_scheduled_tokens=batch.num_scheduled_tokens,
            is_prefilling_np=[False] * batch.num_reqs,
        )
        return state, self.decode_query_len

    def prepare_inputs(self, *args: Any) -> Any:
        return self.input_batch

    def prepare_attn(self, input_batch: Any) -> tuple[Any, Any]:
        return [None], self.slot_mappings

    def _merge_ec_connector_no_forward(self, scheduler_output: Any, output: Any) -> Any:
        self.timeline.record("no_forward")
        return output

    def execute(self, scheduler_output: Any) -> Any:
        """The real GPUModelRunner.execute_model, as installed now, with this stand-in as self."""
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner

        return GPUModelRunner.execute_model(self, scheduler_output)


def run_step(
    connector: Any,
    *,
    mode: str = "FULL",
    sync: bool = True,
    vllm_config: Any = None,
    metadata: Any = None,
    timeline: Timeline | None = None,
    batch: Any = None,
    attn_metadata: Any = None,
    on_run: Callable[[], None] | None = None,
) -> StandInRunner:
    """One real execute_model step dispatched to ``mode`` with ``connector`` behind vLLM's real
    ActiveKVConnector. Returns the runner (its ``timeline``, ``input_batch``, ``attn_metadata``)."""
    from vllm.config import VllmConfig

    config = vllm_config if vllm_config is not None else VllmConfig()
    runner = StandInRunner(
        config,
        active_connector(config, connector),
        mode=mode,
        batch=batch,
        attn_metadata=attn_metadata,
        timeline=timeline if timeline is not None else getattr(connector, "timeline", None),
    )
    if on_run is not None:
        runner.cudagraph_manager.on_run.append(on_run)
    runner.execute(step_output(runner.input_batch, sync=sync, metadata=metadata))
    return runner


class RecordingMoriWrapper:
    """The blocking READ barrier of a MoRIIOWrapper (``waiting_for_transfer_complete``).

    The native engine would block until the statuses land; here the RDMA "lands" while the
    host waits: each awaited status is marked succeeded and the wait is recorded.
    Other wrapper calls go to ``inner`` (a :class:`vllm_fix_testing.FakeWrapper`).
    """

    def __init__(self, inner: Any, timeline: Timeline) -> None:
        self._inner = inner
        self.timeline = timeline
        self.awaited: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def waiting_for_transfer_complete(self, transfer_statuses: Any = None, **kwargs: Any) -> None:
        statuses = list(transfer_statuses or [])
        for status in statuses:
            status.succeed()
        self.awaited.extend(statuses)
        self.timeline.record(f"reads_awaited:{len(statuses)}")


__all__ = [
    "LAYER",
    "RecordingLoader",
    "RecordingMoriWrapper",
    "ReplayRecorder",
    "StandInRunner",
    "Timeline",
    "active_connector",
    "context_snapshot",
    "run_step",
    "step_batch",
    "step_output",
]
