"""The one declaration of this fix: runtime, tests, CLI and docs read it."""

from vllm_fix_core import Fix, ProcessKind, Target, Upstream, UpstreamStatus

MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_connector"

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
        "READ: remote_block_ids missing, empty, with an empty group or a non-integer id, or "
        "no remote_engine_id (every release). No READ loads those tokens, so the forward "
        "attends to KV blocks nothing wrote and, with prefix caching, publishes them to later "
        "requests: silently wrong output, no error (empty groups instead fail the scheduler "
        "step and take the engine core down)."
    ),
    how=(
        "Wrap MoRIIOConnectorScheduler.get_num_new_matched_tokens: on the consumer in READ "
        "mode, a request claims remote tokens only if do_remote_prefill is set, "
        "remote_engine_id is a non-empty string and remote_block_ids is a non-empty list of "
        "non-empty per-KV-cache-group lists of integer block ids (one flat list before vLLM "
        "0.30.0, whose MoRIIO exchanges block ids unsplit). Otherwise it claims (0, False) "
        "and the prompt is recomputed locally; malformed params log one warning naming the "
        "request and clear do_remote_prefill, as vLLM does once it has handled a request's "
        "READ. WRITE mode, the producer side and eligible remote prefills get vLLM's own answer."
    ),
    retire_when=(
        "vLLM's get_num_new_matched_tokens rejects both cases itself (the probe then reports "
        "'fixed upstream' and nothing is patched); drop the package once every supported "
        "vLLM release does."
    ),
    targets=(Target(MODULE, "MoRIIOConnectorScheduler.get_num_new_matched_tokens", ProcessKind.ENGINE_CORE),),
    probe="vllm_fix_read_eligibility.probe:probe",
    recognize="vllm_fix_read_eligibility.patch:recognize",
    apply="vllm_fix_read_eligibility.patch:apply",
)
