"""The one declaration of this fix: runtime, tests, CLI and docs read it."""

from vllm_fix_core import Fix, Links, ProcessKind, Target, Upstream, UpstreamStatus
from vllm_fix_core.native import NativeEdit, SourceTree

MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.multi_connector"


def _links() -> Links:
    from vllm_fix_completion_ownership import patch, probe

    return Links(probe.probe, patch.recognize, patch.apply)


def _native(tree: SourceTree) -> list[NativeEdit]:
    from vllm_fix_completion_ownership import native

    return native.transform(tree)


FIX = Fix(
    id="completion-ownership",
    title="MultiConnector frees each request exactly once, after every owner",
    distribution="vllm-fix-completion-ownership",
    upstream=(Upstream(60635, UpstreamStatus.PENDING),),
    why=(
        "With MultiConnector[MoRIIO READ producer, X] where X also holds blocks until its own "
        "save finishes (HF3FS, LMCacheMP, ...), MultiConnector counts completions "
        "anonymously and hands every child the same output object (every vLLM release from "
        "0.14.1, where MoRIIO entered, to 0.33.0). "
        "A request only X holds is swallowed by MoRIIO's rewrite of finished_sending, so its "
        "KV blocks leak until new requests wait forever (D1). With async scheduling the worker "
        "learns the second owner a step late, frees on MoRIIO's ACK alone and then swallows "
        "X's report: blocks are reused while X still copies them (D2). MoRIIO's watchdog frees "
        "a request while X is pending (D3). A child accepting register_finished_partial_tail "
        "is not counted as an owner (D4, latent)."
    ),
    how=(
        "Each finished request gets an owner set: the children whose request_finished* "
        "returned True plus those that accepted register_finished_partial_tail. The scheduler "
        "ships owner sets (empty ones included), scheduler-side child completions and loader "
        "children to the workers as a plain-builtins attribute of MultiKVConnectorMetadata "
        "(extra_async_saves is kept, so an unpatched reader sees ordinary metadata). Workers "
        "count a finished_sending report only from an owner, buffer reports that precede the "
        "owner set, and report a request once all owners completed there; recv reports are "
        "accepted only from the loader child. On the scheduler each child's "
        "update_connector_output sees a private view holding only its own ids; a child's "
        "watchdog completes that child only; a request reaches finished_sending exactly once, "
        "when every owner completed on every worker. Bodies of update_connector_output, "
        "register_finished_partial_tail and get_transfer_results (0.30.0+) or get_finished "
        "(0.14.1-0.29.0), and request_finished where it counts the children itself "
        "(0.14.1-0.20.2), are replaced only for fingerprinted shapes (refused otherwise); "
        "_aggregate_request_finished (0.21.0+), get_num_new_matched_tokens, "
        "build_connector_meta and bind_connector_metadata are re-implemented for their known "
        "fingerprints and wrapped when their body is unknown but structurally right."
    ),
    retire_when=(
        "vLLM's MultiConnector tracks completion owners per child itself (vllm-project/vllm"
        "#60635 or equivalent): the probe then reports 'fixed upstream' and nothing is "
        "patched; drop the package once every supported vLLM release has it."
    ),
    targets=(
        # vLLM 0.14.1-0.20.2: request_finished counts the children's answers itself and is
        # replaced there; from 0.21.0 on it delegates to _aggregate_request_finished (not touched).
        Target(MODULE, "MultiConnector.request_finished", ProcessKind.ENGINE_CORE),
        # vLLM 0.21.0+ only
        Target(MODULE, "MultiConnector._aggregate_request_finished", ProcessKind.ENGINE_CORE, optional=True),
        # vLLM 0.30.0+ only
        Target(
            MODULE, "MultiConnector.register_finished_partial_tail", ProcessKind.ENGINE_CORE, optional=True
        ),
        Target(MODULE, "MultiConnector.get_num_new_matched_tokens", ProcessKind.ENGINE_CORE),
        Target(MODULE, "MultiConnector.build_connector_meta", ProcessKind.ENGINE_CORE),
        Target(MODULE, "MultiConnector.update_connector_output", ProcessKind.ENGINE_CORE),
        Target(MODULE, "MultiConnector.bind_connector_metadata", ProcessKind.WORKER),
        # vLLM 0.30.0+: the worker entry point (get_finished delegates to it there)
        Target(MODULE, "MultiConnector.get_transfer_results", ProcessKind.WORKER, optional=True),
        # vLLM 0.14.1-0.29.0: get_finished aggregates the children itself and is replaced
        # there; from 0.30.0 on it delegates to get_transfer_results and is not touched.
        Target(MODULE, "MultiConnector.get_finished", ProcessKind.WORKER),
    ),
    links=_links,
    native=_native,
    notes=(
        "Load the plugin in every vLLM process (vLLM does: general plugins load in engine "
        "core and workers). A patched worker that receives metadata without owner sets logs "
        "one warning and keeps vLLM's own counting.",
    ),
)
