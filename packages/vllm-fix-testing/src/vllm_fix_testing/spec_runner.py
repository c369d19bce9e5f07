"""A stand-in for the MRV2 model runner's ``self`` in speculative decoding steps (tests only).

``SpecRunner`` drives vLLM's **real** ``GPUModelRunner.sample_tokens`` with the **real**
``ActiveKVConnector`` (built by its own ``__init__`` over a connector installed as vLLM's KV
transfer agent) step after step, the way ``execute_model`` + ``sample_tokens`` do:

1. ``pre_forward`` (real): binds the step's metadata, remembers the async-load kwargs;
2. the target forward saves its layer through ``get_kv_transfer_group().save_kv_layer``, as the
   attention layers' KV-transfer hook does;
3. ``sample_tokens`` (real): samples, builds the async output, runs the drafter, collects the
   KV connector output (where and when the installed vLLM does);
4. ``get_output()`` (real, as installed).

What is stood in: the model, sampler and request state (tensors of the right shapes: the
spec-kv-readiness probe's own stand-ins, :mod:`vllm_fix_spec_kv_readiness.stand_ins`, for any
number of requests and on either device); the drafter (its ``propose`` saves a draft layer
through the agent and, on a GPU, runs a long kernel that writes a draft-KV tensor); the connector
(:class:`recording_connector`, a real ``KVConnectorBase_V1`` subclass that records calls; a save
completes at ``wait_for_save``).

Devices:

* ``device="cpu"``: events are :class:`Event` objects recorded in call order on a
  :class:`StepLog`, and the ``AsyncOutput`` constructor is a host-copy one
  (:func:`cpu_async_output`; the CUDA one cannot run); its inherited ``get_output`` is vLLM's.
  The order of submission is what is checked.
* ``device="cuda"``: everything is real, ``AsyncOutput`` included (real streams, real
  ``torch.cuda.Event``); the drafter sleeps on the device before writing its KV, and
  :attr:`StepResult.draft_done_at_output` says whether the draft's last kernel had finished
  on the device when ``get_output()`` returned.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from vllm_fix_spec_kv_readiness import stand_ins
from vllm_fix_spec_kv_readiness.stand_ins import DRAFT_DONE, DRAFT_LAYER, DRAIN, TARGET_LAYER, Event
from vllm_fix_spec_kv_readiness.stand_ins import Step as StepLog
from vllm_fix_spec_kv_readiness.stand_ins import async_output_class as cpu_async_output

_CONNECTOR_CLASS: Any = None


def recording_connector(*, read_publisher: bool) -> Any:
    """A worker-side KVConnectorBase_V1 that records what the runner asks of it.

    Requests: a save on the target layer belongs to the step's ``t<N>`` request, one on the draft
    layer to ``d<N>``; both are reported in ``finished_sending`` once ``wait_for_save`` has run.
    """
    global _CONNECTOR_CLASS
    if _CONNECTOR_CLASS is None:
        _CONNECTOR_CLASS = _define_connector()
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            is_kv_producer=True, kv_role="kv_producer", kv_connector="Recording"
        )
    )
    connector = _CONNECTOR_CLASS(config, KVConnectorRole.WORKER, None)
    connector.requires_full_step_completion = read_publisher
    return connector


def _define_connector() -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    class RecordingConnector(KVConnectorBase_V1):  # type: ignore[misc]
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            self.log = StepLog()
            self.step = 0
            self.saving: set[str] = set()
            self.done: set[str] = set()
            self.drained: list[set[str]] = []
            self.loads_started = 0

        def _note(self, entry: str) -> None:
            self.log.entries.append(entry)

        def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
            pass

        def bind_connector_metadata(self, connector_metadata: Any) -> None:
            super().bind_connector_metadata(connector_metadata)
            self._note("bind_connector_metadata")

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            self.loads_started += 1
            self._note("start_load_kv")

        def wait_for_layer_load(self, layer_name: str) -> None:
            pass

        def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
            assert self.has_connector_metadata(), f"save_kv_layer({layer_name}) with no metadata bound"
            self._note(f"save_kv_layer:{layer_name}")
            self.saving.add(("d" if layer_name == DRAFT_LAYER else "t") + str(self.step))

        def wait_for_save(self) -> None:
            self._note("wait_for_save")
            self.done |= self.saving
            self.saving = set()

        def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
            self._note(DRAIN)
            done, self.done = self.done, set()
            self.drained.append(set(done))
            return (done or None), None

        def get_block_ids_with_load_errors(self) -> set[int]:
            self._note("invalid_blocks_collected")
            return set()

        def clear_connector_metadata(self) -> None:
            super().clear_connector_metadata()
            self._note("clear_connector_metadata")

        # Scheduler side: unused here.
        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
            return 0, False

        def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
            pass

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            return None

    return RecordingConnector


@contextmanager
def kv_agent(connector: Any) -> Iterator[None]:
    """Install `connector` as vLLM's KV transfer agent (what get_kv_transfer_group returns)."""
    from vllm.distributed.kv_transfer import kv_transfer_state

    previous = kv_transfer_state._KV_CONNECTOR_AGENT
    kv_transfer_state._KV_CONNECTOR_AGENT = connector
    try:
        yield
    finally:
        kv_transfer_state._KV_CONNECTOR_AGENT = previous


@dataclass
class StepResult:
    log: StepLog
    kv_output: Any
    draft_done_at_output: bool | None = None  # cuda only: had the draft kernel finished?


