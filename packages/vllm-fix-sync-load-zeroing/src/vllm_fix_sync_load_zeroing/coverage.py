"""Does a MoRIIO READ rewrite every byte the KV-block zeroer would zero? Asked of vLLM itself.

For a KV-cache layout and an attention spec, build a small KV cache on CPU exactly as vLLM
builds one (``compute_layout_strides`` + ``create_kv_cache_views``), let vLLM's own
``KVBlockZeroer`` compute the byte segments it would zero for each block, and let MoRIIO's own
offset functions compute the bytes a READ of that block writes into each layer. Covered means:
for every block, every zeroed byte lies inside the READ's bytes. A layout a later vLLM adds is
judged the same way, not guessed from its name.

Anything this cannot build or understand (an unknown layout name, a layout vLLM cannot pad,
a spec it rejects, a zeroer whose segment table changed shape) answers "not covered": the
caller then keeps zeroing, which costs a kernel launch and never loses KV.

This is the patch's computation. The probe does not use it: its expected answer comes from
:mod:`vllm_fix_sync_load_zeroing.oracle`, a separate measurement on vLLM's objects.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from types import SimpleNamespace
from typing import Any

from vllm_fix_core import get_logger

_logger = get_logger("sync-load-zeroing")

TOY_LAYERS = 3
TOY_BLOCKS = 4
# The zeroing kernel addresses int32 words: segment strides and page sizes are in 4-byte units.
_ZERO_WORD = 4
_PAGE = 4096


def read_rewrites_zeroed_bytes(
    layout_name: Any, spec: Any, skipped_layers: frozenset[int] = frozenset()
) -> bool:
    """True iff, under `layout_name`, a READ of a block's attention pages (every layer of the
    group but `skipped_layers`) rewrites every byte the zeroer zeroes for that block."""
    if not isinstance(layout_name, str) or spec is None:
        return False
    try:
        return _covered(layout_name, spec, frozenset(skipped_layers))
    except TypeError:  # an unhashable spec: compute without the cache
        return _covered.__wrapped__(layout_name, spec, frozenset(skipped_layers))


@functools.lru_cache(maxsize=64)
def _covered(layout_name: str, spec: Any, skipped_layers: frozenset[int]) -> bool:
    try:
        zero, reads = byte_ranges(layout_name, spec, skipped_layers)
    except Exception as exc:  # fail safe: keep zeroing
        _logger.debug("coverage of %s not computable (%r): keeping zeroing", layout_name, exc)
        return False
    return contained(zero, reads)


def contained(zero: dict[int, list[tuple[int, int]]], reads: dict[int, list[tuple[int, int]]]) -> bool:
    """Covered, from byte_ranges(): the zeroer zeroes something, and for every block every
    zeroed byte lies inside the READ's bytes."""
    return bool(zero) and all(_inside(zero[b], reads[b]) for b in zero)


def byte_ranges(
    layout_name: str, spec: Any, skipped_layers: frozenset[int] = frozenset()
) -> tuple[dict[int, list[tuple[int, int]]], dict[int, list[tuple[int, int]]]]:
    """Per toy block: the (start, end) byte ranges vLLM's zeroer zeroes and those a MoRIIO READ
    writes, relative to the start of the backing allocation. Raises what vLLM raises."""
    import torch
    from vllm.v1.kv_cache_interface import KVCacheTensor, compute_layout_strides, create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import AttentionGroup, KVBlockZeroer

    layout = KVCacheLayout[layout_name]
    strides = compute_layout_strides(spec, TOY_BLOCKS, TOY_LAYERS, layout)
    from vllm.v1.kv_cache_interface import compute_layer_kv_cache_shape_bytes

    shape = (TOY_LAYERS, *compute_layer_kv_cache_shape_bytes(spec, TOY_BLOCKS))
    extent = 1 + sum((n - 1) * s for n, s in zip(shape, strides, strict=True))
    size = -(-extent // _PAGE) * _PAGE
    raw = torch.zeros(size, dtype=torch.int8)
    names = [f"model.layers.{i}.attn" for i in range(TOY_LAYERS)]
    tensor = KVCacheTensor(size=size, layers=names, layer_stride=strides[0], block_stride=strides[1])
    views = create_kv_cache_views(raw, spec, TOY_BLOCKS, layout, tensor)
    group = AttentionGroup(backend=None, layer_names=names, kv_cache_spec=spec, kv_cache_group_id=0)
    context = {name: SimpleNamespace(kv_cache=view) for name, view in zip(names, views, strict=True)}
    zeroer = KVBlockZeroer(torch.device("cpu"), [group], [spec.block_size], context, TOY_BLOCKS)
    meta = zeroer._meta
    if meta is None:
        raise ValueError("the zeroer found no attention segment")
    addrs, block_strides, pages = (list(map(int, t.tolist())) for t in meta[:3])
    base = raw.data_ptr()
    layer_to_spec = {name: spec for name in names}
    zero: dict[int, list[tuple[int, int]]] = {}
    reads: dict[int, list[tuple[int, int]]] = {}
    for block in range(TOY_BLOCKS):
        zero[block] = [
            (a - base + block * s * _ZERO_WORD, a - base + block * s * _ZERO_WORD + p * _ZERO_WORD)
            for a, s, p in zip(addrs, block_strides, pages, strict=True)
        ]
        reads[block] = []
        for index, (name, view) in enumerate(zip(names, views, strict=True)):
            if index in skipped_layers:
                continue
            origin = view.data_ptr() - base
            offsets, sizes = read_offsets(name, view, layer_to_spec, block)
            reads[block].extend((origin + o, origin + o + n) for o, n in zip(offsets, sizes, strict=True))
    return zero, reads


def read_offsets(
    name: str, view: Any, layer_to_spec: dict[str, Any], block: int
) -> tuple[list[int], list[int]]:
    """The local (destination) byte offsets and sizes MoRIIO's READ uses for one block of one
    attention layer, from MoRIIO's own functions: a raw block copy where the connector makes
    one, its head-slice copy where this vLLM's READ path has one and the layout is not dense."""
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector as mc
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_layout as ml

    head_slicing = (
        hasattr(ml, "get_layer_head_layout")
        and hasattr(ml, "compute_head_slice_offsets")
        and hasattr(mc.MoRIIOConnectorWorker, "_compute_read_attention_offsets")
    )
    if head_slicing:
        head_layout = ml.get_layer_head_layout(name, view, layer_to_spec)
        if not head_layout.is_dense:
            # The connector computes the peer (source) side as "local" and swaps; with the same
            # layout on both sides the destination offsets are the second list.
            _, local, sizes = ml.compute_head_slice_offsets(
                head_layout, head_layout, [block], [block], 0, 0, head_layout.num_heads
            )
            return list(local), list(sizes)
    local, _, sizes = ml.compute_block_transfer_offsets(
        name, view, layer_to_spec, [block], [block], TOY_BLOCKS
    )
    return list(local), list(sizes)


def _inside(needed: Sequence[tuple[int, int]], written: Iterable[tuple[int, int]]) -> bool:
    merged: list[list[int]] = []
    for start, end in sorted(written):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    for start, end in needed:
        if end <= start:
            continue
        if not any(m_start <= start and end <= m_end for m_start, m_end in merged):
            return False
    return True
