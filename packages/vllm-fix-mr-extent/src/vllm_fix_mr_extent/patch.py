"""Apply: replace MoRIIOConnectorWorker._build_shared_kv_mr, only for its known shape.

The original cannot be wrapped: it raises (or builds a registration before the
allocation) on the inputs this fix exists for, so the body is replaced, and
only where the normalized AST is exactly the one read in vLLM 0.29.0 to 0.33.0
(identical in all five).
The replacement keeps the original's contract: ``(contiguous uint8 tensor,
{layer: data_ptr - registration base})`` for the layers it was given, in their
order. Remote offsets are computed by vLLM from the peer's own advertised
base, so an unpatched peer keeps working against a patched one.
"""

from __future__ import annotations

from typing import Any

from vllm_fix_core import NotApplicable, PatchSet, UnknownShape, ast_fingerprint, get_logger, original_of
from vllm_fix_core.fingerprint import canonical_fingerprint, canonical_function, dropping
from vllm_fix_mr_extent.rule import (
    PAGE_SIZE,
    Region,
    SharedMRError,
    SharedMRPlan,
    Storage,
    plan_shared_mr,
)

MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_connector"

# Normalized-AST fingerprint (vllm_fix_core.ast_fingerprint) of the known target.
KNOWN_SHAPES = {"9d889e36e282c898": "vllm-0.29.0..0.33.0"}
# The same shape up to what a release changes without changing behaviour (renamed locals, log
# lines, unused defaulted keyword-only parameters: vllm_fix_core.fingerprint.canonical_function);
# 0.34.0's body is the known one.
CANONICAL_SHAPES = {"f7de01e76e518067": "vllm-0.29.0..0.33.0"}

_logger = get_logger("mr-extent")


def _module() -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector

    return moriio_connector


def storage_of(tensor: Any) -> Storage:
    storage = tensor.untyped_storage()
    return Storage(start=int(storage.data_ptr()), nbytes=int(storage.nbytes()), device=str(tensor.device))


def collect_regions(kv_caches: dict[str, Any], layer_to_spec: Any) -> list[Region]:
    """Every registration region of every layer, as vLLM itself enumerates them."""
    iter_regions = _module().iter_layer_registration_regions
    regions: list[Region] = []
    for layer, cache in kv_caches.items():
        for index, (tensor, nbytes) in enumerate(iter_regions(layer, cache, layer_to_spec)):
            regions.append(
                Region(
                    layer=layer,
                    index=index,
                    ptr=int(tensor.data_ptr()),
                    nbytes=int(nbytes),
                    storage=storage_of(tensor),
                )
            )
    return regions


def registration_tensor(anchor: Any, plan: SharedMRPlan) -> Any:
    """A contiguous uint8 view of ``[plan.base, plan.end)`` on ``anchor``'s storage (zero-copy)."""
    import torch

    view = torch.empty(0, dtype=torch.uint8, device=anchor.device)
    view.set_(anchor.untyped_storage(), plan.storage_offset, (plan.length,), (1,))
    if view.data_ptr() != plan.base and plan.length:
        raise RuntimeError(  # would mean torch placed the view differently; never register it
            f"registration view starts at {view.data_ptr():#x}, expected {plan.base:#x}"
        )
    return view


def planned_shared_kv_mr(self: Any, kv_caches: dict[str, Any]) -> tuple[Any, dict[str, int]]:
    """The registration by the rule in rule.py; SharedMRError when the rule cannot hold."""
    regions = collect_regions(kv_caches, self.layer_to_spec)
    layer_ptrs = {layer: int(cache.data_ptr()) for layer, cache in kv_caches.items()}
    plan = plan_shared_mr(regions, layer_ptrs, PAGE_SIZE)
    anchor = next(iter(kv_caches.values()))
    if storage_of(anchor) != plan.storage:
        raise SharedMRError(
            f"layer {next(iter(kv_caches))!r} is on {storage_of(anchor).describe()}, but its "
            f"registration regions are on {plan.storage.describe()}"
        )
    return registration_tensor(anchor, plan), dict(plan.offsets)


