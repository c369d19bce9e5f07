"""Does this vLLM's MoRIIO shared-MR builder fail on KV storage that is not 4 KiB padded and aligned?

Calls the real, installed MoRIIOConnectorWorker._build_shared_kv_mr (whatever is
installed on the class: vLLM's body, this fix, or another layer) on a worker built
with ``__new__`` plus the two attributes the builder reads (``kv_caches``,
``layer_to_spec``). The layers are vLLM's own attention views (``FullAttentionSpec``,
block-first and split K/V), which every release with a shared MR (0.29.0+) registers;
the KV storage is host memory placed at a chosen address modulo 4096
(``torch.frombuffer`` over a bytearray), so no GPU, mori or model is needed.
A vLLM without ``_build_shared_kv_mr`` has no shared MR: not applicable.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_fix_core import Check, NotApplicable, ProbeReport
from vllm_fix_mr_extent.rule import PAGE_SIZE

ATTN_PLANE = 16 * 128 * 2  # one K or V plane of one block (16 tokens x 1 head x 128, fp16)
LAYER_BYTES = 2 * ATTN_PLANE  # one block-first attention layer of one block: 8192 bytes


def backing(start_mod: int, nbytes: int) -> Any:
    """A uint8 tensor whose own storage is ``nbytes`` long and starts at ``start_mod`` mod 4096.

    The tensor keeps its bytearray alive (torch.frombuffer holds a reference).
    """
    import torch

    buffer = bytearray(nbytes + 2 * PAGE_SIZE)
    address = torch.frombuffer(buffer, dtype=torch.uint8).data_ptr()
    offset = (start_mod - address) % PAGE_SIZE
    return torch.frombuffer(buffer, dtype=torch.uint8, offset=offset, count=nbytes)


def attention_spec() -> Any:
    """vLLM's own FullAttentionSpec (present, with these fields, in every release with a shared MR)."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=128, dtype=torch.float16)


def block_first_cache(storage: Any, offset: int) -> Any:
    """One block-first attention layer ``[1, 2, 16, 1, 128]`` (fp16, one registration region)."""
    import torch

    return storage[offset : offset + LAYER_BYTES].view(torch.float16).view(1, 2, 16, 1, 128)


def split_kv_cache(storage: Any, offset: int) -> Any:
    """One split K/V attention layer ``[2, 1, 16, 1, 128]`` (fp16): K plane, then V plane."""
    import torch

    return storage[offset : offset + LAYER_BYTES].view(torch.float16).view(2, 1, 16, 1, 128)


def has_shared_mr() -> bool:
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector as mc

    return any("_build_shared_kv_mr" in klass.__dict__ for klass in mc.MoRIIOConnectorWorker.__mro__)


def worker(kv_caches: dict[str, Any], layer_to_spec: dict[str, Any]) -> Any:
    """A MoRIIOConnectorWorker (``__new__``) with the two attributes the builder reads."""
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector as mc

    w = mc.MoRIIOConnectorWorker.__new__(mc.MoRIIOConnectorWorker)
    w.kv_caches = kv_caches
    w.layer_to_spec = layer_to_spec
    return w


@dataclass
class Scenario:
    name: str
    description: str
    storage: Any
    kv_caches: dict[str, Any]
    layer_to_spec: dict[str, Any]
    keep_alive: tuple[Any, ...] = ()  # further storages the caches live on

    def worker(self) -> Any:
        return worker(self.kv_caches, self.layer_to_spec)


def _attention(name: str, description: str, storage: Any, caches: dict[str, Any]) -> Scenario:
    return Scenario(name, description, storage, caches, {layer: attention_spec() for layer in caches})


def page_boundary_unaligned() -> Scenario:
    storage = backing(128, PAGE_SIZE + LAYER_BYTES)
    caches = {"attn": block_first_cache(storage, PAGE_SIZE - 128)}
    return _attention(
        "page-boundary-unaligned",
        "storage at 128 mod 4096, the only layer starting on a page boundary",
        storage,
        caches,
    )


def unpadded_tail() -> Scenario:
    nbytes = 2 * LAYER_BYTES + 64
    storage = backing(0, nbytes)
    caches = {
        "attn0": block_first_cache(storage, 0),
        "attn1": block_first_cache(storage, nbytes - LAYER_BYTES),
    }
    return _attention(
        "unpadded-tail",
        f"aligned storage of {nbytes} bytes, the last layer ending at the storage end",
        storage,
        caches,
    )


def split_kv_later_region() -> Scenario:
    storage = backing(0, LAYER_BYTES)
    caches = {"attn": split_kv_cache(storage, 0)}
    return _attention(
        "split-kv-later-region",
        "aligned storage, one split K/V layer whose V region ends 4 KiB past its K region",
        storage,
        caches,
    )


