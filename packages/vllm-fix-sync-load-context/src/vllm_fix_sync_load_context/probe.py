"""Does this vLLM's FULL-replay step start synchronous KV loads outside the step's context?

Runs the real, currently installed ``GPUModelRunner.execute_model`` through its FULL branch,
with the real ``ActiveKVConnector`` (whatever ``pre_forward`` is installed) and a recording
connector. The runner's ``self`` is a minimal stand-in: request state, input preparation and
the CUDA graph manager need a GPU, so they hand back a prepared batch, attention metadata and a
replay that records what it saw. Everything between those calls is vLLM's own code.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from vllm_fix_core import Check, NotApplicable, ProbeReport

# The FULL step: 3 decodes padded to a captured graph of 4 (the padded count differs from the
# scheduled one, so a context built from the unpadded batch is seen as wrong).
NUM_REQS = 3
PADDED_TO = 4


@dataclass
class Seen:
    """What the connector saw in start_load_kv and what the replay saw."""

    loads: list[dict[str, Any]] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    context_at_replay: list[bool] = field(default_factory=list)


class _Recording:
    """What the recording connector adds to vLLM's own connector base: the context of each load."""

    seen: Seen

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.seen.events.append("start_load_kv")
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


NO_FIELD = object()


class _Graphs:
    """The CUDA graph manager: dispatches `mode` and records the replay."""

    def __init__(self, mode: Any, seen: Seen, hidden: Any) -> None:
        self.mode, self.seen, self.hidden = mode, seen, hidden

    # The manager's entry points differ per release; the stand-in answers each one the
    # installed execute_model calls: dispatch (0.18 on), get_cudagraph_runtime_mode (0.17).
    def dispatch(self, num_reqs: int, num_tokens: int, *args: Any, **kwargs: Any) -> Any:
        from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

        fields = inspect.signature(BatchExecutionDescriptor).parameters
        values = {"cg_mode": self.mode, "num_tokens": PADDED_TO, "num_reqs": PADDED_TO}
        return BatchExecutionDescriptor(**{k: v for k, v in values.items() if k in fields})

    def get_cudagraph_runtime_mode(self, num_reqs: int, num_tokens: int, max_query_len: int) -> Any:
        return self.mode, PADDED_TO

    # 0.15/0.16: a graph size (FULL graphs only) or None (eager), and run(n) replays it.
    def get_cudagraph_size(self, *args: Any) -> int | None:
        return PADDED_TO if self.mode.name == "FULL" else None

    def run(self, num_tokens: int) -> Any:
        return self._ran("replay")

    def _ran(self, event: str) -> Any:
        from vllm.forward_context import is_forward_context_available

        self.seen.events.append(event)
        self.seen.context_at_replay.append(is_forward_context_available())
        return self.hidden

    def run_fullgraph(self, desc: Any) -> Any:
        return self._ran("replay")

    def run_pw_graph(self, model: Any, model_inputs: Any) -> Any:
        return self._ran("piecewise")

    def run_model(self, *args: Any, **kwargs: Any) -> Any:
        return self._ran("piecewise" if self.mode.name == "PIECEWISE" else "eager")


class _ModelState:
    def __init__(self, attn_metadata: Any) -> None:
        self.attn_metadata = attn_metadata

    def preprocess_state(self, *args: Any) -> None:
        pass

    def prepare_attn(self, *args: Any, **kwargs: Any) -> Any:
        return self.attn_metadata

    def prepare_inputs(self, *args: Any) -> dict[str, Any]:
        return {}


