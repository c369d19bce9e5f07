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

What is stood in: the model, sampler and request state (tensors of the right shapes); the
drafter (its ``propose`` saves a draft layer through the agent and, on a GPU, runs a long kernel
that writes a draft-KV tensor); the connector (:class:`recording_connector`, a real
``KVConnectorBase_V1`` subclass that records calls; a save completes at ``wait_for_save``).

Devices:

* ``device="cpu"``: events are :class:`Event` objects recorded in call order, and the
  ``AsyncOutput`` constructor is a host-copy one (the CUDA one cannot run); its inherited
  ``get_output`` is vLLM's. The order of submission is what is checked.
* ``device="cuda"``: everything is real, ``AsyncOutput`` included (real streams, real
  ``torch.cuda.Event``); the drafter sleeps on the device before writing its KV, and
  :attr:`StepResult.draft_done_at_output` says whether the draft's last kernel had finished
  on the device when ``get_output()`` returned.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

TARGET_LAYER = "model.layers.0.self_attn.attn"
DRAFT_LAYER = "draft_model.layers.0.self_attn.attn"
DRAFT_DONE = "draft_kv_written"
DRAIN = "kv_output_collected"


@dataclass
class StepLog:
    """One step: calls in submission order, and the events ``get_output`` waited on."""

    entries: list[str] = field(default_factory=list)
    synced: list[Event] = field(default_factory=list)

    def at(self, entry: str) -> int:
        return self.entries.index(entry) if entry in self.entries else -1

    def count(self, entry: str) -> int:
        return self.entries.count(entry)


class Event:
    """A device event on a CPU: where in the step it was recorded, and whether it was waited on."""

    def __init__(self, name: str, log: StepLog) -> None:
        self.name = name
        self.log = log
        self.recorded_at = -1

    def record(self, stream: Any = None) -> None:
        self.recorded_at = len(self.log.entries)
        self.log.entries.append(f"record:{self.name}")

    def synchronize(self) -> None:
        self.log.synced.append(self)

    def query(self) -> bool:
        return True


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


class _Model:
    def compute_logits(self, hidden_states: Any) -> Any:
        return hidden_states


class _NoPromptLogprobs:
    def compute_prompt_logprobs(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return {}

    def compute_prompt_token_id_logprobs(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return {}


class _Eplb:
    def step(self, *args: Any, **kwargs: Any) -> None:
        pass

    @contextmanager
    def suppress(self) -> Iterator[None]:
        yield


class RunnerSelf:
    """The runner's ``self``: optional features sample_tokens asks about are absent (None)."""

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
        batch = SimpleNamespace(
            req_ids=reqs,
            idx_mapping=torch.arange(n, device=dev),
            query_start_loc=torch.arange(n + 1, device=dev),
            num_tokens=n,
            num_reqs=n,
            num_scheduled_tokens=[1] * n,
        )
        num_sampled = torch.ones(n, dtype=torch.int32, device=dev)
        num_rejected = torch.zeros(n, dtype=torch.int32, device=dev)
        sampler_output = SimpleNamespace(
            sampled_token_ids=torch.full((n, 1), self.step_index, dtype=torch.int64, device=dev),
            logprobs_tensors=None,
            num_nans=None,
            sampling_mask_tensors=None,
            num_rejected=num_rejected,
        )
        s: Any = RunnerSelf()
        s.execute_model_state = StepState(
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
        s.is_last_pp_rank = True
        s.sample = lambda *args, **kwargs: (sampler_output, num_sampled, num_rejected)
        s.prompt_logprobs_worker = _NoPromptLogprobs()
        s.model = _Model()
        state = SimpleNamespace(gpu=None, np=None)
        s.req_states = SimpleNamespace(
            all_token_ids=state,
            num_computed_tokens=state,
            prompt_len=state,
            last_sampled_tokens=None,
            next_prefill_tokens=None,
            draft_tokens=torch.zeros(n, self.num_spec, dtype=torch.int64, device=dev),
        )
        if dev == "cuda":
            s.main_stream = torch.cuda.current_stream()
            s.output_copy_stream = self._copy_stream()
        s.check_ep_fault = False
        s.kv_connector = self.active
        s.speculator = self.drafter
        s.model_state = SimpleNamespace(supports_mm_inputs=False)
        s.postprocess_sampled = lambda *args, **kwargs: None
        s.sampler = SimpleNamespace(sampling_states=SimpleNamespace(temperature=state, seeds=state))
        s._draft_workspace_lane = 1
        s.num_speculative_steps = self.num_spec if self.speculative else 0
        s.draft_tokens_handler = SimpleNamespace(set_draft_tokens=lambda *args, **kwargs: None)
        s.eplb = _Eplb()
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


def cpu_async_output(base: type, log: StepLog) -> Any:
    """vLLM's AsyncOutput with a constructor a CPU can run (host copies, the copy event recorded
    where vLLM records it); get_output is inherited, so the installed one runs. The class's
    ``log`` is the step being recorded (a runner reuses the class and sets it per step)."""

    class CpuAsyncOutput(base):  # type: ignore[misc, valid-type]
        def __init__(self, model_runner_output: Any, sampler_output: Any, num_sampled_tokens: Any, **_: Any):
            self.model_runner_output = model_runner_output
            self.sampled_token_ids = sampler_output.sampled_token_ids.numpy()
            self.num_sampled_tokens_np = num_sampled_tokens.numpy()
            self.prompt_logprobs_dict: dict[str, Any] = {}
            self.prompt_token_id_logprobs_dict: dict[str, Any] = {}
            self.copy_event = Event("copy", type(self).log)
            self.copy_event.record()

        def __getattr__(self, name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            return None

    CpuAsyncOutput.log = log
    return CpuAsyncOutput
