"""The one declaration of this fix: runtime, tests, CLI and docs read it."""

from vllm_fix_core import Fix, Links, ProcessKind, Target, Upstream, UpstreamStatus
from vllm_fix_core.native import NativeEdit, SourceTree

KV_CONNECTOR = "vllm.v1.worker.gpu.kv_connector"
ASYNC_UTILS = "vllm.v1.worker.gpu.async_utils"
MODEL_RUNNER = "vllm.v1.worker.gpu.model_runner"


def _links() -> Links:
    from vllm_fix_spec_kv_readiness import patch, probe

    return Links(probe.probe, patch.recognize, patch.apply)


def _native(tree: SourceTree) -> list[NativeEdit]:
    from vllm_fix_spec_kv_readiness import native

    return native.transform(tree)


FIX = Fix(
    id="spec-kv-readiness",
    title="MRV2 speculative-decoding KV output readiness",
    distribution="vllm-fix-spec-kv-readiness",
    upstream=(Upstream(60637, UpstreamStatus.PENDING),),
    why=(
        "With speculative decoding (EAGLE, MTP, draft models) in the MRV2 model runner, a step's "
        "output reaches the scheduler as soon as the target model's tokens are copied, while the "
        "draft model is still writing its layers' KV on the device (every release with MRV2 "
        "speculative decoding). A prefill instance whose connector lets the decode instance READ "
        "its blocks (MoRIIO READ, NIXL pull) then publishes blocks whose draft-layer KV is not "
        "written yet: the decode side drafts from stale KV and the acceptance rate drops "
        "silently. In vLLM 0.15-0.21 (execute_model) and 0.33.0 (a deferred post_forward) the "
        "step's KV connector output is also collected before the draft forward, so completions "
        "caused by draft-layer saves (or, on 0.33.0, by wait_for_save) are reported a step late, "
        "in a different order than without speculative decoding."
    ),
    how=(
        "0.33.0: the deferred ActiveKVConnector.post_forward starts pending async loads and "
        "returns an empty output object; finalize_step runs vLLM's own non-deferred post_forward "
        "(wait_for_save, one get_transfer_results drain, clear metadata: a non-speculative "
        "step's order) and fills that object in. 0.15-0.21: execute_model's post_forward "
        "returns an empty output object on a speculative step, and vLLM's own post_forward runs "
        "with the same arguments once GPUModelRunner.sample_tokens has run the drafter, filling "
        "it in. All releases: for connectors that publish "
        "blocks for a remote READ (an explicit requires_full_step_completion attribute, a "
        "MultiConnector child that does, a NIXL pull or MoRIIO READ producer), a CUDA event is "
        "recorded after the step's last draft kernel and AsyncOutput.get_output waits on it; "
        "other connectors keep the overlap of output copy and draft forward."
    ),
    retire_when=(
        "vLLM's MRV2 sample_tokens collects the KV connector output after finalize and makes "
        "READ publishers' outputs wait for the draft (the probe then reports 'fixed upstream' "
        "and nothing is patched); drop the package once every supported vLLM release does."
    ),
    targets=(
        Target(KV_CONNECTOR, "ActiveKVConnector.post_forward", ProcessKind.WORKER),
        Target(KV_CONNECTOR, "ActiveKVConnector.finalize_step", ProcessKind.WORKER, optional=True),
        Target(ASYNC_UTILS, "AsyncOutput.get_output", ProcessKind.WORKER),
        # Patched only where execute_model collects the KV connector output (0.15 - 0.21).
        Target(MODEL_RUNNER, "GPUModelRunner.sample_tokens", ProcessKind.WORKER, optional=True),
    ),
    # sample_tokens is what the probe runs; the model runner imports both target modules.
    trigger=MODEL_RUNNER,
    links=_links,
    notes=(
        "Covers the MRV2 runner (vllm/v1/worker/gpu), 0.15 onwards (0.14's MRV2 runner has no "
        "KV connector). The V1 runner's early snapshot (KVConnectorModelRunnerMixin: "
        "collected when the target forward's context closes, before the draft) is on every "
        "release 0.14-0.33 and is not patched by this package.",
        "On a GPU the readiness half is checked with real CUDA events by an optional test that "
        "has not been run yet; on CPU the probe and tests check the order of submission.",
    ),
    native=_native,
)