class StandInRunner:
    """The attributes GPUModelRunner.execute_model reads on its way through one step."""

    def __init__(self, vllm_config: Any, kv_connector: Any, graphs: Any, input_batch: Any, attn: Any) -> None:
        import torch

        self.vllm_config = vllm_config
        self.kv_connector = kv_connector
        self.cudagraph_manager = graphs
        self.input_batch = input_batch
        self.model_state = _ModelState(attn)
        # Eager steps (and PIECEWISE on releases without run_pw_graph) call the model itself.
        self.model = graphs.run_model
        self.model_config = vllm_config.model_config
        self.parallel_config = vllm_config.parallel_config
        self.lora_config = None
        self.encoder_cache = None
        self.aux_output_connector = None
        self.pcp_manager = None
        self.ubatch_runner = None
        self.is_encoder_decoder = False
        self.is_encoder_only = False  # releases up to 0.28
        self.routed_experts_capturer = None  # releases 0.28-0.30
        self.pp_handler = None
        self.input_buffers = SimpleNamespace(dcp_local_seq_lens=None)
        self.uses_inputs_embeds = False
        self.uses_mrope = False  # 0.15/0.16
        self.supports_mm_inputs = False
        self.is_first_pp_rank = True
        self.is_last_pp_rank = True
        self.use_aux_hidden_state_outputs = False
        self.dp_size, self.dp_rank = 1, 0
        self.dcp_size, self.dcp_rank, self.cp_interleave = 1, 0, 1
        self.decode_query_len = 1
        self.req_states = SimpleNamespace(num_computed_tokens=SimpleNamespace(gpu=None))
        self.attn_groups: list[Any] = []
        self.kv_cache_config = SimpleNamespace(kv_cache_groups=[])
        self.observability_config = SimpleNamespace(cudagraph_metrics=False)
        self.block_tables = SimpleNamespace(apply_staged_writes=lambda: None)
        self.eplb = SimpleNamespace(prepare_forward=lambda *a, **k: None)
        self.step_timing = SimpleNamespace(record_batch=lambda *a, **k: None, forward_start=lambda: None)
        self.slot_mappings = torch.zeros((1, input_batch.num_tokens_after_padding), dtype=torch.int64)

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


def step_batch(num_reqs: int = NUM_REQS, padded_to: int = PADDED_TO) -> Any:
    """A uniform-decode batch (one token per request) padded to `padded_to` tokens, as MRV2's
    InputBatch exposes it."""
    import numpy as np
    import torch

    is_padding = torch.zeros(padded_to, dtype=torch.bool)
    is_padding[num_reqs:] = True
    return SimpleNamespace(
        req_ids=[f"probe-{i}" for i in range(num_reqs)],
        num_reqs=num_reqs,
        num_reqs_after_padding=padded_to,
        idx_mapping=torch.arange(num_reqs, dtype=torch.int32),
        idx_mapping_np=np.arange(num_reqs),
        num_scheduled_tokens=np.ones(num_reqs, dtype=np.int32),
        num_tokens=num_reqs,
        num_tokens_after_padding=padded_to,
        input_ids=torch.zeros(padded_to, dtype=torch.int64),
        positions=torch.zeros(padded_to, dtype=torch.int64),
        is_padding=is_padding,
        seq_lens=torch.ones(num_reqs, dtype=torch.int32),
        dcp_local_seq_lens=None,
    )


def _dispatches_modes() -> bool:
    from vllm.v1.worker.gpu import cudagraph_utils

    manager = getattr(cudagraph_utils, "CudaGraphManager", None)
    return any(hasattr(manager, name) for name in ("dispatch", "get_cudagraph_runtime_mode"))


def _defers_async_loads() -> bool:
    import dataclasses

    from vllm.v1.core.sched.output import SchedulerOutput

    return "has_sync_kv_loads" in {f.name for f in dataclasses.fields(SchedulerOutput)}


def step_output(batch: Any, *, sync: bool = True, metadata: Any = None) -> Any:
    """A real SchedulerOutput scheduling `batch`, with a synchronous KV load when `sync`."""
    from vllm.v1.core.sched.output import SchedulerOutput

    out = SchedulerOutput.make_empty()
    out.num_scheduled_tokens = {rid: 1 for rid in batch.req_ids}
    out.total_num_scheduled_tokens = batch.num_tokens
    out.kv_connector_metadata = object() if metadata is None else metadata
    out.has_sync_kv_loads = sync
    return out


def active_connector(vllm_config: Any, connector: Any) -> Any:
    """vLLM's real ActiveKVConnector around `connector` (built like its __init__ leaves it)."""
    from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

    active = ActiveKVConnector.__new__(ActiveKVConnector)
    active.vllm_config = vllm_config
    active.kv_connector = connector
    active._pending_load_kwargs = None
    active._disabled = False
    return active


def run_step(mode_name: str, connector: Any, seen: Seen, vllm_config: Any, *, sync: bool = True) -> Any:
    """One real execute_model step dispatched to `mode_name`; returns (batch, attn_metadata)."""
    import torch
    from vllm.config import CUDAGraphMode
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    batch = step_batch()
    attn = {"model.layers.0.self_attn.attn": SimpleNamespace(num_actual_tokens=batch.num_tokens)}
    graphs = _Graphs(getattr(CUDAGraphMode, mode_name), seen, torch.zeros(batch.num_tokens, 4))
    # 0.15/0.16's runner reads the step's metadata from the batch its prepare_inputs returns.
    batch.attn_metadata, batch.slot_mappings, batch.inputs_embeds = attn, None, None
    runner = StandInRunner(vllm_config, active_connector(vllm_config, connector), graphs, batch, attn)
    GPUModelRunner.execute_model(runner, step_output(batch, sync=sync))
    return batch, attn


