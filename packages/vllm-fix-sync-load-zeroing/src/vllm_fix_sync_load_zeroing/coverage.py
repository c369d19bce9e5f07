"""Does a MoRIIO READ rewrite every byte the KV-block zeroer would zero? Asked of vLLM itself.

For a KV-cache layout and the specs of the attention groups, build a small KV cache on CPU
exactly as vLLM builds one (``compute_layout_strides`` + ``create_kv_cache_views``; several
attention groups alias one allocation from byte 0, as vLLM's planner lays them out), let vLLM's
own ``KVBlockZeroer`` compute the byte segments it would zero for each block (in every attention
layer of every group), and let MoRIIO's own offset functions compute the bytes a READ of that
block writes into the layers of the group owning it. Covered means: for every block and every
group, every zeroed byte lies inside the READ's bytes. A layout a later vLLM adds is judged the
same way, not guessed from its name.

That needs vLLM's ``KVBlockZeroer``, in ``vllm.v1.worker.utils``, which a multi-process engine
core (where the patched scheduler runs) never imports, and this fix does not import it there
either: it pulls in vLLM's model layers and, through them, ``vllm._aiter_ops``, which changes
``os.environ`` and the ``aiter`` logger on import. Where the module is not loaded, coverage is
the bug's specification (§4.2): a block-compact layout (``KVCacheLayout.is_block_compact``:
each layer's page of a block is one run, which the zeroer and the READ both cover whole; with
one KV head LHBNC and BHLNC are such layouts too), or any layout where MoRIIO's READ copies head
slices (unpadded: vLLM cannot pad the others), with every layer of the group read. Where the
module is loaded (a single-process engine), the computation above is made.

Anything this cannot build or understand (an unknown layout name, a layout vLLM cannot pad,
a spec it rejects, a zeroer whose segment table changed shape) answers "not covered": the
caller then keeps zeroing, which costs a kernel launch and never loses KV.

This is the patch's computation. The probe does not use it: its expected answer comes from
:mod:`vllm_fix_sync_load_zeroing.oracle`, a separate measurement on vLLM's objects.
"""

from __future__ import annotations

import functools
import sys
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
WORKER_UTILS = "vllm.v1.worker.utils"


def read_rewrites_zeroed_bytes(
    layout_name: Any,
    spec: Any,
    skipped_layers: frozenset[int] = frozenset(),
    more_specs: tuple[Any, ...] = (),
) -> bool:
    """True iff, under `layout_name`, a READ of a block's attention pages (every layer of the
    group owning it but `skipped_layers`) rewrites every byte the zeroer zeroes for that block.
    `spec` is the first attention group's spec, `more_specs` those of the others."""
    if not isinstance(layout_name, str) or spec is None or any(s is None for s in more_specs):
        return False
    specs = (spec, *more_specs)
    measured = WORKER_UTILS in sys.modules  # never imported here (see the module's docstring)
    try:
        return _covered(layout_name, specs, frozenset(skipped_layers), measured)
    except TypeError:  # an unhashable spec: compute without the cache
        return _covered.__wrapped__(layout_name, specs, frozenset(skipped_layers), measured)


@functools.lru_cache(maxsize=64)
def _covered(
    layout_name: str, specs: tuple[Any, ...], skipped_layers: frozenset[int], measured: bool
) -> bool:
    try:
        if not measured:
            return specified(layout_name, specs, skipped_layers)
        zero, reads = byte_ranges(layout_name, specs[0], skipped_layers, specs[1:])
    except Exception as exc:  # fail safe: keep zeroing
        _logger.debug("coverage of %s not computable (%r): keeping zeroing", layout_name, exc)
        return False
    return all(contained(zero, group_reads) for group_reads in reads)


def specified(layout_name: str, specs: tuple[Any, ...], skipped_layers: frozenset[int]) -> bool:
    """Coverage as the bug's specification (§4.2) gives it, without vLLM's zeroer: every layer
    of the group read, the groups' pages alike, and the layout block-compact (also once a
    head dimension of size one is left out: with one KV head, LHBNC lays a block out as LBHNC
    does and BHLNC as BLHNC), or, unpadded (vLLM pads only block-compact layouts), one MoRIIO's
    READ copies head slices in."""
    from vllm.v1.kv_cache_layout import KVCacheLayout

    if skipped_layers or layout_name not in KVCacheLayout.__members__:
        return False
    if len({s.page_size_bytes for s in specs}) != 1:
        return False
    layout = KVCacheLayout[layout_name]
    if layout.is_block_compact:
        return True
    if any(getattr(s, "page_size_padded", None) is not None for s in specs):
        return False
    if all(getattr(s, "num_kv_heads", None) == 1 for s in specs):
        outer = [dim for dim in layout_name if dim != "H"][:2]
        if sorted(outer) == ["B", "L"]:
            return True
    return _read_copies_head_slices()


