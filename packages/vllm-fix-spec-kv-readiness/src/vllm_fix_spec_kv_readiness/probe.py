"""Does this vLLM's MRV2 runner hand out a speculative step's KV output too early?

Runs the real, currently installed ``GPUModelRunner.sample_tokens`` for one step, with the
real ``ActiveKVConnector`` (``post_forward`` / ``finalize_step`` as installed) and the real
``AsyncOutput.get_output`` (as installed). Where the installed ``execute_model`` collects the
KV connector output itself (0.15 - 0.21), the probe makes that ``post_forward`` call as
``execute_model`` does, after the target forward's saves and before ``sample_tokens``. What
differs between releases (the form of the state ``execute_model`` leaves, where the output is
collected, ``post_forward``'s arguments) is read from the installed code in ``releases.py``.
Only what a CPU process lacks is stood in for, and only for the duration of the probe, in
this thread:

* the runner's ``self``: the attributes ``sample_tokens`` reads (sampled tokens, request
  state, a drafter whose ``propose`` saves a draft layer through the bound connector, which
  is what the attention layers' KV-transfer hook does, and then marks its last kernel);
* the worker-side connector: records the order of calls; a save completes at ``wait_for_save``;
* device events: recorded in call order (an ``AsyncOutput`` that records its copy event where
  vLLM's does; step-done events created by whatever the installed code asks for).

On CPU the order of submission is the device order (one stream), so "the output waits on an
event recorded after the draft's last kernel" is checked as an ordering. The checks:

* ``kv-output-misses-step-saves`` (0.15 - 0.21, 0.33.0): the step's ``KVConnectorOutput`` does
  not report the saves the target and draft forwards issued and ``wait_for_save`` completed;
* ``output-visible-before-draft-kv`` (0.15 - 0.33.0): ``get_output()`` waits on nothing
  recorded after the draft's last kernel, for a connector that publishes blocks for READ;
* guards: the transfer results are drained exactly once per step; a connector that does not
  publish for READ keeps the overlap (no extra wait); a non-speculative step drains once,
  after ``wait_for_save``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import MethodType, SimpleNamespace
from typing import Any

from vllm_fix_core import Check, NotApplicable, ProbeReport
from vllm_fix_spec_kv_readiness import readiness, releases

TARGET_LAYER = "model.layers.0.self_attn.attn"
DRAFT_LAYER = "draft_model.layers.0.self_attn.attn"
# Which request a save on each layer belongs to (one request per layer keeps it readable).
SAVES = {TARGET_LAYER: "r-target", DRAFT_LAYER: "r-draft"}
DRAFT_DONE = "draft_kv_written"
DRAIN = "kv_output_collected"
_lock = threading.Lock()  # the probe swaps model_runner.AsyncOutput while it runs


@dataclass
class Step:
    """One step's record: calls in order, and which events get_output waited on."""

    log: list[str] = field(default_factory=list)
    synced: list[Event] = field(default_factory=list)

    def at(self, entry: str) -> int:
        return self.log.index(entry) if entry in self.log else -1

    def count(self, entry: str) -> int:
        return self.log.count(entry)


class Event:
    """A device event on a CPU: remembers when it was recorded and who waited on it."""

    def __init__(self, name: str, step: Step) -> None:
        self.name = name
        self.step = step
        self.recorded_at = -1

    def record(self, stream: Any = None) -> None:
        self.recorded_at = len(self.step.log)
        self.step.log.append(f"record:{self.name}")

    def synchronize(self) -> None:
        self.step.synced.append(self)

    def query(self) -> bool:
        return True