def aligned_control() -> Scenario:
    storage = backing(0, 2 * LAYER_BYTES)
    caches = {"attn0": block_first_cache(storage, 0), "attn1": block_first_cache(storage, LAYER_BYTES)}
    return _attention(
        "aligned-control",
        f"aligned, page-padded storage of {2 * LAYER_BYTES} bytes (works before and after the fix)",
        storage,
        caches,
    )


# The failing inputs the probe uses, then the control (tests add KDA inputs on releases with KDA).
FAILING: tuple[Callable[[], Scenario], ...] = (
    page_boundary_unaligned,
    unpadded_tail,
    split_kv_later_region,
)
CONTROL = aligned_control


def _span(tensor: Any, nbytes: int) -> tuple[int, int]:
    start = int(tensor.data_ptr())
    return start, start + int(nbytes)


def must_cover(scenario: Scenario) -> list[tuple[str, tuple[int, int]]]:
    """What any correct registration must cover, measured on vLLM's and torch's own objects.

    Every region vLLM itself enumerates for each layer (``iter_layer_registration_regions``:
    all of them, not only the first), and every layer tensor's own bytes as torch lays them
    out (``data_ptr`` .. ``data_ptr + numel * element_size``, for a contiguous layer).
    Nothing here comes from this fix's code.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector as mc

    spans: list[tuple[str, tuple[int, int]]] = []
    iter_regions = getattr(mc, "iter_layer_registration_regions", None)
    for layer, cache in scenario.kv_caches.items():
        if callable(iter_regions):
            for index, (tensor, nbytes) in enumerate(iter_regions(layer, cache, scenario.layer_to_spec)):
                spans.append((f"layer {layer!r} region {index}", _span(tensor, nbytes)))
        if cache.is_contiguous():
            spans.append((f"layer {layer!r} tensor", _span(cache, cache.numel() * cache.element_size())))
    return spans


def problems(scenario: Scenario) -> list[str]:
    """Run the installed builder on the scenario; empty list: it met the contract.

    The contract (from the bug's specification, checked on the objects themselves): a
    contiguous uint8 view of the scenario's own KV storage, inside that storage, covering
    everything ``must_cover`` names, with each layer's offset equal to its data pointer minus
    the registration's first byte.
    """
    import torch

    try:
        reg, offsets = scenario.worker()._build_shared_kv_mr(scenario.kv_caches)
    except Exception as exc:
        return [f"{type(exc).__name__}: {exc}"]
    found: list[str] = []
    if reg.dtype != torch.uint8 or reg.dim() != 1 or not reg.is_contiguous():
        found.append(f"registration is {reg.dtype} {tuple(reg.shape)}, not a contiguous uint8 vector")
    reg_start = int(reg.data_ptr())
    reg_end = reg_start + int(reg.numel()) * int(reg.element_size())
    storage = scenario.storage.untyped_storage()
    s_start, s_end = int(storage.data_ptr()), int(storage.data_ptr()) + int(storage.nbytes())
    if int(reg.untyped_storage().data_ptr()) != s_start:
        found.append("registration is not a view of the KV storage")
    if reg_start < s_start or reg_end > s_end:
        found.append(f"registration [{reg_start:#x}, {reg_end:#x}) leaves storage [{s_start:#x}, {s_end:#x})")
    for what, (lo, hi) in must_cover(scenario):
        if lo < reg_start or hi > reg_end:
            found.append(f"{what} [{lo:#x}, {hi:#x}) is not inside the registration")
    if set(offsets) != set(scenario.kv_caches):
        found.append(f"offsets name layers {sorted(offsets)}, expected {sorted(scenario.kv_caches)}")
    for layer, cache in scenario.kv_caches.items():
        want = int(cache.data_ptr()) - reg_start
        if layer in offsets and offsets[layer] != want:
            found.append(f"layer {layer!r}: offset {offsets[layer]} but data_ptr - base = {want}")
    return found


def _check(name: str, build: Callable[[], Scenario], guard: bool = False) -> Check:
    found = problems(build())
    return Check(name, bool(found), "; ".join(found), guard=guard)


def probe() -> ProbeReport:
    if not has_shared_mr():
        raise NotApplicable(
            "MoRIIOConnectorWorker has no _build_shared_kv_mr: this vLLM registers no shared KV "
            "memory region (added in vLLM 0.29.0)"
        )
    return ProbeReport(
        (
            _check("unaligned-storage-base", page_boundary_unaligned),
            _check("unpadded-storage-extent", unpadded_tail),
            _check("later-region-extent", split_kv_later_region),
            # Guard: an aligned, padded backing must keep registering exactly as before.
            _check("aligned-storage-registers", aligned_control, guard=True),
        )
    )
