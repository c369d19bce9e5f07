"""The one declaration of this fix: runtime, tests, CLI and docs read it."""

from vllm_fix_core import Fix, Links, ProcessKind, Target, Upstream, UpstreamStatus
from vllm_fix_core.native import NativeEdit, SourceTree

MODULE = "vllm.v1.worker.gpu.kv_connector"


def _links() -> Links:
    from vllm_fix_sync_load_context import patch, probe

    return Links(probe.probe, patch.recognize, patch.apply)


def _native(tree: SourceTree) -> list[NativeEdit]:
    from vllm_fix_sync_load_context import native

    return native.transform(tree)


FIX = Fix(
    id="sync-load-context",
    title="MRV2 FULL cudagraph synchronous-load context",
    distribution="vllm-fix-sync-load-context",
    upstream=(Upstream(60636, UpstreamStatus.PENDING),),
    why=(
        "With the V2 model runner, a step that replays a FULL CUDA graph starts its synchronous "
        "KV loads outside any forward context, so the connector's start_load_kv sees "
        "cudagraph_runtime_mode=NONE and attn_metadata=None while the step actually replays a "
        "FULL graph (where no per-layer wait_for_layer_load can run). Connectors that read the "
        "context then do the wrong thing: ExampleConnector and the native LMCache adapter skip "
        "the load ('attn_metadata is None') and the request decodes on blocks nothing wrote; "
        "the MoRIIO READ consumer of vLLM 0.32.0 leaves its attention READs to per-layer waits "
        "that never run, so the graph replays while RDMA is still writing the KV. Silent wrong "
        "output, no error. This hits disaggregated decode instances (their first step per "
        "request is a synchronous load on a uniform-decode batch) at the default "
        "FULL_AND_PIECEWISE cudagraph mode."
    ),
    how=(
        "Wrap ActiveKVConnector.pre_forward: when it is called from the runner's FULL-replay "
        "branch with no forward context set and it starts loads (the step has synchronous loads "
        "where vLLM defers async ones), run it under override_forward_context("
        "create_forward_context(...)) built from the step's own attn_metadata, "
        "cudagraph_runtime_mode=FULL, a batch descriptor of the padded batch, the step's "
        "is_padding mask (where the context has one), and DP metadata from the padded token "
        "count every DP rank already agreed on (no collective). vLLM 0.32 on hand pre_forward "
        "the input batch; on 0.15-0.31 the step's input batch and attn_metadata are read (never "
        "written) from the runner's execute_model frame executing that FULL-branch call, under "
        "the names the runner's other branch passes to set_forward_context (shapes.py). The "
        "context is closed before the replay, also when the connector raises. PIECEWISE/NONE "
        "steps, async loads and no-forward steps are delegated untouched."
    ),
    retire_when=(
        "vLLM's GPUModelRunner.execute_model opens a forward context around the FULL branch's "
        "pre_forward itself (the probe then reports 'fixed upstream' and nothing is patched); "
        "drop the package once every supported vLLM release does."
    ),
    targets=(Target(MODULE, "ActiveKVConnector.pre_forward", ProcessKind.WORKER),),
    # The runner module imports kv_connector; deciding once it is fully imported lets the
    # probe run the real GPUModelRunner.execute_model.
    trigger="vllm.v1.worker.gpu.model_runner",
    links=_links,
    native=_native,
    notes=(
        "slot_mapping and ubatch_slices of the step are left empty; no in-tree connector reads "
        "them in start_load_kv.",
        "Connectors still have to finish their loads in start_load_kv when they see FULL "
        "(per-layer waits cannot run inside a replay); the fix makes sure they are told.",
    ),
)
