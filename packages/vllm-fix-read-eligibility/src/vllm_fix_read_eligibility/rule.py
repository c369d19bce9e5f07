"""The eligibility rule itself (no vLLM imports): which params may claim remote KV."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def malformed_reason(params: Mapping[str, Any]) -> str | None:
    """Why do_remote_prefill params cannot drive a READ, or None if they can.

    A READ needs `remote_block_ids` as a non-empty sequence of per-KV-cache-group
    block-id lists (ints), and a non-empty string `remote_engine_id`.

    The check is O(number of groups): each group's type and its first and last block
    id are checked, not every id (a 32k-token prompt has thousands; this runs on the
    scheduler's admission path).
    """
    blocks = params.get("remote_block_ids")
    if blocks is None:
        return "remote_block_ids is missing"
    if not isinstance(blocks, (list, tuple)):
        return f"remote_block_ids is a {type(blocks).__name__}, not a list of per-group block lists"
    if not blocks:
        return "remote_block_ids is empty"
    for group in blocks:
        if not isinstance(group, (list, tuple)):
            return (
                f"remote_block_ids holds a {type(group).__name__} where a per-group block list "
                "belongs (a flat block list is not a READ block list)"
            )
        for block in (group[0], group[-1]) if group else ():
            if isinstance(block, bool) or not isinstance(block, int):
                return f"remote_block_ids holds a non-integer block id {block!r}"
    engine = params.get("remote_engine_id")
    if engine is None:
        return "remote_engine_id is missing"
    if not isinstance(engine, str) or not engine:
        return f"remote_engine_id must be a non-empty string, got {engine!r}"
    return None


def wants_remote_prefill(params: Any) -> bool:
    if type(params) is dict:  # the common case, without an ABC isinstance check
        return bool(params.get("do_remote_prefill"))
    return isinstance(params, Mapping) and bool(params.get("do_remote_prefill"))
