"""The one declaration of this fix: runtime, tests, CLI and docs read it."""

from vllm_fix_core import Fix, Links, ProcessKind, Target, Upstream, UpstreamStatus
from vllm_fix_core.native import NativeEdit, SourceTree

MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_connector"


def _links() -> Links:
    from vllm_fix_sync_load_zeroing import patch, probe

    return Links(probe.probe, patch.recognize, patch.apply)


def _native(tree: SourceTree) -> list[NativeEdit]:
    from vllm_fix_sync_load_zeroing import native

    return native.transform(tree)


FIX = Fix(
    id="sync-load-zeroing",
    title="KV-cache zeroing never races a synchronous MoRIIO READ",
    distribution="vllm-fix-sync-load-zeroing",
    upstream=(
        Upstream(
            59164,
            UpstreamStatus.PENDING,
            note="review comment: the get_sync_load_block_ids layout guard; vLLM 0.32.0 and 0.33.0 "
            "carry an unconditional exclusion in build_connector_meta instead",
        ),
    ),
    why=(
        "On a hybrid (attention + Mamba) model, a MoRIIO READ decode instance loads the prompt's "
        "KV synchronously: the READ is posted before the step's forward into freshly allocated "
        "blocks. vLLM zeroes newly allocated blocks on the same step with a kernel launched before "
        "the forward, and nothing orders the two on the device, so the zeroing can land after the "
        "READ and wipe the loaded KV. vLLM 0.31.0 skips zeroing only for asynchronous loads; forks "
        "with get_sync_load_block_ids skip it only under the LBNHC layout. Silently wrong output "
        "(GSM8K 151/1319 instead of 1277/1319 in the reported run), no error."
    ),
    how=(
        "Remove a block from new_block_ids_to_zero iff the connector is a READ-mode consumer of a "
        "hybrid model, the block is an aligned attention destination of a READ drained into this "
        "step (never the recomputed tail, never Mamba state blocks), and the READ rewrites every "
        "byte the zeroer would zero for it under the KV-cache layout in use. That last condition is "
        "computed once per layout on CPU from vLLM's own view builder, KVBlockZeroer segments and "
        "MoRIIO READ offsets. Attach point: a wrapper around "
        "MoRIIOConnectorScheduler.build_connector_meta that snapshots the READ destinations before "
        "delegating, or, where vLLM has it, a wrapper replacing the layout guard of "
        "MoRIIOConnector.get_sync_load_block_ids. Anything unreadable keeps zeroing."
    ),
    retire_when=(
        "Every supported vLLM excludes the READ destinations itself (0.32.0 and 0.33.0 do: the "
        "probe reports 'fixed upstream' there and stays as a regression guard); drop the package "
        "with 0.31.0 support."
    ),
    targets=(
        Target(MODULE, "MoRIIOConnectorScheduler.build_connector_meta", ProcessKind.ENGINE_CORE),
        Target(MODULE, "MoRIIOConnector.get_sync_load_block_ids", ProcessKind.ENGINE_CORE, optional=True),
    ),
    links=_links,
    native=_native,
    notes=(
        "Layout coverage as computed: LBHNC, LBNHC, BLHNC and BLNHC are covered on every release; "
        "LHBNC and BHLNC only where MoRIIO's READ copies head slices (0.33.0). vLLM's resolver gives "
        "a hybrid model only the block-compact layouts, so 0.32.0's unconditional exclusion is right "
        "on every configuration it can meet.",
        "The exclusion relies on the hybrid READ failing the step closed on any READ error or "
        "timeout (see the read-failure-ownership fix).",
    ),
)