def outside_registration(registration: Any, kv_caches: dict[str, Any], layer_to_spec: Any) -> list[str]:
    """The layer regions (as vLLM enumerates them; each layer's own tensor where it cannot)
    that do not lie inside ``registration``: each would be handed an offset outside the
    registered memory. One line each, naming the layer, its bytes and its storage."""
    start = int(registration.data_ptr())
    end = start + int(registration.numel()) * int(registration.element_size())
    try:
        regions = collect_regions(kv_caches, layer_to_spec)
    except Exception:
        regions = [
            Region(layer, 0, int(t.data_ptr()), int(t.numel()) * int(t.element_size()), storage_of(t))
            for layer, t in kv_caches.items()
        ]
    return [f"{r.describe()} on {r.storage.describe()}" for r in regions if r.ptr < start or r.end > end]


def build_shared_kv_mr(self: Any, kv_caches: dict[str, Any]) -> tuple[Any, dict[str, int]]:
    """Replacement body of MoRIIOConnectorWorker._build_shared_kv_mr (the rule in rule.py).

    When the rule cannot plan these layers (e.g. they sit on two allocations) or planning fails
    for any other reason, vLLM's own body decides, and its registration is used unchanged, with
    one WARNING that says why the rule could not hold, if every layer region lies inside it. A
    registration that leaves a layer outside (vLLM's body does when a layer sits on another
    allocation than the first layer's: that layer's offset lies outside the registered memory)
    is never handed on: the rule's refusal (a ValueError naming the layers and their storages)
    stops start-up. If vLLM's body raises, the rule's refusal is raised in its place, or vLLM's
    own exception when the rule had no refusal.
    """
    try:
        return planned_shared_kv_mr(self, kv_caches)
    except Exception as refusal:
        original = original_of(_module().MoRIIOConnectorWorker, "_build_shared_kv_mr")
        try:
            result: tuple[Any, dict[str, int]] = original(self, kv_caches)
        except Exception as exc:
            if isinstance(refusal, SharedMRError):
                raise refusal from exc
            raise
        outside = outside_registration(result[0], kv_caches, self.layer_to_spec)
        if outside:
            start = int(result[0].data_ptr())
            raise SharedMRError(
                "the KV cache cannot be registered as one memory region: "
                + "; ".join(outside)
                + f" lie(s) outside the region vLLM's registration covers ([{start:#x}, "
                f"{start + int(result[0].numel()):#x}) on {storage_of(result[0]).describe()}), so "
                "their transfers would use offsets outside registered memory; start-up stops here "
                f"({type(refusal).__name__}: {refusal}). MoRIIO registers one memory region per "
                "worker: allocate the KV cache of every transfer layer in one allocation."
            ) from refusal
        _logger.warning(
            "mr-extent: the shared KV memory region cannot be built by the fix's rule (%s: %s); "
            "vLLM's own registration is used unchanged",
            type(refusal).__name__,
            refusal,
        )
        return result


def recognize() -> str:
    mc = _module()
    cls = mc.MoRIIOConnectorWorker
    method = original_of(cls, "_build_shared_kv_mr") if "_build_shared_kv_mr" in cls.__dict__ else None
    if method is None:
        raise NotApplicable(
            "MoRIIOConnectorWorker has no _build_shared_kv_mr: this vLLM registers no shared KV "
            "memory region (added in vLLM 0.29.0)"
        )
    if not callable(getattr(mc, "iter_layer_registration_regions", None)):
        raise UnknownShape("moriio_connector no longer imports iter_layer_registration_regions")
    fingerprint = ast_fingerprint(method)
    shape = KNOWN_SHAPES.get(fingerprint) or CANONICAL_SHAPES.get(canonical_fingerprint(method))
    if shape is None:
        raise UnknownShape(
            f"_build_shared_kv_mr has normalized AST {fingerprint}, not a known shape "
            f"({', '.join(KNOWN_SHAPES)}); its body is only replaced for a shape read exactly"
        )
    return shape


def apply(patch: PatchSet, shape: str) -> None:
    cls = _module().MoRIIOConnectorWorker
    # Parameters a release added and the body never reads are taken and ignored, as vLLM does.
    dropped = canonical_function(original_of(cls, "_build_shared_kv_mr"))[1]
    patch.replace(cls, "_build_shared_kv_mr", dropping(build_shared_kv_mr, dropped))
