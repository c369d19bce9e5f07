"""The eligibility rule itself (no vLLM imports): which params may claim remote KV.

A READ consumer may tell the scheduler that prompt tokens will be loaded remotely only
when the request's ``kv_transfer_params`` can drive exactly that READ and the READ loads
every claimed token:

* the request asks for a remote prefill: ``do_remote_prefill`` is exactly ``True``;
* it names the prefill engine (``remote_engine_id``, a non-empty string);
* it names the prefill's blocks (``remote_block_ids``) in the layout the release's
  connector exchanges them in, and enough of them:

  * per KV cache group (vLLM 0.30.0 on, where MoRIIO supports the hybrid KV cache
    manager): one block list per group this engine reads, each holding at least the
    blocks the engine reads for the claimed tokens in that group;
  * flat (before): one list covering the claimed tokens;

  every id a non-negative ``int`` (never ``bool``) that fits the int64 the ids travel
  as, and no id twice in a group (except the null block 0, vLLM's placeholder for the
  blocks a sliding-window or state group skips);
* MoRIIO can route the READ: the address vLLM's own ``add_new_req`` resolves is a
  non-empty host string and two ports in 1..65535, and the optional peer sizes/ranks are
  well-typed (see :func:`params_route_reason` and :func:`route_reason`).

Anything else cannot load every claimed token: vLLM then queues no READ, a READ of too
few blocks, or fails the scheduler step for every running request.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any

# Block ids travel as int64 (msgpack, torch index tensors, byte offsets). The consumer's
# scheduler never learns the remote engine's block count (only its workers handshake),
# so this is the range it can know.
MAX_BLOCK_ID = 2**63 - 1
NULL_BLOCK = 0
MAX_PORT = 65535


class BlockLayout(str, enum.Enum):
    """How this vLLM's MoRIIO exchanges ``remote_block_ids``."""

    PER_GROUP = "per-group"
    FLAT = "flat"


_INT = {int}


def _bad_ids(ids: Sequence[Any], where: str) -> str | None:
    # One C-level pass over the ids' types; bool, float, str, None... are no block ids.
    if not set(map(type, ids)) <= _INT:
        block = next(b for b in ids if type(b) is not int)
        return f"remote_block_ids holds a non-integer block id {block!r}{where}"
    if ids and (min(ids) < 0 or max(ids) > MAX_BLOCK_ID):
        block = min(ids) if min(ids) < 0 else max(ids)
        return f"remote_block_ids holds block id {block}{where}, outside 0..2**63-1"
    if len(set(ids)) != len(ids):
        seen: set[int] = set()
        for block in ids:
            if block in seen and block != NULL_BLOCK:
                return f"remote_block_ids holds block id {block} twice{where}"
            seen.add(block)
    return None


def blocks_reason(blocks: Any, layout: BlockLayout, needed: Sequence[int] | None, claimed: int) -> str | None:
    """Why ``remote_block_ids`` cannot back a READ of the claimed tokens, or None.

    ``needed``: per block list this engine reads (one entry for the flat layout), the
    fewest remote blocks that cover the claimed tokens; None where the engine's groups
    are unknown (then each list must only be non-empty). ``claimed``: the tokens the
    claim counts as loaded (0: nothing to cover, vLLM only notifies the prefill).
    """
    if blocks is None:
        return "remote_block_ids is missing"
    if not isinstance(blocks, (list, tuple)):
        return f"remote_block_ids is a {type(blocks).__name__}, not a list"
    if not blocks:
        return "remote_block_ids is empty"
    if layout is BlockLayout.FLAT:
        groups: Sequence[Any] = (blocks,)
    else:
        groups = blocks
        if needed is not None and len(groups) != len(needed):
            return (
                f"remote_block_ids has {len(groups)} block lists, this engine reads {len(needed)} "
                "KV cache group(s)"
            )
    for index, group in enumerate(groups):
        where = "" if layout is BlockLayout.FLAT else f" in KV cache group {index}"
        if not isinstance(group, (list, tuple)):
            return (
                f"remote_block_ids holds a {type(group).__name__} where the block list of "
                f"KV cache group {index} belongs (this vLLM exchanges block ids per group)"
            )
        if not group:
            return f"remote_block_ids has no blocks{where or ' (flat list)'}"
        reason = _bad_ids(group, where)
        if reason:
            return reason
        if claimed > 0 and needed is not None and len(group) < needed[index]:
            return (
                f"remote_block_ids has {len(group)} block(s){where}, the {claimed} claimed tokens "
                f"need {needed[index]}"
            )
    return None


def _port(value: Any) -> bool:
    return type(value) is int and 1 <= value <= MAX_PORT


def _count(value: Any, least: int) -> bool:
    return type(value) is int and value >= least


def params_route_reason(params: Mapping[str, Any]) -> str | None:
    """Why the routing fields the request carries are ill-typed, or None (absent is fine
    here: whether MoRIIO can resolve an address is asked of MoRIIO itself)."""
    host = params.get("remote_host")
    if host is not None and not (isinstance(host, str) and host):
        return f"remote_host must be a non-empty string, got {host!r}"
    for name in ("remote_handshake_port", "remote_notify_port"):
        raw = params.get(name)
        if raw is None:
            continue
        value = raw
        if type(raw) is str:  # MoRIIO converts with int(); so do we, for the range
            try:
                value = int(raw)
            except ValueError:
                return f"{name} must be a port 1..65535, got {raw!r}"
        if not _port(value):  # also refuses bool and float, which int() would take
            return f"{name} must be a port 1..65535 (an int or a decimal string), got {raw!r}"
    for name, least in (("remote_dp_rank", 0), ("remote_dp_size", 1), ("remote_dp_size_local", 0)):
        if name in params and not _count(params[name], least):
            return f"{name} must be an int >= {least}, got {params[name]!r}"
    for name in ("remote_tp_size", "tp_size"):  # None / 0: unknown, MoRIIO assumes equal TP
        if params.get(name) is not None and not _count(params[name], 0):
            return f"{name} must be an int >= 0, got {params[name]!r}"
    transfer_id = params.get("transfer_id")
    if transfer_id is not None and not (isinstance(transfer_id, str) and transfer_id):
        return f"transfer_id must be a non-empty string, got {transfer_id!r}"
    return None


def route_reason(host: Any, handshake_port: Any, notify_port: Any) -> str | None:
    """Why the address MoRIIO's own ``add_new_req`` resolved (from the request id or the
    params) cannot be used, or None."""
    if not isinstance(host, str) or not host:
        return f"remote_host must be a non-empty string, got {host!r}"
    if not _port(handshake_port):
        return f"remote_handshake_port must be a port 1..65535, got {handshake_port!r}"
    if not _port(notify_port):
        return f"remote_notify_port must be a port 1..65535, got {notify_port!r}"
    return None


def malformed_reason(
    params: Mapping[str, Any],
    layout: BlockLayout = BlockLayout.PER_GROUP,
    needed: Sequence[int] | None = None,
    claimed: int = 0,
) -> str | None:
    """Why do_remote_prefill params cannot drive a READ of the claimed tokens, or None.

    The routing fields are checked separately (:func:`route_reason`), on what vLLM's own
    parser makes of them. Every block id is checked, in C-level passes per group, once
    per request admission (not per step).
    """
    flag = params.get("do_remote_prefill")
    if flag is not True:
        return f"do_remote_prefill must be True, got {flag!r}"
    reason = blocks_reason(params.get("remote_block_ids"), layout, needed, claimed)
    if reason:
        return reason
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