def _read_copies_head_slices() -> bool:
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector as mc
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_layout as ml

    return (
        hasattr(ml, "get_layer_head_layout")
        and hasattr(ml, "compute_head_slice_offsets")
        and hasattr(mc.MoRIIOConnectorWorker, "_compute_read_attention_offsets")
    )


def contained(zero: dict[int, list[tuple[int, int]]], reads: dict[int, list[tuple[int, int]]]) -> bool:
    """Covered, from byte_ranges(): the zeroer zeroes something, and for every block every
    zeroed byte lies inside the READ's bytes."""
    return bool(zero) and all(_inside(zero[b], reads[b]) for b in zero)


Ranges = dict[int, list[tuple[int, int]]]


def byte_ranges(
    layout_name: str,
    spec: Any,
    skipped_layers: frozenset[int] = frozenset(),
    more_specs: tuple[Any, ...] = (),
) -> tuple[Ranges, list[Ranges]]:
    """Per toy block: the (start, end) byte ranges vLLM's zeroer zeroes, and per attention group
    (`spec`, then `more_specs`) those a MoRIIO READ of the block into that group's layers
    writes, relative to the start of the backing allocation. Raises what vLLM raises."""
    import torch
    from vllm.v1.kv_cache_interface import (
        KVCacheTensor,
        compute_layer_kv_cache_shape_bytes,
        compute_layout_strides,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import AttentionGroup, KVBlockZeroer

    layout = KVCacheLayout[layout_name]
    specs = (spec, *more_specs)
    strides = [compute_layout_strides(s, TOY_BLOCKS, TOY_LAYERS, layout) for s in specs]
    extent = 1
    for group_spec, group_strides in zip(specs, strides, strict=True):
        shape = (TOY_LAYERS, *compute_layer_kv_cache_shape_bytes(group_spec, TOY_BLOCKS))
        extent = max(extent, 1 + sum((n - 1) * s for n, s in zip(shape, group_strides, strict=True)))
    size = -(-extent // _PAGE) * _PAGE
    raw = torch.zeros(size, dtype=torch.int8)
    groups = []
    context: dict[str, Any] = {}
    layer_to_spec: dict[str, Any] = {}
    for index, (group_spec, group_strides) in enumerate(zip(specs, strides, strict=True)):
        names = [f"model.layers.{index}.{i}.attn" for i in range(TOY_LAYERS)]
        # Every group aliases the allocation from byte 0, as vLLM's planner lays them out.
        layer_stride, block_stride = group_strides[0], group_strides[1]
        tensor = KVCacheTensor(size=size, layers=names, layer_stride=layer_stride, block_stride=block_stride)
        views = create_kv_cache_views(raw, group_spec, TOY_BLOCKS, layout, tensor)
        groups.append((names, views))
        context.update((n, SimpleNamespace(kv_cache=view)) for n, view in zip(names, views, strict=True))
        layer_to_spec.update(dict.fromkeys(names, group_spec))
    attention_groups = [
        AttentionGroup(backend=None, layer_names=names, kv_cache_spec=group_spec, kv_cache_group_id=index)
        for index, ((names, _), group_spec) in enumerate(zip(groups, specs, strict=True))
    ]
    block_sizes = [s.block_size for s in specs]
    zeroer = KVBlockZeroer(torch.device("cpu"), attention_groups, block_sizes, context, TOY_BLOCKS)
    meta = zeroer._meta
    if meta is None:
        raise ValueError("the zeroer found no attention segment")
    addrs, block_strides, pages = (list(map(int, t.tolist())) for t in meta[:3])
    base = raw.data_ptr()
    zero: Ranges = {}
    reads: list[Ranges] = [{} for _ in groups]
    for block in range(TOY_BLOCKS):
        zero[block] = [
            (a - base + block * s * _ZERO_WORD, a - base + block * s * _ZERO_WORD + p * _ZERO_WORD)
            for a, s, p in zip(addrs, block_strides, pages, strict=True)
        ]
        for group_reads, (names, views) in zip(reads, groups, strict=True):
            group_reads[block] = []
            for index, (name, view) in enumerate(zip(names, views, strict=True)):
                if index in skipped_layers:
                    continue
                origin = view.data_ptr() - base
                offsets, sizes = read_offsets(name, view, layer_to_spec, block)
                group_reads[block].extend(
                    (origin + o, origin + o + n) for o, n in zip(offsets, sizes, strict=True)
                )
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
