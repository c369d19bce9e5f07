"""The probe's oracle: may a block skip zeroing, measured on vLLM's own objects.

This module is the probe's alone: it imports nothing of the fix (``rule``, ``coverage``,
``patch``), so breaking the rule the patch uses cannot move the probe's expected answer.

For a KV-cache layout and the attention specs of one or more attention groups, a small KV cache
is built on CPU as vLLM builds one (``compute_layout_strides`` + ``create_kv_cache_views``; the
groups alias one allocation from byte 0, as vLLM's planner lays them out) and filled with stale
bytes. Then, per block and per attention group owning the block:

* **the zeroer**: vLLM's own ``KVBlockZeroer`` is built over every group's views (it zeroes a
  block in every attention layer of every group); its zeroing kernel needs a GPU, so the bytes
  it clears are replayed from the segment table it launches the kernel with (segment address,
  block stride and page size, in 4-byte words, as the kernel reads them);
* **the READ**: MoRIIO's own worker computes the destination offsets of a READ of that block
  into the owning group's layers, through the method its ``_read_blocks`` calls for an
  attention layer (``_compute_read_attention_offsets`` where this vLLM has it, else
  ``_compute_block_transfer_offsets``), on a ``MoRIIOConnectorWorker`` carrying the attributes
  those methods read (as vLLM's own worker tests build one); the READ's bytes are written there.

A block may skip zeroing iff "zero, then READ" leaves exactly the memory "READ" alone leaves,
for every block and every group, and the zeroer clears something. Anything vLLM raises is raised.

One stand-in remains: the static forward context the zeroer reads each layer's ``kv_cache``
from holds, per layer name, an object with that one attribute instead of vLLM's attention layer
(an ``nn.Module`` that needs a model, the platform's attention backend and a compilation config
to be built; the zeroer reads nothing else of it).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from vllm_fix_core.guest import build

TOY_LAYERS = 3
TOY_BLOCKS = 4
_WORD = 4  # the zeroing kernel stores int32 words
_ALIGN = 4096
_REMOTE = "prefill-0"


def zeroing_is_overwritten(layout_name: str, spec: Any, *more_specs: Any) -> bool:
    """True iff, under `layout_name`, a READ of a block (every attention layer of the group
    owning it) rewrites every byte vLLM's zeroer clears for that block. `spec` is the attention
    group's spec; `more_specs`, those of further attention groups aliasing the same allocation
    (each group's READ is judged alone). Raises what vLLM raises."""
    import torch

    specs = (spec, *more_specs)
    raw, groups = _kv_cache(layout_name, specs)
    clears = _zeroer_clears(raw, groups)
    size = raw.numel()
    # Stale bytes are never 0, so a zeroed byte the READ does not rewrite shows as a difference.
    stale = torch.full((size,), 0xA5, dtype=torch.uint8)
    remote = torch.full((size,), 0x5A, dtype=torch.uint8)
    for owner in range(len(groups)):
        read = _read_writes(raw, groups, owner)
        for block in range(TOY_BLOCKS):
            read_only = stale.clone()
            raced = stale.clone()
            for start, stop in _checked(clears[block], size):
                raced[start:stop] = 0
            if torch.equal(raced, stale):
                return False  # the zeroer clears nothing here: nothing to judge
            for memory in (read_only, raced):
                for start, stop in _checked(read[block], size):
                    memory[start:stop] = remote[start:stop]
            if not torch.equal(read_only, raced):
                return False
    return True


def _checked(ranges: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    for start, stop in ranges:
        if start < 0 or stop > size or stop < start:
            raise ValueError(f"byte range {start}:{stop} outside the KV cache of {size} bytes")
    return ranges


# One attention group of the toy: (its spec, its layer names, their views).
_Group = tuple[Any, list[str], list[Any]]


def _kv_cache(layout_name: str, specs: tuple[Any, ...]) -> tuple[Any, list[_Group]]:
    import torch
    from vllm.v1.kv_cache_interface import (
        KVCacheTensor,
        compute_layer_kv_cache_shape_bytes,
        compute_layout_strides,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layout = KVCacheLayout[layout_name]
    strides = [compute_layout_strides(spec, TOY_BLOCKS, TOY_LAYERS, layout) for spec in specs]
    last = 0
    for spec, group_strides in zip(specs, strides, strict=True):
        dims = (TOY_LAYERS, *compute_layer_kv_cache_shape_bytes(spec, TOY_BLOCKS))
        last = max(last, sum((n - 1) * s for n, s in zip(dims, group_strides, strict=True)))
    size = (last // _ALIGN + 1) * _ALIGN
    raw = torch.zeros(size, dtype=torch.uint8)
    groups: list[_Group] = []
    for index, (spec, group_strides) in enumerate(zip(specs, strides, strict=True)):
        names = [f"model.layers.{index * TOY_LAYERS + i}.self_attn.attn" for i in range(TOY_LAYERS)]
        # Groups alias the allocation from byte 0, as vLLM's planner lays them out.
        layer_stride, block_stride = group_strides[0], group_strides[1]
        tensor = KVCacheTensor(size=size, layers=names, layer_stride=layer_stride, block_stride=block_stride)
        groups.append((spec, names, list(create_kv_cache_views(raw, spec, TOY_BLOCKS, layout, tensor))))
    return raw, groups


def _zeroer_clears(raw: Any, groups: list[_Group]) -> dict[int, list[tuple[int, int]]]:
    """Per block, the byte ranges (from the buffer's start) vLLM's zeroer launches its kernel on."""
    import torch
    from vllm.v1.worker.utils import AttentionGroup, KVBlockZeroer

    attention_groups = [
        AttentionGroup(backend=None, layer_names=names, kv_cache_spec=spec, kv_cache_group_id=index)
        for index, (spec, names, _) in enumerate(groups)
    ]
    # The stand-in for vLLM's attention layers (see the module's docstring): their kv_cache only.
    context = {
        name: SimpleNamespace(kv_cache=view)
        for _, names, views in groups
        for name, view in zip(names, views, strict=True)
    }
    block_sizes = [spec.block_size for spec, _, _ in groups]
    zeroer = KVBlockZeroer(torch.device("cpu"), attention_groups, block_sizes, context, TOY_BLOCKS)
    table = zeroer._meta
    if table is None:
        raise ValueError("vLLM's zeroer found no attention segment to zero")
    seg_addrs, seg_block_strides, seg_pages = (t.tolist() for t in table[:3])
    base = raw.data_ptr()
    clears: dict[int, list[tuple[int, int]]] = {}
    for block in range(TOY_BLOCKS):
        clears[block] = []
        for addr, stride_words, page_words in zip(seg_addrs, seg_block_strides, seg_pages, strict=True):
            start = int(addr) - base + block * int(stride_words) * _WORD
            clears[block].append((start, start + int(page_words) * _WORD))
    return clears


def _read_writes(raw: Any, groups: list[_Group], owner: int) -> dict[int, list[tuple[int, int]]]:
    """Per block, the byte ranges (from the buffer's start) a MoRIIO READ of that block into the
    layers of group `owner` writes, from the offsets MoRIIO's worker computes for it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector as mc

    worker_cls = mc.MoRIIOConnectorWorker
    read_path = getattr(getattr(worker_cls, "_read_blocks", None), "__code__", None)
    names_used = read_path.co_names if read_path is not None else ()
    worker, remote_meta = _worker(mc, groups)
    base = raw.data_ptr()
    _, names, views = groups[owner]
    writes: dict[int, list[tuple[int, int]]] = {}
    for block in range(TOY_BLOCKS):
        writes[block] = []
        for name, view in zip(names, views, strict=True):
            if "_compute_read_attention_offsets" in names_used:
                local, _, sizes = worker._compute_read_attention_offsets(
                    name, [block], [block], remote_meta, 1, _REMOTE
                )
            else:
                local, _, sizes = worker._compute_block_transfer_offsets(
                    name, [block], [block], remote_meta, remote_tp_size=1, remote_engine_id=_REMOTE
                )
            origin = view.data_ptr() - base
            writes[block].extend(
                (origin + int(o), origin + int(o) + int(n)) for o, n in zip(local, sizes, strict=True)
            )
    return writes


def _worker(mc: Any, groups: list[_Group]) -> tuple[Any, Any]:
    """A MoRIIOConnectorWorker (``__new__``) holding what its READ offset methods read, one TP
    rank on both sides, the same layout on both sides; and the peer's agent metadata (vLLM's
    ``MoRIIOAgentMetadata``)."""
    from vllm.config import ModelConfig

    layer_to_spec = {name: spec for spec, names, _ in groups for name in names}
    kv_caches = {name: view for _, names, views in groups for name, view in zip(names, views, strict=True)}
    worker = mc.MoRIIOConnectorWorker.__new__(mc.MoRIIOConnectorWorker)
    worker.world_size = 1
    worker.num_blocks = TOY_BLOCKS
    # vLLM's ModelConfig (no model behind it): the one method the offsets ask, answered for the toy.
    model_config = build(ModelConfig)
    object.__setattr__(model_config, "get_total_num_kv_heads", lambda: groups[0][0].num_kv_heads)
    worker.model_config = model_config
    worker.layer_to_spec = layer_to_spec
    worker.kv_caches = kv_caches
    worker.kv_layer_mr_offset = {}  # offsets stay relative to each layer's view
    worker.kv_head_layouts = {}
    worker.attention_block_sizes = {}
    ml = getattr(mc, "get_layer_head_layout", None)
    if callable(ml):  # as register_kv_caches records them (a layer it cannot slice: none)
        for name, view in kv_caches.items():
            try:
                worker.kv_head_layouts[name] = ml(name, view, layer_to_spec)
            except ValueError:
                continue
    fields = set(getattr(mc.MoRIIOAgentMetadata, "__struct_fields__", ()))
    extra: dict[str, Any] = {
        "kv_head_layouts": {name: layout.to_wire() for name, layout in worker.kv_head_layouts.items()},
        "attention_block_sizes": {},
    }
    remote_meta = mc.MoRIIOAgentMetadata(
        engine_id=_REMOTE,
        agent_metadata=b"",
        kv_caches_base_addr=[],
        num_blocks=TOY_BLOCKS,
        block_len=0,
        attn_backend_name="probe",
        **{name: value for name, value in extra.items() if name in fields},
    )
    return worker, remote_meta


def hybrid_layouts() -> tuple[str, ...]:
    """The layouts vLLM's own resolver accepts for a hybrid (attention + Mamba) model."""
    import torch
    from vllm.config import CacheConfig, VllmConfig
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout

    attention = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16)
    mamba = MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.float16,))
    accepted = []
    for layout in KVCacheLayout:
        # A fresh config each time: the resolver records what it resolved on the cache config,
        # and a layout recorded there wins outright on the next call.
        cache = build(CacheConfig, kv_cache_layout=None)
        config = build(VllmConfig, cache_config=cache, kv_transfer_config=None)
        try:
            resolve_kv_cache_layout(config, [[layout.name]], (attention, mamba))
        except (ValueError, AssertionError):
            continue
        accepted.append(layout.name)
    return tuple(accepted)
