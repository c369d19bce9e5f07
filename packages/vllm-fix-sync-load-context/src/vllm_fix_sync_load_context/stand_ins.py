"""CPU stand-ins for what the MRV2 ``GPUModelRunner.execute_model`` needs a GPU for.

The probe (``probe.py``) runs the real, installed ``execute_model`` unbound with a
:class:`StandInRunner` as ``self``. What the step reads is vLLM's own wherever a CPU host can
build it: the configs (the probe's ``VllmConfig``, built by ``vllm_fix_core.guest.build``
without platform hooks, and its sub-configs), the step's ``InputBatch``, its attention metadata
(``CommonAttentionMetadata``), ``KVCacheConfig``, ``InputBuffers``, ``EPLBController``,
``StepTimingCollector``, ``BatchReqState`` and ``SchedulerOutput``; a release that reads one more
field of them finds vLLM's default. Stood in for is only what needs a GPU:

- request state and block tables (``RequestState`` / ``BlockTables`` allocate UVA and device
  buffers) and the draft-token handler (``DraftTokensHandler`` opens a CUDA stream and event);
- input preparation (``prepare_inputs`` / ``prepare_attn`` and the model state hand back the
  prepared batch and the step's attention metadata instead of running kernels);
- the CUDA graph manager (:class:`Graphs`: it dispatches the mode it is given and records the
  FULL replay, a PIECEWISE run or an eager forward instead of launching kernels).

Dispatch, the branch choice, the forward contexts, the real ``ActiveKVConnector`` and vLLM's own
connector base class are vLLM's.

These are the stand-ins the runtime probe decides with; the test support package
(``vllm_fix_testing.runner``) extends them rather than carrying its own.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from dataclasses import dataclass, field
from typing import Any

# The probe's FULL step: 3 decodes padded to a captured graph of 4 (the padded count differs
# from the scheduled one, so a context built from the unpadded batch is seen as wrong).
NUM_REQS = 3
PADDED_TO = 4
# What a load records for a forward-context field the installed release does not have.
NO_FIELD = object()
# The probe model's one attention layer.
LAYER = "model.layers.0.self_attn.attn"


@dataclass
class Seen:
    """What the connector saw in start_load_kv, the order of events, and whether a forward
    context was open at each run of the model (replay, piecewise or eager)."""

    loads: list[dict[str, Any]] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    context_at_run: list[bool] = field(default_factory=list)

    def record(self, event: str) -> None:
        self.events.append(event)


class _Recording:
    """What the recording connector adds to vLLM's own connector base: the context of each load."""

    seen: Seen

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.seen.record("start_load_kv")
        self.seen.loads.append(
            {
                "mode": forward_context.cudagraph_runtime_mode,
                "attn_metadata": forward_context.attn_metadata,
                "batch_descriptor": forward_context.batch_descriptor,
                # Releases whose forward context has no padding mask (before 0.28) leave it out.
                "is_padding": getattr(forward_context, "is_padding", NO_FIELD),
            }
        )

    def wait_for_save(self) -> None:
        pass


