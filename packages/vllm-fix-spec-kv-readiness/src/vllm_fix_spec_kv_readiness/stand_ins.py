"""CPU stand-ins for what a speculative step through the MRV2 ``sample_tokens`` needs a GPU for.

The probe (``probe.py``) runs the real, installed ``GPUModelRunner.sample_tokens`` with these:

* the runner's ``self`` (:func:`runner_self`): the attributes ``sample_tokens`` reads (sampled
  tokens, request state, a drafter, the connector); optional features it asks about are absent;
* :class:`Drafter`: its ``propose`` saves a draft layer through the bound connector, which is
  what the attention layers' KV-transfer hook does, and then marks its last kernel;
* :class:`Connector`: the worker-side connector, recording the order of calls; a save
  completes at ``wait_for_save``;
* device events (:class:`Event`), recorded in call order on one :class:`Step`, and an
  ``AsyncOutput`` whose constructor a CPU can run (:func:`async_output_class`).

These are the stand-ins the runtime probe decides with; the test support package
(``vllm_fix_testing.spec_runner``) builds its steps from them rather than carrying its own.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import MethodType, SimpleNamespace
from typing import Any

from vllm_fix_spec_kv_readiness import releases

TARGET_LAYER = "model.layers.0.self_attn.attn"
DRAFT_LAYER = "draft_model.layers.0.self_attn.attn"
# Which request a save on each layer belongs to (one request per layer keeps it readable).
SAVES = {TARGET_LAYER: "r-target", DRAFT_LAYER: "r-draft"}
DRAFT_DONE = "draft_kv_written"
DRAIN = "kv_output_collected"


@dataclass
class Step:
    """One step's record: calls in submission order, and which events get_output waited on."""

    entries: list[str] = field(default_factory=list)
    synced: list[Event] = field(default_factory=list)

    def at(self, entry: str) -> int:
        return self.entries.index(entry) if entry in self.entries else -1

    def count(self, entry: str) -> int:
        return self.entries.count(entry)


class Event:
    """A device event on a CPU: where in the step it was recorded, and whether it was waited on."""

    def __init__(self, name: str, step: Step) -> None:
        self.name = name
        self.step = step
        self.recorded_at = -1

    def record(self, stream: Any = None) -> None:
        self.recorded_at = len(self.step.entries)
        self.step.entries.append(f"record:{self.name}")

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
        self.step.entries.append(entry)

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
        self.connector.step.entries.append(DRAFT_DONE)
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


@functools.lru_cache(maxsize=8)
def _init_attributes(cls: type) -> frozenset[str] | None:
    """The attributes ``cls.__init__`` sets on ``self`` (read from its source, once per class);
    None when the source cannot be read."""
    init = cls.__dict__.get("__init__")
    if init is None:
        return None
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
    except (OSError, TypeError, SyntaxError):
        return None
    names = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        ):
            names.add(node.attr)
    return frozenset(names)


def async_output_class(base: type, step: Step) -> Any:
    """vLLM's AsyncOutput with the constructor a CPU can run: host copies, and the copy event
    recorded where vLLM records it (when sample_tokens builds the output). get_output is
    inherited: the installed one runs. The class's ``log`` is the step being recorded (whoever
    reuses the class for the next step sets it). Attributes vLLM's own constructor sets and this
    one does not (optional outputs: logprobs, NaN counts, aux, ...) read as None; any other
    attribute is missing, as it would be on vLLM's object."""
    optional = _init_attributes(base)

    class ProbeAsyncOutput(base):  # type: ignore[misc, valid-type]
        log: Step

        def __init__(self, model_runner_output: Any, sampler_output: Any, num_sampled_tokens: Any, **_: Any):
            self.model_runner_output = model_runner_output
            self.sampled_token_ids = sampler_output.sampled_token_ids.numpy()
            self.num_sampled_tokens_np = num_sampled_tokens.numpy()
            self.prompt_logprobs_dict: dict[str, Any] = {}
            self.prompt_token_id_logprobs_dict: dict[str, Any] = {}
            self.copy_event = Event("copy", type(self).log)
            self.copy_event.record()

        def __getattr__(self, name: str) -> Any:  # optional outputs (logprobs, NaN counts, aux, ...)
            if name.startswith("__") or (optional is not None and name not in optional):
                raise AttributeError(name)
            return None

    ProbeAsyncOutput.log = step
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


def step_batch(req_ids: list[str], device: Any = None) -> Any:
    """The step's input batch: one scheduled token per request."""
    import torch

    n = len(req_ids)
    return SimpleNamespace(
        req_ids=req_ids,
        idx_mapping=torch.arange(n, device=device),
        query_start_loc=torch.arange(n + 1, device=device),
        num_tokens=n,
        num_reqs=n,
    )


def sampled(num_reqs: int, token: int = 0, device: Any = None) -> tuple[Any, Any, Any]:
    """What the sampler returns for a step: (sampler output, tokens sampled per request,
    tokens rejected per request); every request samples ``token``, none is rejected."""
    import torch

    num_sampled = torch.ones(num_reqs, dtype=torch.int32, device=device)
    num_rejected = torch.zeros(num_reqs, dtype=torch.int32, device=device)
    sampler_output = SimpleNamespace(
        sampled_token_ids=torch.full((num_reqs, 1), token, dtype=torch.int64, device=device),
        logprobs_tensors=None,
        num_nans=None,
        sampling_mask_tensors=None,
        num_rejected=num_rejected,
    )
    return sampler_output, num_sampled, num_rejected


def runner_self(
    active: Any, drafter: Any, state: Any, sample: tuple[Any, Any, Any], draft_tokens: Any, num_spec: int
) -> Any:
    """The runner's ``self`` for one step: ``state`` is what execute_model left for
    sample_tokens, ``sample`` what the sampler returns (:func:`sampled`), ``drafter`` the
    speculator (None: a non-speculative step)."""
    from vllm.v1.worker.gpu import model_runner

    self: Any = Runner()
    self.execute_model_state = state
    self.is_last_pp_rank = True
    self.use_async_scheduling = True  # sample_tokens hands out its AsyncOutput
    self.sample = lambda *args, **kwargs: sample
    self.prompt_logprobs_worker = _NoPromptLogprobs()
    self.model = _Model()
    gpu = SimpleNamespace(gpu=None, np=None)
    self.req_states = _Columns(last_sampled_tokens=None, next_prefill_tokens=None, draft_tokens=draft_tokens)
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


def runner(active: Any, drafter: Drafter | None, kv_connector_output: Any, num_spec: int = 1) -> Any:
    """The probe's step: two requests (one per layer a save is issued on), in the installed
    runner's form of the state execute_model leaves."""
    import torch
    from vllm.v1.worker.gpu import model_runner

    reqs = ["r-target", "r-draft"]
    batch = step_batch(reqs)
    # What execute_model leaves for sample_tokens, in the installed runner's form.
    state = releases.step_state(
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
    draft_tokens = torch.zeros(len(reqs), max(num_spec, 1), dtype=torch.int64)
    return runner_self(active, drafter, state, sampled(len(reqs)), draft_tokens, num_spec)
