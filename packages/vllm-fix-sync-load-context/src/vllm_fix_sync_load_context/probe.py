"""Does this vLLM's FULL-replay step start synchronous KV loads outside the step's context?

Runs the real, currently installed ``GPUModelRunner.execute_model`` through its FULL branch,
with the real ``ActiveKVConnector`` (whatever ``pre_forward`` is installed) and a recording
connector. The runner's ``self`` (``stand_ins.py``) holds vLLM's own objects wherever a CPU can
build them (the config, built without platform hooks, the step's ``InputBatch`` and attention
metadata, ``KVCacheConfig``, ...); request state, input preparation and the CUDA graph manager
need a GPU, so they hand back the prepared batch, its attention metadata and a replay that
records what it saw. Everything between those calls is vLLM's own code.
"""

from __future__ import annotations

import functools
from typing import Any

from vllm_fix_core import Check, NotApplicable, ProbeReport
from vllm_fix_sync_load_context.stand_ins import (
    NO_FIELD,
    PADDED_TO,
    Graphs,
    RecordingLoader,
    Seen,
    StandInRunner,
    active_connector,
    attention_metadata,
    step_batch,
    step_output,
)


def _dispatches_modes() -> bool:
    from vllm.v1.worker.gpu import cudagraph_utils

    manager = getattr(cudagraph_utils, "CudaGraphManager", None)
    return any(hasattr(manager, name) for name in ("dispatch", "get_cudagraph_runtime_mode"))


def _defers_async_loads() -> bool:
    import dataclasses

    from vllm.v1.core.sched.output import SchedulerOutput

    return "has_sync_kv_loads" in {f.name for f in dataclasses.fields(SchedulerOutput)}


def run_step(mode_name: str, connector: Any, seen: Seen, vllm_config: Any, *, sync: bool = True) -> Any:
    """One real execute_model step dispatched to `mode_name`; returns (batch, attn_metadata)."""
    import torch
    from vllm.config import CUDAGraphMode
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    batch = step_batch()
    attn = attention_metadata(batch)
    graphs = Graphs(getattr(CUDAGraphMode, mode_name), seen, torch.zeros(batch.num_tokens, 4))
    # 0.15/0.16's runner reads the step's metadata from the batch its prepare_inputs returns.
    batch.attn_metadata, batch.slot_mappings, batch.inputs_embeds = attn, None, None
    runner = StandInRunner(vllm_config, active_connector(vllm_config, connector), graphs, batch, attn)
    GPUModelRunner.execute_model(runner, step_output(batch, sync=sync))
    return batch, attn


@functools.lru_cache(maxsize=1)
def probe_config() -> Any:
    """vLLM's VllmConfig with every field at vLLM's default (it only feeds the forward contexts),
    one per process, built without ``__post_init__`` (vllm_fix_core.guest.build): no platform
    hook runs (``check_and_update_config`` rewrites ``os.environ``, logs an engine
    configuration and, on vLLM 0.34's x86 CPU platform without triton-cpu, raises). Never the
    running engine's own config, whose DP settings could make vLLM's own context code run a
    collective. Its DeviceConfig is built the same way: vLLM's own one infers the device from
    the platform, which fails on a host where it cannot (a CPU box with a CUDA build)."""
    from vllm.config import DeviceConfig, VllmConfig

    from vllm_fix_core.guest import build

    return build(VllmConfig, device_config=build(DeviceConfig))


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
                any(full.context_at_run) or not ordered,
                f"events={full.events}, context open at replay={full.context_at_run}",
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