@functools.lru_cache(maxsize=1)
def _loader_class() -> type:
    """The installed KVConnectorBase_V1 with its abstract methods as no-ops and start_load_kv
    recording: every other call ActiveKVConnector makes (preemptions, binding, completions,
    stats, events, worker meta) is vLLM's own default of that release."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    def noop(self: Any, *args: Any, **kwargs: Any) -> Any:
        return None

    abstract = {name: noop for name in getattr(KVConnectorBase_V1, "__abstractmethods__", ())}
    own = {k: v for k, v in vars(_Recording).items() if callable(v)}
    return type("RecordingLoader", (KVConnectorBase_V1,), {**abstract, **own})


def RecordingLoader(seen: Seen) -> Any:
    """A connector recording the context of each load (built without vLLM's __init__, which
    needs a running engine's config and role)."""
    cls: Any = _loader_class()
    loader = cls.__new__(cls)
    loader.seen = seen
    loader._connector_metadata = None
    return loader


class Graphs:
    """The CUDA graph manager: dispatches ``mode`` (to a graph of ``padded_to`` tokens and
    requests) and records each run instead of launching it."""

    def __init__(self, mode: Any, seen: Seen, hidden: Any, padded_to: int = PADDED_TO) -> None:
        self.mode, self.seen, self.hidden, self.padded_to = mode, seen, hidden, padded_to

    def descriptor(self, num_reqs: int, num_tokens: int) -> Any:
        """The installed release's BatchExecutionDescriptor (with the fields it has)."""
        from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

        fields = inspect.signature(BatchExecutionDescriptor).parameters
        values = {"cg_mode": self.mode, "num_tokens": num_tokens, "num_reqs": num_reqs}
        return BatchExecutionDescriptor(**{k: v for k, v in values.items() if k in fields})

    # The manager's entry points differ per release; the stand-in answers each one the
    # installed execute_model calls: dispatch (0.18 on), get_cudagraph_runtime_mode (0.17).
    def dispatch(self, num_reqs: int, num_tokens: int, *args: Any, **kwargs: Any) -> Any:
        return self.descriptor(self.padded_to, self.padded_to)

    def get_cudagraph_runtime_mode(self, num_reqs: int, num_tokens: int, max_query_len: int) -> Any:
        return self.mode, self.padded_to

    # 0.15/0.16: a graph size (FULL graphs only) or None (eager), and run(n) replays it.
    def get_cudagraph_size(self, *args: Any) -> int | None:
        return self.padded_to if self.mode.name == "FULL" else None

    def run(self, num_tokens: int) -> Any:
        return self.ran("replay")

    def ran(self, event: str) -> Any:
        """Record one run of the model (and whether a forward context was open) in its place."""
        from vllm.forward_context import is_forward_context_available

        self.seen.record(event)
        self.seen.context_at_run.append(is_forward_context_available())
        return self.hidden

    def run_fullgraph(self, desc: Any) -> Any:
        return self.ran("replay")

    def run_pw_graph(self, model: Any, model_inputs: Any) -> Any:
        return self.ran("piecewise")

    def run_model(self, *args: Any, **kwargs: Any) -> Any:
        return self.ran("piecewise" if self.mode.name == "PIECEWISE" else "eager")


class _ModelState:
    """The model's state: building a step's attention metadata and model inputs runs GPU
    kernels, so the step's prepared metadata is handed back instead."""

    def __init__(self, attn_metadata: Any) -> None:
        self.attn_metadata = attn_metadata

    def preprocess_state(self, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_attn(self, *args: Any, **kwargs: Any) -> Any:
        return self.attn_metadata

    def prepare_inputs(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return {}


class _StagedWrites:
    """vLLM's BlockTables: its constructor allocates UVA (pinned) and device tensors a CPU
    host cannot, and the probe's step writes no block table."""

    def apply_staged_writes(self) -> None:
        pass


@dataclass
class _DeviceTensor:
    gpu: Any


class _RequestStates:
    """vLLM's RequestState: its constructor allocates UVA (pinned) buffers a CPU host cannot.
    What execute_model reads of it: the step's requests and their computed-token counts."""

    def __init__(self, batch: Any) -> None:
        import torch

        self.req_id_to_index = {req_id: i for i, req_id in enumerate(batch.req_ids)}
        self.num_computed_tokens = _DeviceTensor(torch.zeros(batch.num_reqs, dtype=torch.int32))


class _DraftTokens:
    """vLLM's DraftTokensHandler (0.34 on): its constructor opens a CUDA stream and event; the
    probe's step has no draft tokens."""

    def begin_step(self, scheduler_output: Any) -> None:
        pass


def _model_runner() -> Any:
    from vllm.v1.worker.gpu import model_runner

    return model_runner


def _made(name: str, *args: Any) -> Any:
    """vLLM's own `name` (as the installed model runner imports it) built with `args`, or None
    where this release's runner has none (and so does not read it)."""
    cls = getattr(_model_runner(), name, None)
    return None if cls is None else cls(*args)


class StandInRunner:
    """The attributes GPUModelRunner.execute_model reads on its way through one step.

    Configs and CPU-side objects are vLLM's own (the runner's VllmConfig and its sub-configs,
    InputBuffers, EPLBController, StepTimingCollector, KVCacheConfig, BatchReqState); what a
    CPU host lacks is stood in for: request state, block tables and the draft-token handler
    (UVA / CUDA allocations), the model state (GPU metadata building) and the CUDA graph
    manager (:class:`Graphs`)."""

    def __init__(self, vllm_config: Any, kv_connector: Any, graphs: Any, input_batch: Any, attn: Any) -> None:
        import torch
        from vllm.v1.kv_cache_interface import KVCacheConfig

        from vllm_fix_core.guest import build

        padded = int(input_batch.num_tokens_after_padding)
        cpu = torch.device("cpu")
        self.vllm_config = vllm_config
        self.kv_connector = kv_connector
        self.cudagraph_manager = graphs
        self.input_batch = input_batch
        self.model_state = _ModelState(attn)
        self.model_config = vllm_config.model_config
        self.parallel_config = vllm_config.parallel_config
        self.observability_config = vllm_config.observability_config
        self.lora_config = vllm_config.lora_config
        # No KV cache groups: the probe's model registers no layer with a KV cache.
        self.kv_cache_config = build(KVCacheConfig, num_blocks=0, kv_cache_tensors=[], kv_cache_groups=[])
        self.input_buffers = _made("InputBuffers", padded, padded, cpu)
        self.eplb = _made("EPLBController", vllm_config.parallel_config, cpu)
        self.step_timing = _made("StepTimingCollector")
        self.req_states = _RequestStates(input_batch)
        self.block_tables = _StagedWrites()
        self.draft_tokens_handler = _DraftTokens()
        self.encoder_cache = None
        self.extensible_kv_cache = None
        self.aux_output_connector = None
        self.pcp_manager = None
        self.ubatch_runner = None
        self.is_encoder_decoder = False
        self.is_encoder_only = False  # releases up to 0.28
        self.routed_experts_capturer = None  # releases 0.28-0.30
        self.pp_handler = None
        self.uses_inputs_embeds = False
        self.uses_mrope = False  # 0.15/0.16
        self.supports_mm_inputs = False
        self.is_first_pp_rank = True
        self.is_last_pp_rank = True
        self.use_aux_hidden_state_outputs = False
        self.dp_size, self.dp_rank = 1, 0
        self.dcp_size, self.dcp_rank, self.cp_interleave = 1, 0, 1
        self.decode_query_len = 1
        self.attn_groups: list[Any] = []
        self.slot_mappings = torch.zeros((1, padded), dtype=torch.int64)

    def model(self, *args: Any, **kwargs: Any) -> Any:
        """The model itself: eager steps (and PIECEWISE on releases without run_pw_graph) call it."""
        return self.cudagraph_manager.run_model(*args, **kwargs)

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
        """vLLM's BatchReqState (0.28 on) of the step: each field the step's InputBatch of the
        same name holds (request state lives in GPU/UVA buffers here); a field the batch has
        no counterpart for (``num_draft_tokens_np``: no drafts) is None."""
        cls = _model_runner().BatchReqState
        names = getattr(cls, "_fields", None) or [f.name for f in dataclasses.fields(cls)]
        state = cls(**{name: getattr(self.input_batch, name, None) for name in names})
        return state, self.decode_query_len

    def prepare_inputs(self, *args: Any) -> Any:
        return self.input_batch

    def prepare_attn(self, input_batch: Any) -> tuple[Any, Any]:
        return [None], self.slot_mappings


def step_batch(num_reqs: int = NUM_REQS, padded_to: int = PADDED_TO, *, prefix: str = "probe") -> Any:
    """vLLM's InputBatch of a uniform-decode step (one token per request, requests
    ``<prefix>-0``, ``<prefix>-1``, ...) padded to ``padded_to`` tokens: every field the installed
    release declares at its default or at the step's value (built by vllm_fix_core.guest.build).
    Fields of other releases are set too (0.15/0.16 have no ``num_reqs_after_padding`` /
    ``is_padding`` field; the runner's FULL branch is still told the padded batch)."""
    import numpy as np
    import torch
    from vllm.v1.worker.gpu.input_batch import InputBatch

    from vllm_fix_core.guest import build

    is_padding = torch.zeros(padded_to, dtype=torch.bool)
    is_padding[num_reqs:] = True
    ones = np.ones(num_reqs, dtype=np.int32)
    cu = np.arange(num_reqs + 1, dtype=np.int32)
    return build(
        InputBatch,
        req_ids=[f"{prefix}-{i}" for i in range(num_reqs)],
        num_reqs=num_reqs,
        num_reqs_after_padding=padded_to,
        idx_mapping=torch.arange(num_reqs, dtype=torch.int32),
        idx_mapping_np=np.arange(num_reqs),
        num_scheduled_tokens=ones,
        num_tokens=num_reqs,
        num_tokens_after_padding=padded_to,
        num_draft_tokens=0,
        query_start_loc=torch.from_numpy(cu),
        query_start_loc_np=cu,
        seq_lens=torch.ones(num_reqs, dtype=torch.int32),
        num_computed_tokens_np=np.zeros(num_reqs, dtype=np.int32),
        prefill_len_np=np.zeros(num_reqs, dtype=np.int32),
        num_computed_prefill_tokens_np=np.zeros(num_reqs, dtype=np.int32),
        is_prefilling_np=np.zeros(num_reqs, dtype=bool),
        has_prefill=False,
        decode_graph_eligible=True,
        input_ids=torch.zeros(padded_to, dtype=torch.int64),
        positions=torch.zeros(padded_to, dtype=torch.int64),
        is_padding=is_padding,
        logits_indices=torch.arange(num_reqs, dtype=torch.int64),
        cu_num_logits=torch.from_numpy(cu),
        cu_num_logits_np=cu,
        has_structured_output_reqs=False,
        max_query_len=1,
    )


def attention_metadata(batch: Any, layer: str = LAYER) -> dict[str, Any]:
    """The step's attention metadata, per layer, as the runner hands it to the connector.

    A layer's metadata is the attention backend's own type, built on the device from vLLM's
    backend-independent CommonAttentionMetadata; the probe hands that CommonAttentionMetadata
    of the step (built by vllm_fix_core.guest.build, CPU tensors), the same for every backend."""
    import torch

    from vllm_fix_core.guest import build

    try:
        from vllm.v1.attention.backend import CommonAttentionMetadata
    except ImportError:  # pragma: no cover - the class's older home
        from vllm.v1.attention.backends.utils import CommonAttentionMetadata

    num_reqs, padded = int(batch.num_reqs), int(batch.num_tokens_after_padding)
    query_start_loc = torch.arange(num_reqs + 1, dtype=torch.int32)
    return {
        layer: build(
            CommonAttentionMetadata,
            query_start_loc=query_start_loc,
            query_start_loc_cpu=query_start_loc,
            seq_lens=batch.seq_lens,
            num_reqs=num_reqs,
            num_actual_tokens=int(batch.num_tokens),
            max_query_len=1,
            max_seq_len=1,
            block_table_tensor=torch.zeros((num_reqs, 1), dtype=torch.int32),
            slot_mapping=torch.zeros(padded, dtype=torch.int64),
        )
    }


def step_output(batch: Any, *, sync: bool = True, metadata: Any = None, tokens: int = 1) -> Any:
    """A real SchedulerOutput scheduling ``tokens`` tokens of each request of ``batch``, with a
    synchronous KV load when ``sync`` (has_sync_kv_loads)."""
    from vllm.v1.core.sched.output import SchedulerOutput

    out = SchedulerOutput.make_empty()
    out.num_scheduled_tokens = {rid: tokens for rid in batch.req_ids}
    out.total_num_scheduled_tokens = tokens * len(batch.req_ids)
    out.kv_connector_metadata = object() if metadata is None else metadata
    out.has_sync_kv_loads = sync
    return out


def active_connector(vllm_config: Any, connector: Any) -> Any:
    """vLLM's real ActiveKVConnector around ``connector``, as its __init__ leaves it (minus
    registering KV caches with a connector that has none)."""
    from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

    active = ActiveKVConnector.__new__(ActiveKVConnector)
    active.vllm_config = vllm_config
    active.kv_connector = connector
    active._pending_load_kwargs = None
    active._disabled = False
    return active