class StepState(SimpleNamespace):
    """What execute_model leaves for sample_tokens; fields a release adds that the step does not
    use (data-parallel sync state, say) read as None."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return None


class Drafter:
    """The speculator. Its forward saves the draft layer through vLLM's KV transfer agent and,
    on a GPU, first sleeps on the device (a long draft kernel) and then writes the draft KV."""

    supports_mm_inputs = False

    def __init__(self, runner: SpecRunner) -> None:
        self.runner = runner
        self.draft_done: Any = None
        self.error: Exception | None = None  # raised by the next propose (a failing draft forward)

    def propose(self, input_batch: Any, attn_metadata: Any, *args: Any, **kwargs: Any) -> Any:
        import torch
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        runner = self.runner
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        if runner.device == "cuda":
            torch.cuda._sleep(runner.draft_sleep_cycles)
            runner.draft_kv.fill_(runner.step_index)
            self.draft_done = torch.cuda.Event()
            self.draft_done.record()
        get_kv_transfer_group().save_kv_layer(DRAFT_LAYER, runner.draft_kv, attn_metadata)
        runner.connector.log.entries.append(DRAFT_DONE)
        return torch.zeros(len(input_batch.req_ids), runner.num_spec, dtype=torch.int64, device=runner.device)


class SpecRunner:
    """Real MRV2 sample_tokens + real ActiveKVConnector, one step at a time."""

    def __init__(
        self,
        *,
        speculative: bool = True,
        read_publisher: bool = True,
        device: str = "cpu",
        draft_sleep_cycles: int = 50_000_000,
        num_reqs: int = 2,
        num_spec: int = 1,
        event_seam: Callable[[Callable[[], Any] | None], None] | None = None,
    ) -> None:
        import torch
        from vllm.config import VllmConfig
        from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

        self.device = device
        self.speculative = speculative
        self.draft_sleep_cycles = draft_sleep_cycles
        self.num_reqs = num_reqs
        self.num_spec = num_spec
        self.step_index = 0
        self.connector = recording_connector(read_publisher=read_publisher)
        vllm_config = VllmConfig()
        if speculative:
            # Only read as "is speculative decoding configured" by the code under test.
            vllm_config.speculative_config = SimpleNamespace(num_speculative_tokens=num_spec)  # type: ignore[assignment]
        self.vllm_config = vllm_config
        with kv_agent(self.connector):
            self.active = ActiveKVConnector(vllm_config, {})
        self.draft_kv = torch.zeros(1024, device=device)
        self.drafter = Drafter(self) if speculative else None
        # CPU only: how the code under test gets its device events (a fix's per-thread override).
        self.event_seam = event_seam

    def _self(self) -> Any:
        import torch

        dev = self.device
        n = self.num_reqs
        reqs = [f"req-{i}" for i in range(n)]
        batch = stand_ins.step_batch(reqs, device=dev)
        batch.num_scheduled_tokens = [1] * n
        state = StepState(
            input_batch=batch,
            attn_metadata={},
            slot_mappings_by_layer={},
            hidden_states=torch.zeros(n, 4, device=dev),
            aux_hidden_states=None,
            dp_sync_state=None,
            finished_req_ids=set(),
            ec_connector_output=None,
            cudagraph_stats=None,
            num_spec_tokens_to_schedule=self.num_spec if self.speculative else 0,
        )
        sample = stand_ins.sampled(n, self.step_index, device=dev)
        draft_tokens = torch.zeros(n, self.num_spec, dtype=torch.int64, device=dev)
        s = stand_ins.runner_self(self.active, self.drafter, state, sample, draft_tokens, self.num_spec)
        if dev == "cuda":
            s.main_stream = torch.cuda.current_stream()
            s.output_copy_stream = self._copy_stream()
        return s, batch

    _stream: Any = None
    _cpu_output: Any = None

    def _copy_stream(self) -> Any:
        import torch

        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream

    def step(self) -> StepResult:
        """One engine step: pre_forward, target forward saves, sample_tokens, get_output."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner

        self.step_index += 1
        self.connector.step = self.step_index
        log = self.connector.log = StepLog()
        runner_self, batch = self._self()
        scheduler_output = SimpleNamespace(kv_connector_metadata=object(), has_sync_kv_loads=False)
        with kv_agent(self.connector), self._device(log):
            self.active.pre_forward(scheduler_output, batch)
            get_kv_transfer_group().save_kv_layer(TARGET_LAYER, None, {})
            out = GPUModelRunner.sample_tokens(runner_self, None)
            result = out.get_output()
            done = None
            if self.device == "cuda" and self.drafter is not None and self.drafter.draft_done is not None:
                done = bool(self.drafter.draft_done.query())
        return StepResult(log, result.kv_connector_output, done)

    @contextmanager
    def _device(self, log: StepLog) -> Iterator[None]:
        if self.device == "cuda":
            yield
            return
        from vllm.v1.worker.gpu import model_runner

        real = model_runner.AsyncOutput
        if self._cpu_output is None or self._cpu_output.__mro__[1] is not real:
            self._cpu_output = cpu_async_output(real, log)
        self._cpu_output.log = log
        model_runner.AsyncOutput = self._cpu_output
        if self.event_seam is not None:
            self.event_seam(lambda: Event("step-done", log))
        try:
            yield
        finally:
            if self.event_seam is not None:
                self.event_seam(None)
            model_runner.AsyncOutput = real


__all__ = [
    "DRAFT_DONE",
    "DRAFT_LAYER",
    "DRAIN",
    "TARGET_LAYER",
    "Drafter",
    "Event",
    "SpecRunner",
    "StepLog",
    "StepResult",
    "StepState",
    "cpu_async_output",
    "kv_agent",
    "recording_connector",
]
