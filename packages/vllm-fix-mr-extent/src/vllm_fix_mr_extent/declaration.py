"""The one declaration of this fix: runtime, tests, CLI and docs read it."""

from vllm_fix_core import Fix, Links, ProcessKind, Target, Upstream, UpstreamStatus
from vllm_fix_core.native import NativeEdit, SourceTree

MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_connector"


def _links() -> Links:
    from vllm_fix_mr_extent import patch, probe

    return Links(probe.probe, patch.recognize, patch.apply)


def _native(tree: SourceTree) -> list[NativeEdit]:
    from vllm_fix_mr_extent import native

    return native.transform(tree)


FIX = Fix(
    id="mr-extent",
    title="MoRIIO shared KV memory-region base and extent",
    distribution="vllm-fix-mr-extent",
    upstream=(
        Upstream(
            60639,
            UpstreamStatus.PENDING,
            note="runtime part only (registration base/extent); KDA regions on the shared MR "
            "is a fork backport, see the README",
        ),
    ),
    why=(
        "A MoRIIO prefill or decode worker fails at startup in register_kv_caches "
        "(ValueError 'shared KV backing too small for page-aligned MR: need 12288, have 8256' "
        "or RuntimeError 'invalid storage offset -128') whenever the shared KV allocation is "
        "not padded to, or does not start on, a 4 KiB boundary: vLLM pads it on ROCm only. "
        "The registration also takes each layer's first region only, so a layer whose later "
        "region (V plane) ends past its first is left partly outside the memory region."
    ),
    how=(
        "Replace MoRIIOConnectorWorker._build_shared_kv_mr (only the exactly fingerprinted "
        "body, identical in vLLM 0.29.0 to 0.33.0) with this rule: take every registration "
        "region of every transfer layer (iter_layer_registration_regions), require one "
        "storage and device (else a ValueError naming both layers), base = lowest region "
        "aligned down to 4 KiB and never before the storage start, end = highest region end "
        "exactly and never past the storage end, offsets = data_ptr - base. Same return "
        "contract, so callers and unpatched peers keep working."
    ),
    retire_when=(
        "vLLM's _build_shared_kv_mr registers a base inside the storage and an exact extent "
        "covering every region (the probe then reports 'fixed upstream' and nothing is "
        "patched); drop the package once every supported vLLM release does."
    ),
    targets=(Target(MODULE, "MoRIIOConnectorWorker._build_shared_kv_mr", ProcessKind.WORKER),),
    links=_links,
    native=_native,
    notes=(
        "vLLM before 0.29.0 registers no shared KV memory region (no _build_shared_kv_mr): "
        "not applicable there.",
    ),
)
