"""The one declaration of this fix: runtime, tests, CLI and docs read it."""

from vllm_fix_core import Fix, Links, ProcessKind, Target, Upstream, UpstreamStatus
from vllm_fix_core.native import NativeEdit, SourceTree

MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_connector"


def _links() -> Links:
    from vllm_fix_read_eligibility import patch, probe

    return Links(probe.probe, patch.recognize, patch.apply)


def _native(tree: SourceTree) -> list[NativeEdit]:
    from vllm_fix_read_eligibility import native

    return native.transform(tree)


FIX = Fix(
    id="read-eligibility",
    title="MoRIIO READ remote-prefill eligibility",
    distribution="vllm-fix-read-eligibility",
    upstream=(
        Upstream(
            60638,
            UpstreamStatus.PENDING,
            note="plain/resumed/retried requests: fixed in vLLM 0.33.0; "
            "do_remote_prefill params that cannot drive a READ: not covered upstream",
        ),
    ),
    why=(
        "A decode (kv_consumer) instance in MoRIIO READ mode tells the scheduler that N-1 "
        "prompt tokens will be loaded from the prefill instance for requests that never asked "
        "for a remote prefill (plain requests, preempted-and-resumed ones, load-failure "
        "retries; vLLM 0.24.0 to 0.32.0), or whose do_remote_prefill params cannot drive a "
        "READ of those tokens (every release): remote_block_ids missing, empty, with too few "
        "blocks for the prompt, more or fewer block lists than the engine's KV cache groups, "
        "negative, duplicate, non-integer or beyond-int64 ids; no remote_engine_id; no "
        "usable remote host/ports; a flag that is not True. The forward then attends to KV "
        "blocks nothing wrote and, with prefix caching, publishes them to later requests "
        "(silently wrong output), or vLLM's scheduler step raises (wrong group count, "
        "unroutable params) and the engine core loses every running request."
    ),
    how=(
        "Wrap MoRIIOConnectorScheduler.get_num_new_matched_tokens: on the consumer in READ "
        "mode, vLLM's claim stands only if do_remote_prefill is exactly True, remote_engine_id "
        "is a non-empty string, remote_block_ids holds one list per KV cache group this engine "
        "reads (one flat list before vLLM 0.30.0), each long enough for the claimed tokens, "
        "of distinct non-negative int64 ids, and MoRIIO's own add_new_req can route the READ "
        "to a host and two ports with well-typed peer sizes. Otherwise it claims (0, False), "
        "the prompt is recomputed locally, do_remote_prefill is cleared (as vLLM does once it "
        "has handled a request's READ) and one rate-limited WARNING names the request and the "
        "field. WRITE mode, the producer side and eligible remote prefills get vLLM's own answer."
    ),
    retire_when=(
        "vLLM's get_num_new_matched_tokens rejects both cases itself (the probe then reports "
        "'fixed upstream' and nothing is patched); drop the package once every supported "
        "vLLM release does."
    ),
    targets=(Target(MODULE, "MoRIIOConnectorScheduler.get_num_new_matched_tokens", ProcessKind.ENGINE_CORE),),
    links=_links,
    native=_native,
)
