"""The one declaration of this fix: runtime, tests, CLI and docs read it."""

from vllm_fix_core import Fix, Links, ProcessKind, Target, Upstream, UpstreamStatus
from vllm_fix_core.native import NativeEdit, SourceTree

MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_connector"


def _links() -> Links:
    from vllm_fix_read_failure_ownership import patch, probe

    return Links(probe.probe, patch.recognize, patch.apply)


def _native(tree: SourceTree) -> list[NativeEdit]:
    from vllm_fix_read_failure_ownership import native

    return native.transform(tree)


FIX = Fix(
    id="read-failure-ownership",
    title="MoRIIO hybrid READ failure/timeout ownership",
    distribution="vllm-fix-read-failure-ownership",
    upstream=(Upstream(60640, UpstreamStatus.PENDING),),
    why=(
        "On a decode (kv_consumer) worker in MoRIIO READ mode serving a hybrid model "
        "(attention + Mamba/KDA), a READ that fails or times out after the forward is "
        "swallowed by _pop_done_transfers: no error, the producer is told to release its "
        "blocks while other reads of the same request may still be in flight (failure), "
        "tracking of the destination blocks is dropped, and the request keeps generating on "
        "incomplete KV / recurrent state. Silently wrong output, and a late RDMA write can "
        "corrupt another request once the blocks are reused. Every release with hybrid READ "
        "(vLLM 0.31.0 to 0.33.0; 0.33.0's pre-forward barrier shields most, not all, of it)."
    ),
    how=(
        "Replace MoRIIOConnectorWorker._pop_done_transfers, for the two known shapes "
        "(0.31.0/0.32.0: single notify port; 0.33.0: one per holder prefill TP rank) selected by "
        "exact normalized-AST fingerprint, with our own implementation of the ownership "
        "rule: every tracked READ is polled once under the wrapper lock; success sends one "
        "release per holder and drops tracking; an attention-only failure reports its "
        "blocks once, releases and drops (timeout: reports and drops), as before; a hybrid "
        "failure or timeout fails the step closed with TransferError, sending no release, "
        "reporting no block ids and keeping all tracking. Like vLLM's body it reads whether "
        "the model is hybrid only for a READ that failed or timed out. Other shapes are "
        "refused, not patched. A wrapper would race (a status can fail between its check and vLLM's)."
    ),
    retire_when=(
        "vLLM's _pop_done_transfers raises for hybrid failures and timeouts itself (the "
        "probe then reports 'fixed upstream' and nothing is patched); drop the package once "
        "every supported vLLM release does."
    ),
    targets=(Target(MODULE, "MoRIIOConnectorWorker._pop_done_transfers", ProcessKind.WORKER),),
    links=_links,
    native=_native,
    notes=(
        "Hybrid fail-closed sends no release: the producer reclaims through its own "
        "timeout (0.33.0: READ deferred-send reaper, defer_timeout, default 60 s).",
        "Transfers that completed in the same poll are still released and dropped before "
        "the step fails, so no completed transfer is released twice.",
    ),
)