class Connector:
    """Worker-side KV connector that records calls; a save completes at wait_for_save."""

    def __init__(self, step: Step, *, read_publisher: bool) -> None:
        self.step = step
        self.requires_full_step_completion = read_publisher
        self._saving: set[str] = set()
        self._done: set[str] = set()

    def _log(self, entry: str) -> None:
        self.step.log.append(entry)

    def bind_connector_metadata(self, metadata: Any) -> None:
        self._log("bind_connector_metadata")

    def handle_preemptions(self, metadata: Any) -> None:
        pass

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._log("start_load_kv")

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        self._log(f"save_kv_layer:{layer_name}")
        self._saving.add(SAVES[layer_name])

    def wait_for_save(self) -> None:
        self._log("wait_for_save")
        self._done |= self._saving
        self._saving.clear()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._log(DRAIN)
        done, self._done = self._done, set()
        return (done or None), None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        sending, _ = self.get_finished(finished_req_ids)
        return SimpleNamespace(
            finished_sending=set(sending or ()), finished_recving=set(), failed_recving=set()
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._log("invalid_blocks_collected")
        return set()

    def get_kv_connector_stats(self) -> None:
        return None

    def get_kv_connector_kv_cache_events(self) -> None:
        return None

    def build_connector_worker_meta(self) -> None:
        return None

    def clear_connector_metadata(self) -> None:
        self._log("clear_connector_metadata")

    def finish_forward(self) -> None:
        pass


class Drafter:
    """The speculator: its forward saves a draft layer through the bound connector."""

    supports_mm_inputs = False

    def __init__(self, connector: Connector, num_spec: int) -> None:
        self.connector = connector
        self.num_spec = num_spec

    def propose(self, input_batch: Any, attn_metadata: Any, *args: Any, **kwargs: Any) -> Any:
        import torch

        self.connector.save_kv_layer(DRAFT_LAYER, None, attn_metadata)
        self.connector.step.log.append(DRAFT_DONE)
        return torch.zeros(len(input_batch.req_ids), self.num_spec, dtype=torch.int64)


class Runner:
    """The runner's ``self``: what sample_tokens reads. Optional features it asks about
    (pipeline / context parallelism, aux outputs, adaptive verification, ...) are absent."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return None


class _Columns:
    """Request-state columns (``.gpu`` / ``.np``) sample_tokens passes on to code the probe stands
    in for; whichever columns a release has, each reads as an empty column."""

    def __init__(self, **known: Any) -> None:
        self.__dict__.update(known)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return SimpleNamespace(gpu=None, np=None)


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


def async_output_class(base: type, step: Step) -> type:
    """vLLM's AsyncOutput with the constructor a CPU can run: host copies, and the copy event
    recorded where vLLM records it (when sample_tokens builds the output). get_output is
    inherited: the installed one runs."""

    class ProbeAsyncOutput(base):  # type: ignore[misc, valid-type]
        def __init__(self, model_runner_output: Any, sampler_output: Any, num_sampled_tokens: Any, **_: Any):
            self.model_runner_output = model_runner_output
            self.sampled_token_ids = sampler_output.sampled_token_ids.numpy()
            self.num_sampled_tokens_np = num_sampled_tokens.numpy()
            self.prompt_logprobs_dict: dict[str, Any] = {}
            self.prompt_token_id_logprobs_dict: dict[str, Any] = {}
            self.copy_event = Event("copy", step)
            self.copy_event.record()

        def __getattr__(self, name: str) -> Any:  # optional outputs (logprobs, NaN counts, aux, ...)
            if name.startswith("__"):
                raise AttributeError(name)
            return None

    return ProbeAsyncOutput


def active_connector(connector: Connector, speculative: bool) -> Any:
    """vLLM's real ActiveKVConnector over `connector`, without its __init__ (which reaches for
    the process-wide KV transfer agent): per-step state a release keeps in attributes this
    probe does not set reads as None (nothing pending)."""
    from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

    cls: Any = _PROBE_ACTIVE.get(ActiveKVConnector)
    if cls is None:

        class ProbeActiveKVConnector(ActiveKVConnector):  # type: ignore[misc, valid-type]
            def __getattr__(self, name: str) -> Any:
                if name.startswith("__"):
                    raise AttributeError(name)
                return None

        cls = _PROBE_ACTIVE[ActiveKVConnector] = ProbeActiveKVConnector
    active = cls.__new__(cls)
    active.vllm_config = SimpleNamespace(speculative_config=object() if speculative else None)
    active.kv_connector = connector
    active._pending_load_kwargs = None
    active._disabled = False
    return active


_PROBE_ACTIVE: dict[type, type] = {}


def runner(active: Any, drafter: Drafter | None, kv_connector_output: Any, num_spec: int = 1) -> Any:
    import torch
    from vllm.v1.worker.gpu import model_runner

    reqs = ["r-target", "r-draft"]
    batch = SimpleNamespace(
        req_ids=reqs,
        idx_mapping=torch.arange(len(reqs)),
        query_start_loc=torch.tensor([0, 1, 2]),
        num_tokens=len(reqs),
        num_reqs=len(reqs),
    )
    sampled = torch.zeros(len(reqs), 1, dtype=torch.int64)
    num_sampled = torch.ones(len(reqs), dtype=torch.int32)
    num_rejected = torch.zeros(len(reqs), dtype=torch.int32)
    sampler_output = SimpleNamespace(
        sampled_token_ids=sampled,
        logprobs_tensors=None,
        num_nans=None,
        sampling_mask_tensors=None,
        num_rejected=num_rejected,
    )
    self: Any = Runner()
    # What execute_model leaves for sample_tokens, in the installed runner's form.
    self.execute_model_state = releases.step_state(
        model_runner,
        {
            "input_batch": batch,
            "attn_metadata": {},
            "slot_mappings_by_layer": {},
            "hidden_states": torch.zeros(len(reqs), 4),
            "finished_req_ids": set(),
            "num_spec_tokens_to_schedule": num_spec if drafter else 0,
            "kv_connector_output": kv_connector_output,
        },
    )
    self.is_last_pp_rank = True
    self.use_async_scheduling = True  # sample_tokens hands out its AsyncOutput
    self.sample = lambda *args, **kwargs: (sampler_output, num_sampled, num_rejected)
    self.prompt_logprobs_worker = _NoPromptLogprobs()
    self.model = _Model()
    gpu = SimpleNamespace(gpu=None, np=None)
    self.req_states = _Columns(
        last_sampled_tokens=None,
        next_prefill_tokens=None,
        draft_tokens=torch.zeros(len(reqs), max(num_spec, 1), dtype=torch.int64),
    )
    self.check_ep_fault = False
    self.kv_connector = active
    self.speculator = drafter
    self.do_spec_decode = drafter is not None  # 0.15 - 0.16 ask this, then call propose_draft
    if hasattr(model_runner.GPUModelRunner, "propose_draft"):
        self.propose_draft = MethodType(model_runner.GPUModelRunner.propose_draft, self)
    self.model_state = SimpleNamespace(supports_mm_inputs=False)
    # Request-state updates on the device (named postprocess before 0.24).
    self.postprocess_sampled = self.postprocess = lambda *args, **kwargs: None
    self.sampler = SimpleNamespace(sampling_states=SimpleNamespace(temperature=gpu, seeds=gpu))
    self._draft_workspace_lane = 1
    self.num_speculative_steps = num_spec if drafter else 0
    self.draft_tokens_handler = SimpleNamespace(set_draft_tokens=lambda *args, **kwargs: None)
    self.eplb = _Eplb()
    return self


@contextmanager
def _cpu_device(step: Step) -> Iterator[None]:
    from vllm.v1.worker.gpu import model_runner

    with _lock:
        real = model_runner.AsyncOutput
        model_runner.AsyncOutput = async_output_class(real, step)
        readiness.override_events(lambda: Event("step-done", step))
        try:
            yield
        finally:
            readiness.override_events(None)
            model_runner.AsyncOutput = real


@dataclass
class Outcome:
    step: Step
    kv_output: Any
    drafted: bool


def run_step(*, speculative: bool, read_publisher: bool) -> Outcome:
    """One step through the installed sample_tokens: target saves, sampling, draft, output."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    sample_tokens = getattr(GPUModelRunner, "sample_tokens", None)
    if sample_tokens is None:
        raise NotApplicable("this vLLM's MRV2 runner has no sample_tokens (no speculative step to order)")
    step = Step()
    connector = Connector(step, read_publisher=read_publisher)
    drafter = Drafter(connector, 1) if speculative else None
    active = active_connector(connector, speculative)
    # What execute_model does before sample_tokens: metadata bound, the target forward's saves
    # issued and, where the installed execute_model collects the KV connector output itself,
    # its post_forward call (through the class, so whatever is installed runs).
    connector.bind_connector_metadata(object())
    connector.save_kv_layer(TARGET_LAYER, None, {})
    kv_connector_output = None
    if releases.collects_in_execute_model(GPUModelRunner):
        if not releases.post_forward_takes_scheduler_output(type(active)):
            raise RuntimeError("execute_model calls post_forward, which does not take the scheduler output")
        kv_connector_output = active.post_forward(SimpleNamespace(finished_req_ids=set()))
    self = runner(active, drafter, kv_connector_output)
    with _cpu_device(step):
        out = sample_tokens(self, None)
        if out is None or not hasattr(out, "get_output"):
            raise RuntimeError(f"sample_tokens returned {type(out).__name__}, not an async output")
        result = out.get_output()
    return Outcome(step, result.kv_connector_output, DRAFT_DONE in step.log)


