"""The probe's oracle: may a block skip zeroing, measured on vLLM's own objects.

This module is the probe's alone: it imports nothing of the fix (``rule``, ``coverage``,
``patch``), so breaking the rule the patch uses cannot move the probe's expected answer.

For a KV-cache layout and an attention spec, a small KV cache is built on CPU as vLLM builds one
(``compute_layout_strides`` + ``create_kv_cache_views``) and filled with stale bytes. Then, per
block:

* **the zeroer**: vLLM's own ``KVBlockZeroer`` is built over the views; its zeroing kernel needs
  a GPU, so the bytes it clears are replayed from the segment table it launches the kernel with
  (segment address, block stride and page size, in 4-byte words, as the kernel reads them);
* **the READ**: MoRIIO's own worker computes the destination offsets of a READ of that block,
  through the method its ``_read_blocks`` calls for an attention layer
  (``_compute_read_attention_offsets`` where this vLLM has it, else
  ``_compute_block_transfer_offsets``), on a ``MoRIIOConnectorWorker`` carrying the attributes
  those methods read (as vLLM's own worker tests build one); the READ's bytes are written there.

A block may skip zeroing iff "zero, then READ" leaves exactly the memory "READ" alone leaves,
for every block, and the zeroer clears something. Anything vLLM raises is raised.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

TOY_LAYERS = 3
TOY_BLOCKS = 4
_WORD = 4  # the zeroing kernel stores int32 words
_ALIGN = 4096
_REMOTE = "prefill-0"


def zeroing_is_overwritten(layout_name: str, spec: Any) -> bool:
    """True iff, under `layout_name`, a READ of a block (every attention layer of the group)
    rewrites every byte vLLM's zeroer clears for that block. Raises what vLLM raises."""
    import torch

    raw, names, views = _kv_cache(layout_name, spec)
    clears = _zeroer_clears(raw, names, views, spec)
    read = _read_writes(raw, names, views, spec)
    size = raw.numel()
    # Stale bytes are never 0, so a zeroed byte the READ does not rewrite shows as a difference.
    stale = torch.full((size,), 0xA5, dtype=torch.uint8)
    remote = torch.full((size,), 0x5A, dtype=torch.uint8)
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


def _kv_cache(layout_name: str, spec: Any) -> tuple[Any, list[str], list[Any]]:
    import torch
    from vllm.v1.kv_cache_interface import (
        KVCacheTensor,
        compute_layer_kv_cache_shape_bytes,
        compute_layout_strides,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layout = KVCacheLayout[layout_name]
    strides = compute_layout_strides(spec, TOY_BLOCKS, TOY_LAYERS, layout)
    dims = (TOY_LAYERS, *compute_layer_kv_cache_shape_bytes(spec, TOY_BLOCKS))
    last = sum((n - 1) * s for n, s in zip(dims, strides, strict=True))
    size = (last // _ALIGN + 1) * _ALIGN
    raw = torch.zeros(size, dtype=torch.uint8)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(TOY_LAYERS)]
    tensor = KVCacheTensor(size=size, layers=names, layer_stride=strides[0], block_stride=strides[1])
    views = list(create_kv_cache_views(raw, spec, TOY_BLOCKS, layout, tensor))
    return raw, names, views


def _zeroer_clears(
    raw: Any, names: list[str], views: list[Any], spec: Any
) -> dict[int, list[tuple[int, int]]]:
    """Per block, the byte ranges (from the buffer's start) vLLM's zeroer launches its kernel on."""
    import torch
    from vllm.v1.worker.utils import AttentionGroup, KVBlockZeroer

    group = AttentionGroup(backend=None, layer_names=names, kv_cache_spec=spec, kv_cache_group_id=0)
    context = {name: SimpleNamespace(kv_cache=view) for name, view in zip(names, views, strict=True)}
    zeroer = KVBlockZeroer(torch.device("cpu"), [group], [spec.block_size], context, TOY_BLOCKS)
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


def _read_writes(raw: Any, names: list[str], views: list[Any], spec: Any) -> dict[int, list[tuple[int, int]]]:
    """Per block, the byte ranges (from the buffer's start) a MoRIIO READ of that block writes,
    from the offsets MoRIIO's worker computes for it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector as mc

    worker_cls = mc.MoRIIOConnectorWorker
    read_path = getattr(getattr(worker_cls, "_read_blocks", None), "__code__", None)
    names_used = read_path.co_names if read_path is not None else ()
    worker, remote_meta = _worker(mc, names, views, spec)
    base = raw.data_ptr()
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


def _worker(mc: Any, names: list[str], views: list[Any], spec: Any) -> tuple[Any, Any]:
    """A MoRIIOConnectorWorker (``__new__``) holding what its READ offset methods read, one TP
    rank on both sides, the same layout on both sides; and the peer's agent metadata."""
    worker = mc.MoRIIOConnectorWorker.__new__(mc.MoRIIOConnectorWorker)
    worker.world_size = 1
    worker.num_blocks = TOY_BLOCKS
    worker.model_config = SimpleNamespace(get_total_num_kv_heads=lambda: spec.num_kv_heads)
    worker.layer_to_spec = dict.fromkeys(names, spec)
    worker.kv_caches = dict(zip(names, views, strict=True))
    worker.kv_layer_mr_offset = {}  # offsets stay relative to each layer's view
    worker.kv_head_layouts = {}
    worker.attention_block_sizes = {}
    ml = getattr(mc, "get_layer_head_layout", None)
    if callable(ml):  # as register_kv_caches records them (a layer it cannot slice: none)
        for name, view in zip(names, views, strict=True):
            try:
                worker.kv_head_layouts[name] = ml(name, view, worker.layer_to_spec)
            except ValueError:
                continue
    remote_meta = SimpleNamespace(
        num_blocks=TOY_BLOCKS,
        kv_head_layouts={name: layout.to_wire() for name, layout in worker.kv_head_layouts.items()},
        attention_block_sizes={},
    )
    return worker, remote_meta


def hybrid_layouts() -> tuple[str, ...]:
    """The layouts vLLM's own resolver accepts for a hybrid (attention + Mamba) model."""
    import torch
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout

    attention = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16)
    mamba = MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.float16,))
    resolver_log = logging.getLogger(resolve_kv_cache_layout.__module__)
    level = resolver_log.level
    resolver_log.setLevel(logging.WARNING)
    accepted = []
    try:
        for layout in KVCacheLayout:
            config = SimpleNamespace(
                cache_config=SimpleNamespace(kv_cache_layout=None), kv_transfer_config=None
            )
            try:
                resolve_kv_cache_layout(config, [[layout.name]], (attention, mamba))  # type: ignore[arg-type]
            except (ValueError, AssertionError):
                continue
            accepted.append(layout.name)
    finally:
        resolver_log.setLevel(level)
    return tuple(accepted)
