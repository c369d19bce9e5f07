"""Does this vLLM's MoRIIO shared-MR builder fail on KV storage that is not 4 KiB padded and aligned?

Calls the real, installed MoRIIOConnectorWorker._build_shared_kv_mr on a worker
built with ``__new__`` plus the two attributes it reads (``kv_caches``,
``layer_to_spec``). The KV storage is host memory placed at a chosen address
modulo 4096 (``torch.frombuffer`` over a bytearray), so no GPU, mori or model
is needed. The scenarios here are also the tests' inputs (moriio-read.md §2.3).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_fix_core import Check, ProbeReport
from vllm_fix_mr_extent.rule import PAGE_SIZE, registration_problems

KDA_PAGE = 32  # bytes per KDA slot: conv (4, 1) f32 + ssm (2, 2) f32
KDA_SLOTS = 2
KDA_BYTES = KDA_PAGE * KDA_SLOTS


def backing(start_mod: int, nbytes: int) -> Any:
    """A uint8 tensor whose own storage is ``nbytes`` long and starts at ``start_mod`` mod 4096.

    The tensor keeps its bytearray alive (torch.frombuffer holds a reference).
    """
    import torch

    buffer = bytearray(nbytes + 2 * PAGE_SIZE)
    address = torch.frombuffer(buffer, dtype=torch.uint8).data_ptr()
    offset = (start_mod - address) % PAGE_SIZE
    return torch.frombuffer(buffer, dtype=torch.uint8, offset=offset, count=nbytes)


def kda_spec() -> Any:
    import torch
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(block_size=16, shapes=((4, 1), (2, 2)), dtypes=(torch.float32, torch.float32))


def attention_spec() -> Any:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=128, dtype=torch.float16)


def kda_cache(storage: Any, offset: int, slots: int = KDA_SLOTS) -> Any:
    """A packed KDA layer ``[slots, 1, 1, 32]`` (uint8) at ``offset`` bytes into ``storage``."""
    return storage[offset : offset + slots * KDA_PAGE].view(slots, 1, 1, KDA_PAGE)


def split_kv_cache(storage: Any, offset: int, num_blocks: int = 1) -> Any:
    """A legacy split K/V attention layer ``[2, blocks, 16, 1, 128]`` (fp16): K plane, then V plane."""
    import torch

    plane = num_blocks * 16 * 128 * 2
    return storage[offset : offset + 2 * plane].view(torch.float16).view(2, num_blocks, 16, 1, 128)


def worker(kv_caches: dict[str, Any], layer_to_spec: dict[str, Any]) -> Any:
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


def kda_tail_unaligned() -> Scenario:
    storage = backing(128, 8192)
    caches = {"kda": kda_cache(storage, 8192 - KDA_BYTES)}
    return Scenario(
        "kda-tail-unaligned",
        "storage at 128 mod 4096, one KDA layer ending at the storage end",
        storage,
        caches,
        {"kda": kda_spec()},
    )


def page_boundary_unaligned() -> Scenario:
    storage = backing(128, 8192)
    caches = {"kda": kda_cache(storage, PAGE_SIZE - 128)}
    return Scenario(
        "page-boundary-unaligned",
        "storage at 128 mod 4096, the only layer starting on a page boundary",
        storage,
        caches,
        {"kda": kda_spec()},
    )


def unpadded_tail() -> Scenario:
    storage = backing(0, 8256)
    caches = {"kda0": kda_cache(storage, 0), "kda1": kda_cache(storage, 8256 - KDA_BYTES)}
    return Scenario(
        "unpadded-tail",
        "aligned storage of 8256 bytes, the last layer ending at the storage end",
        storage,
        caches,
        {name: kda_spec() for name in caches},
    )


def split_kv_later_region() -> Scenario:
    storage = backing(0, 8192)
    caches = {"attn": split_kv_cache(storage, 0)}
    return Scenario(
        "split-kv-later-region",
        "aligned storage, one split K/V layer whose V region ends 4 KiB past its K region",
        storage,
        caches,
        {"attn": attention_spec()},
    )


def aligned_control() -> Scenario:
    storage = backing(0, 8192)
    caches = {"kda0": kda_cache(storage, 0), "kda1": kda_cache(storage, PAGE_SIZE)}
    return Scenario(
        "aligned-control",
        "aligned, page-padded storage of 8192 bytes (works before and after the fix)",
        storage,
        caches,
        {name: kda_spec() for name in caches},
    )


# The four failing inputs of moriio-read.md §2.3/§2.4, then the control.
FAILING: tuple[Callable[[], Scenario], ...] = (
    kda_tail_unaligned,
    page_boundary_unaligned,
    unpadded_tail,
    split_kv_later_region,
)
CONTROL = aligned_control


def problems(scenario: Scenario) -> list[str]:
    """Run the installed builder on the scenario; empty list: it met the contract."""
    from vllm_fix_mr_extent.patch import collect_regions

    try:
        reg, offsets = scenario.worker()._build_shared_kv_mr(scenario.kv_caches)
    except Exception as exc:
        return [f"{type(exc).__name__}: {exc}"]
    found: list[str] = []
    import torch

    if reg.dtype != torch.uint8 or reg.dim() != 1 or not reg.is_contiguous():
        found.append(f"registration is {reg.dtype} {tuple(reg.shape)}, not a contiguous uint8 vector")
    layer_ptrs = {layer: int(cache.data_ptr()) for layer, cache in scenario.kv_caches.items()}
    regions = collect_regions(scenario.kv_caches, scenario.layer_to_spec)
    found += registration_problems(int(reg.data_ptr()), int(reg.numel()), offsets, regions, layer_ptrs)
    return found


def _check(name: str, build: Callable[[], Scenario], guard: bool = False) -> Check:
    found = problems(build())
    return Check(name, bool(found), "; ".join(found), guard=guard)


def probe() -> ProbeReport:
    return ProbeReport(
        (
            _check("unaligned-storage-base", page_boundary_unaligned),
            _check("unpadded-storage-extent", unpadded_tail),
            _check("later-region-extent", split_kv_later_region),
            # Guard: an aligned, padded backing must keep registering exactly as before.
            _check("aligned-storage-registers", aligned_control, guard=True),
        )
    )