@functools.lru_cache(maxsize=1)
def probe_config() -> Any:
    """A default VllmConfig (it only feeds the forward contexts), one per process: never the
    running engine's own config, whose DP settings could make vLLM's own context code run a
    collective. On a host where vLLM cannot infer its device (a CPU box with a CUDA build)
    the device is named."""
    from vllm.config import DeviceConfig, VllmConfig

    try:
        return VllmConfig()
    except RuntimeError:
        return VllmConfig(device_config=DeviceConfig("cpu"))


def _describe(load: dict[str, Any], attn: Any) -> str:
    meta = "the step's" if load["attn_metadata"] is attn else repr(load["attn_metadata"])
    return f"mode={getattr(load['mode'], 'name', load['mode'])}, attn_metadata={meta}"


def probe() -> ProbeReport:
    from vllm.config import CUDAGraphMode

    try:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    except ImportError as exc:  # pragma: no cover - releases without the V2 runner
        raise NotApplicable(f"no V2 model runner: {exc}") from exc
    if not hasattr(GPUModelRunner, "execute_model"):
        raise NotApplicable("the V2 model runner has no execute_model")
    import importlib.util

    if importlib.util.find_spec("vllm.v1.worker.gpu.kv_connector") is None:
        # vLLM 0.14: the V2 runner has no KV connector at all, so no load starts anywhere.
        raise NotApplicable("the V2 model runner has no KV connector (vllm.v1.worker.gpu.kv_connector)")
    config = probe_config()

    full = Seen()
    batch, attn = run_step("FULL", RecordingLoader(full), full, config)
    load = full.loads[0] if full.loads else None
    wrong: list[str] = []
    if load is None:
        wrong.append("start_load_kv never ran")
    else:
        if load["mode"] != CUDAGraphMode.FULL or load["attn_metadata"] is not attn:
            wrong.append(_describe(load, attn))
        # Expected from the step the probe built (the graph replays the padded batch), not
        # from anything the fix computes.
        desc = load["batch_descriptor"]
        if desc is None or (desc.num_tokens, desc.num_reqs) != (PADDED_TO, PADDED_TO):
            wrong.append(f"batch_descriptor={desc!r}, the replayed graph is {PADDED_TO} tokens / requests")
        if load["is_padding"] is not NO_FIELD and load["is_padding"] is not batch.is_padding:
            wrong.append("is_padding is not the step's")
    ordered = full.events[:2] == ["start_load_kv", "replay"]

    # The other branch: PIECEWISE where the runner dispatches modes (0.17 on), else (0.15/0.16,
    # FULL graphs only) eager, told NONE.
    other = "PIECEWISE" if _dispatches_modes() else "NONE"
    pw = Seen()
    _, pw_attn = run_step(other, RecordingLoader(pw), pw, config)
    pw_load = pw.loads[0] if pw.loads else {}
    pw_ok = pw_load.get("mode") == getattr(CUDAGraphMode, other) and pw_load.get("attn_metadata") is pw_attn

    # Releases before 0.29 start every load in pre_forward (SchedulerOutput has no
    # has_sync_kv_loads): there is no async load to keep after the forward there.
    async_seen = Seen()
    defers_async = _defers_async_loads()
    if defers_async:
        run_step("FULL", RecordingLoader(async_seen), async_seen, config, sync=False)

    return ProbeReport(
        (
            Check("full-replay-sync-load-outside-step-context", bool(wrong), "; ".join(wrong)),
            # Guards: what the fix must keep.
            Check(
                "full-replay-context-closed-before-replay",
                any(full.context_at_replay) or not ordered,
                f"events={full.events}, context open at replay={full.context_at_replay}",
                guard=True,
            ),
            Check(
                "piecewise-sync-load-in-step-context",
                not pw_ok,
                "; ".join(_describe(x, pw_attn) for x in pw.loads) or "no load",
                guard=True,
            ),
            Check(
                "async-load-not-started-before-replay",
                "start_load_kv" in async_seen.events,
                f"events={async_seen.events}"
                if defers_async
                else "this vLLM starts every load before the forward",
                guard=True,
            ),
        )
    )