def _finished(outcome: Outcome) -> set[str]:
    return set(getattr(outcome.kv_output, "finished_sending", None) or ())


def probe() -> ProbeReport:
    spec = run_step(speculative=True, read_publisher=True)
    if not spec.drafted:
        raise NotApplicable("this vLLM's MRV2 sample_tokens runs no speculator")
    log = spec.step.log
    missing = set(SAVES.values()) - _finished(spec)
    early = 0 <= spec.step.at(DRAIN) < spec.step.at(DRAFT_DONE)
    last_kernel = spec.step.at(DRAFT_DONE)
    waited = sorted((e.name, e.recorded_at) for e in spec.step.synced)
    ready = any(e.recorded_at > last_kernel for e in spec.step.synced)

    overlap = run_step(speculative=True, read_publisher=False)
    extra_waits = [e.name for e in overlap.step.synced if e.name != "copy"]

    plain = run_step(speculative=False, read_publisher=True)
    plain_ok = (
        plain.step.count(DRAIN) == 1
        and plain.step.at("wait_for_save") < plain.step.at(DRAIN)
        and _finished(plain) == {"r-target"}
    )
    return ProbeReport(
        (
            Check(
                "kv-output-misses-step-saves",
                bool(missing) or early,
                f"step output lacks {sorted(missing)}; order {log}" if missing or early else "",
            ),
            Check(
                "output-visible-before-draft-kv",
                not ready,
                ""
                if ready
                else f"get_output waited on {waited}, draft's last kernel at {last_kernel}; order {log}",
            ),
            Check(
                "transfer-results-drained-once",
                spec.step.count(DRAIN) != 1,
                f"{spec.step.count(DRAIN)} drains in one speculative step",
                guard=True,
            ),
            Check(
                "non-read-connector-keeps-overlap",
                bool(extra_waits),
                f"get_output also waited on {extra_waits}",
                guard=True,
            ),
            Check("non-speculative-step-unchanged", not plain_ok, f"order {plain.step.log}", guard=True),
        )
    )
