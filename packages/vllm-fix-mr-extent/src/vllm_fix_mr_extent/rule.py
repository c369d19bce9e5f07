"""The shared-MR registration rule, free of vLLM and torch.

Input: every registration region (pointer, length) of every transfer-enabled
layer, each tagged with the storage it lives on. Output: the one byte range to
register as the shared memory region (MR) and each layer's offset inside it.

Rule:

1. every region sits on one storage (same start address, size and device),
   inside that storage; otherwise refuse, naming both layers;
2. ``base`` = the lowest region pointer aligned down to ``page_size``; it may
   not lie before the storage start (refuse otherwise: no page-aligned base
   inside the allocation covers that region);
3. ``end`` = the highest region end, exactly (no round-up), never past the
   storage end;
4. the registration starts ``base - storage.start`` bytes into the storage
   (never negative) and is ``end - base`` bytes long;
5. each layer's offset is its own data pointer minus ``base``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

PAGE_SIZE = 4096


class SharedMRError(ValueError):
    """The layers cannot share one registration; the message says why and which layers.

    A ValueError, like the refusal of the function it replaces, so callers that
    handle that keep working.
    """


@dataclass(frozen=True)
class Storage:
    """One allocation: first byte address, size in bytes, device name."""

    start: int
    nbytes: int
    device: str

    @property
    def end(self) -> int:
        return self.start + self.nbytes

    def describe(self) -> str:
        return f"storage [{self.start:#x}, {self.end:#x}) on {self.device}"


@dataclass(frozen=True)
class Region:
    """One registration region of one layer (index: its position in the layer's list)."""

    layer: str
    index: int
    ptr: int
    nbytes: int
    storage: Storage

    @property
    def end(self) -> int:
        return self.ptr + self.nbytes

    def describe(self) -> str:
        return f"layer {self.layer!r} region {self.index} [{self.ptr:#x}, {self.end:#x})"


@dataclass(frozen=True)
class SharedMRPlan:
    """What to register: ``[base, end)`` of ``storage``, and the per-layer offsets."""

    base: int
    end: int
    storage: Storage
    offsets: Mapping[str, int]

    @property
    def length(self) -> int:
        return self.end - self.base

    @property
    def storage_offset(self) -> int:
        return self.base - self.storage.start


def align_down(value: int, page_size: int = PAGE_SIZE) -> int:
    return value - value % page_size


def plan_shared_mr(
    regions: Iterable[Region],
    layer_ptrs: Mapping[str, int],
    page_size: int = PAGE_SIZE,
) -> SharedMRPlan:
    """Apply the rule; raise SharedMRError with a precise reason when it cannot hold.

    ``layer_ptrs`` maps each layer (in the caller's order) to the data pointer
    of its cache tensor; the returned offsets keep that order.
    """
    if page_size <= 0:
        raise SharedMRError(f"page size must be positive, got {page_size}")
    regions = list(regions)
    if not regions:
        raise SharedMRError("no registration regions: nothing to put on a shared MR")
    first = regions[0]
    storage = first.storage
    for region in regions:
        if region.nbytes < 0:
            raise SharedMRError(f"{region.describe()} has a negative length {region.nbytes}")
        if region.storage != storage:
            raise SharedMRError(
                f"{region.describe()} lives on {region.storage.describe()}, but "
                f"{first.describe()} lives on {storage.describe()}: layers "
                f"{region.layer!r} and {first.layer!r} cannot share one memory region; "
                "every transfer layer must sit on the same KV allocation and device"
            )
        if region.ptr < storage.start or region.end > storage.end:
            raise SharedMRError(f"{region.describe()} is not inside its {storage.describe()}")
    lowest = min(regions, key=lambda r: r.ptr)
    base = align_down(lowest.ptr, page_size)
    if base < storage.start:
        raise SharedMRError(
            f"{lowest.describe()} starts in the first, partial {page_size}-byte page of "
            f"{storage.describe()} (the storage starts {storage.start % page_size} bytes "
            f"past a page boundary), so a page-aligned memory region would begin before "
            "the allocation; allocate the KV cache page-aligned (vLLM does so on ROCm)"
        )
    end = max(region.end for region in regions)
    layers_with_regions = {region.layer for region in regions}
    offsets: dict[str, int] = {}
    for layer, ptr in layer_ptrs.items():
        if layer not in layers_with_regions:
            raise SharedMRError(f"layer {layer!r} has no registration region")
        if not base <= ptr <= end:
            raise SharedMRError(
                f"layer {layer!r} starts at {ptr:#x}, outside the memory region "
                f"[{base:#x}, {end:#x}) built from its regions"
            )
        offsets[layer] = ptr - base
    return SharedMRPlan(base=base, end=end, storage=storage, offsets=offsets)


def registration_problems(
    reg_ptr: int,
    reg_nbytes: int,
    offsets: Mapping[str, int],
    regions: Iterable[Region],
    layer_ptrs: Mapping[str, int],
) -> list[str]:
    """What is wrong with a registration ``[reg_ptr, reg_ptr + reg_nbytes)`` (empty: nothing).

    Checks the contract any correct builder must meet, whatever its base choice:
    inside the storage, every region covered, offsets exact for every layer.
    """
    problems: list[str] = []
    reg_end = reg_ptr + reg_nbytes
    regions = list(regions)
    for storage in {region.storage for region in regions}:
        if reg_ptr < storage.start or reg_end > storage.end:
            problems.append(f"registration [{reg_ptr:#x}, {reg_end:#x}) leaves {storage.describe()}")
    for region in regions:
        if region.ptr < reg_ptr or region.end > reg_end:
            problems.append(f"{region.describe()} is not inside the registration")
    if set(offsets) != set(layer_ptrs):
        problems.append(f"offsets name layers {sorted(offsets)}, expected {sorted(layer_ptrs)}")
    for layer, ptr in layer_ptrs.items():
        if layer in offsets and offsets[layer] != ptr - reg_ptr:
            problems.append(f"layer {layer!r}: offset {offsets[layer]} but data_ptr - base = {ptr - reg_ptr}")
    return problems
