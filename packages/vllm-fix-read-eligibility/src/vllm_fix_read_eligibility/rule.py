"""The eligibility rule itself (no vLLM imports): which params may claim remote KV.

A READ consumer may tell the scheduler that prompt tokens will be loaded remotely only
when the request's ``kv_transfer_params`` can drive exactly that READ: the request asks
for a remote prefill (``do_remote_prefill``), names the prefill engine
(``remote_engine_id``) and the prefill's blocks to read (``remote_block_ids``). The block
ids come in the layout the release's connector exchanges them in:

* per KV cache group (vLLM 0.30.0 on, where MoRIIO supports the hybrid KV cache
  manager): a non-empty list of non-empty block-id lists, one per group;
* flat (before): one non-empty list of block ids.

Anything else cannot load a single token: vLLM then queues no READ (or a READ of no
blocks) for tokens it already counted as computed.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any


class BlockLayout(str, enum.Enum):
    """How this vLLM's MoRIIO exchanges ``remote_block_ids``."""

    PER_GROUP = "per-group"
    FLAT = "flat"


_INT = {int}


def _bad_ids(ids: list[Any] | tuple[Any, ...]) -> str | None:
    # One C-level pass over the ids' types; bool, float, str, None... are no block ids.
    if set(map(type, ids)) <= _INT:
        return None
    block = next(b for b in ids if type(b) is not int)
    return f"remote_block_ids holds a non-integer block id {block!r}"


def malformed_reason(params: Mapping[str, Any], layout: BlockLayout = BlockLayout.PER_GROUP) -> str | None:
    """Why do_remote_prefill params cannot drive a READ, or None if they can.

    Every block id is type-checked, in one C-level pass per group, once per request
    admission (not per step).
    """
    blocks = params.get("remote_block_ids")
    if blocks is None:
        return "remote_block_ids is missing"
    if not isinstance(blocks, (list, tuple)):
        return f"remote_block_ids is a {type(blocks).__name__}, not a list"
    if not blocks:
        return "remote_block_ids is empty"
    if layout is BlockLayout.PER_GROUP:
        for index, group in enumerate(blocks):
            if not isinstance(group, (list, tuple)):
                return (
                    f"remote_block_ids holds a {type(group).__name__} where the block list of "
                    f"KV cache group {index} belongs (this vLLM exchanges block ids per group)"
                )
            if not group:
                return f"remote_block_ids has no blocks for KV cache group {index}"
            reason = _bad_ids(group)
            if reason:
                return reason
    else:
        reason = _bad_ids(blocks)
        if reason:
            return reason + " (this vLLM exchanges one flat block-id list)"
    engine = params.get("remote_engine_id")
    if engine is None:
        return "remote_engine_id is missing"
    if not isinstance(engine, str) or not engine:
        return f"remote_engine_id must be a non-empty string, got {engine!r}"
    return None


def wants_remote_prefill(params: Any) -> bool:
    """The request asks for a remote prefill (vLLM's own gate, as 0.33.0 reads it)."""
    if type(params) is dict:  # the common case, without an ABC isinstance check
        return bool(params.get("do_remote_prefill"))
    return isinstance(params, Mapping) and bool(params.get("do_remote_prefill"))
