"""The MRV2 GPUModelRunner's ``self`` stood in for, to run the real ``execute_model`` on CPU (tests).

The stand-ins are the sync-load-context probe's own (:mod:`vllm_fix_sync_load_context.stand_ins`),
extended here for tests: :class:`StandInRunner` builds its batch, attention metadata and graph
manager from keyword arguments and runs a step itself (:meth:`StandInRunner.execute`);
:class:`ReplayRecorder` (the CUDA graph manager) dispatches the counts the runner asks for, keeps
what it dispatched and calls ``on_run`` callbacks at the moment a graph would launch; every
moment that matters lands on one :class:`Timeline` (the connector under test can write to it
too), so a test asserts orderings such as "the load completed before the replay". Only what
needs a GPU is stood in for; dispatch, the branch choice, the forward contexts and the real
``ActiveKVConnector`` are vLLM's own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from vllm_fix_sync_load_context import stand_ins
from vllm_fix_sync_load_context.stand_ins import active_connector, step_output

LAYER = "model.layers.0.self_attn.attn"


@dataclass
class Timeline(stand_ins.Seen):
    """Ordered events of one or more steps (recorded from any thread), the loads a connector
    saw, and whether a forward context was open at each run of the model."""

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


class ReplayRecorder(stand_ins.Graphs):
    """The CUDA graph manager: dispatches ``mode`` for the counts the runner asks for, keeps each
    descriptor it dispatched and records each run instead of replaying.

    ``on_run`` callbacks run at the moment the graph would launch (snapshot a KV cache, look
    at transfer statuses...).
    """

    def __init__(self, mode: str, timeline: Timeline, hidden: Any) -> None:
        from vllm.config import CUDAGraphMode

        # The graph replays the hidden states of the whole (padded) batch.
        super().__init__(getattr(CUDAGraphMode, mode), timeline, hidden, padded_to=len(hidden))
        self.on_run: list[Callable[[], None]] = []
        self.dispatched: list[Any] = []

    def dispatch(self, num_reqs: int, num_tokens: int, *args: Any, **kwargs: Any) -> Any:
        desc = self.descriptor(num_reqs, num_tokens)
        self.dispatched.append(desc)
        return desc

    def ran(self, event: str) -> Any:
        for callback in self.on_run:
            callback()
        return super().ran(event)


def step_batch(num_reqs: int = 2, padded_to: int | None = None) -> Any:
    """A uniform-decode batch (one token per request) with MRV2 InputBatch's attributes."""
    return stand_ins.step_batch(num_reqs, padded_to or num_reqs, prefix="req")


class StandInRunner(stand_ins.StandInRunner):
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
        batch = batch if batch is not None else step_batch()
        self.attn_metadata = (
            attn_metadata
            if attn_metadata is not None
            else {LAYER: SimpleNamespace(num_actual_tokens=batch.num_tokens)}
        )
        graphs = ReplayRecorder(mode, self.timeline, torch.zeros(batch.num_tokens_after_padding, 4))
        super().__init__(vllm_config, kv_connector, graphs, batch, self.attn_metadata)
        self.dp_size, self.dp_rank = dp_size, dp_rank
        self.execute_model_state: Any = None

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
