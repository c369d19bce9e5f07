"""The native carry: the rule written into a vLLM tree's own MoRIIO connector.

Two changes to ``moriio_connector.py``:

* before ``class MoRIIOConnectorScheduler``, a few module-level helpers that implement the rule table of
  the README (``_read_params_refusal`` and the two checks it calls), written for the block-id
  layout this tree's connector exchanges (one list per KV cache group where MoRIIOConnector
  is a ``SupportsHMA`` connector, one flat list before) and, where the scheduler has hybrid
  (Mamba) groups, their one-block state slots;
* at the start of ``MoRIIOConnectorScheduler.get_num_new_matched_tokens`` a guard for the
  consumer in READ mode: no ``do_remote_prefill``, no claim; params the rule refuses, no
  claim, the flag cleared and one WARNING naming the request and the field.

The tree is recognised by the same structural check the runtime patch makes
(``patch.shape_reason``: the method's parameters, and that it decides by ``self.is_producer``
and ``self.mode``), read from the tree's source instead of the imported method. The code written
into the tree imports nothing of this project.
"""

from __future__ import annotations

import ast

import libcst as cst

from vllm_fix_core import cst as c
from vllm_fix_core.native import CannotCarry, NativeEdit, SourceTree, marker
from vllm_fix_read_eligibility.declaration import MODULE
from vllm_fix_read_eligibility.patch import TARGET, self_attributes, shape_reason
from vllm_fix_read_eligibility.rule import MAX_PORT, BlockLayout

PR = 60638
COMMON = MODULE.rpartition(".")[0] + ".moriio_common"
QUALNAME = f"MoRIIOConnectorScheduler.{TARGET}"
HELPER = "_read_params_refusal"
MARK_HELPERS = marker("read-eligibility", PR, "which kv_transfer_params can drive the READ a consumer claims")
MARK_GUARD = marker("read-eligibility", PR, "claim remote KV only for a READ the params can drive")
# Names the written code uses from the connector module's own namespace.
MODULE_NAMES = ("Any", "MoRIIOMode", "MoRIIOConnectorMetadata", "logger")

_NEEDED_FLAT = """
    return [-(-end // scheduler.block_size)]
"""
_NEEDED_LOCAL = """
    groups = scheduler.kv_cache_config.kv_cache_groups
    try:  # a DCP-sharded group's block holds block_size * dcp tokens
        dcp = max(int(scheduler.vllm_config.parallel_config.decode_context_parallel_size), 1)
    except Exception:
        dcp = 1

    def held(spec: Any) -> int:
        # The blocks a request holding tokens [0, N-1) has in a group: one for a state
        # group vLLM never prefix-caches (a circular buffer), else one per block of tokens.
        if getattr(spec, "prefix_cacheable", True) is False:
            return 1
        return -(-end // (spec.block_size * (dcp if getattr(spec, "dcp_sharded", False) else 1)))

    local = [list(range(held(g.kv_cache_spec))) for g in groups]
"""
_NEEDED_HYBRID = """
    if scheduler._has_mamba:
        # Hybrid READ: what the connector's own split_block_groups reads of those blocks
        # (every attention group, window-trimmed, or the one attention group before vLLM
        # 0.34; then one running-state slot per Mamba group).
        attn, mamba = scheduler.split_block_groups(local)
        attn_groups = attn if attn and isinstance(attn[0], list) else [attn]
        return [len(g) for g in attn_groups] + [len(g) for g in mamba]
"""
_NEEDED_CLIPPED = """
    # Clipped the way the connector clips what it reads (transfer groups only, the last
    # window of a sliding-window group).
    return [len(g) for g in scheduler.get_exchange_clipped_blocks(local)]
"""
_GROUPS_FLAT = """
    groups = [blocks]
"""
_GROUPS_PER_GROUP = """
    groups = blocks
    if needed is not None and len(groups) != len(needed):
        return (
            f"remote_block_ids has {len(groups)} block lists, this engine reads "
            f"{len(needed)} KV cache group(s)"
        )
"""

HELPERS = '''
def _read_blocks_needed(scheduler: Any, num_prompt_tokens: int) -> list[int] | None:
    """Per block list this engine reads, the fewest remote blocks that cover a READ of every
    prompt token but the last; None where the scheduler's KV cache groups are unknown (a
    scheduler built without its kv_cache_config)."""
    end = max(num_prompt_tokens - 1, 0)
    try:
{needed}
    except Exception:
        return None


def _read_block_ids_refusal(
    blocks: Any, needed: list[int] | None, claimed: int
) -> str | None:
    """Why remote_block_ids cannot back a READ of the claimed tokens, or None."""
    if blocks is None:
        return "remote_block_ids is missing"
    if not isinstance(blocks, (list, tuple)):
        return f"remote_block_ids is a {{type(blocks).__name__}}, not a list"
    if not blocks:
        return "remote_block_ids is empty"
{groups}
    for index, group in enumerate(groups):
        if not isinstance(group, (list, tuple)):
            return f"remote_block_ids holds a {{type(group).__name__}} where block list {{index}} belongs"
        if not group:
            return f"remote_block_ids has no blocks in block list {{index}}"
        # Block ids travel as int64; bool is no block id. The null block 0 may repeat
        # (sliding-window and state groups skip blocks with it).
        if any(type(block) is not int for block in group):
            return f"remote_block_ids holds a non-integer block id in block list {{index}}"
        if min(group) < 0 or max(group) > 2**63 - 1:
            return f"remote_block_ids holds a block id outside 0..2**63-1 in block list {{index}}"
        real = [block for block in group if block != 0]
        if len(set(real)) != len(real):
            return f"remote_block_ids holds a block id twice in block list {{index}}"
        if claimed > 0 and needed is not None and len(group) < needed[index]:
            return (
                f"remote_block_ids has {{len(group)}} block(s) in block list {{index}}, the "
                f"{{claimed}} claimed tokens need {{needed[index]}}"
            )
    return None


def _read_route_refusal(request_id: str, params: dict[str, Any]) -> str | None:
    """Why MoRIIO cannot route this READ to a host and two ports, or None: the routing
    fields must be well-typed, and MoRIIO's own add_new_req (run on a throwaway metadata
    object) must resolve an address."""

    def is_port(value: Any) -> bool:
        return type(value) is int and 1 <= value <= {max_port}

    def is_count(value: Any, least: int) -> bool:
        return type(value) is int and value >= least

    host = params.get("remote_host")
    if host is not None and not (isinstance(host, str) and host):
        return f"remote_host must be a non-empty string, got {{host!r}}"
    for name in ("remote_handshake_port", "remote_notify_port"):
        raw = params.get(name)
        if raw is None:
            continue
        value = raw
        if type(raw) is str:  # MoRIIO converts a string port with int()
            try:
                value = int(raw)
            except ValueError:
                return f"{{name}} must be a port 1..{max_port}, got {{raw!r}}"
        if not is_port(value):
            return f"{{name}} must be a port 1..{max_port} (an int or a decimal string), got {{raw!r}}"
    for name, least in (("remote_dp_rank", 0), ("remote_dp_size", 1), ("remote_dp_size_local", 0)):
        if name in params and not is_count(params[name], least):
            return f"{{name}} must be an int >= {{least}}, got {{params[name]!r}}"
    for name in ("remote_tp_size", "tp_size"):
        if params.get(name) is not None and not is_count(params[name], 0):
            return f"{{name}} must be an int >= 0, got {{params[name]!r}}"
    transfer_id = params.get("transfer_id")
    if transfer_id is not None and not (isinstance(transfer_id, str) and transfer_id):
        return f"transfer_id must be a non-empty string, got {{transfer_id!r}}"
    trial = dict(params)
    trial["transfer_id"] = transfer_id or f"sidecar-{{request_id}}"
    meta = MoRIIOConnectorMetadata()
    try:
        meta.add_new_req(request_id=request_id, local_block_ids=[], kv_transfer_params=trial)
        route = meta.reqs_to_recv[request_id]
    except Exception as exc:  # what would fail the scheduler step
        return f"MoRIIO cannot route its READ ({{type(exc).__name__}}: {{exc}})"
    if not isinstance(route.remote_host, str) or not route.remote_host:
        return f"remote_host must be a non-empty string, got {{route.remote_host!r}}"
    for name in ("remote_handshake_port", "remote_notify_port"):
        if not is_port(getattr(route, name)):
            return f"{{name}} must be a port 1..{max_port}, got {{getattr(route, name)!r}}"
    return None


def _read_params_refusal(
    scheduler: Any, request: Any, params: dict[str, Any], num_computed_tokens: int
) -> str | None:
    """Why these do_remote_prefill params cannot drive a READ of every token the consumer
    would claim (the field, and what is wrong with it), or None."""
    flag = params.get("do_remote_prefill")
    if flag is not True:
        return f"do_remote_prefill must be True, got {{flag!r}}"
    num_prompt_tokens = request.num_prompt_tokens
    claimed = num_prompt_tokens - num_computed_tokens - 1
    needed = _read_blocks_needed(scheduler, num_prompt_tokens)
    reason = _read_block_ids_refusal(params.get("remote_block_ids"), needed, claimed)
    if reason:
        return reason
    engine = params.get("remote_engine_id")
    if not isinstance(engine, str) or not engine:
        return f"remote_engine_id must be a non-empty string, got {{engine!r}}"
    return _read_route_refusal(getattr(request, "request_id", "?"), params)
'''

GUARD = f"""
if not self.is_producer and self.mode == MoRIIOMode.READ:
    params = request.kv_transfer_params
    if not isinstance(params, dict) or not params.get("do_remote_prefill"):
        return 0, False
    reason = {HELPER}(self, request, params, num_computed_tokens)
    if reason is not None:
        logger.warning(
            "MoRIIO READ: request %s asked for a remote prefill but its kv_transfer_params "
            "cannot drive a READ of the tokens it would claim (%s); recomputing its prompt "
            "locally instead",
            getattr(request, "request_id", "?"),
            reason,
        )
        # As vLLM does once it has handled a request's READ: nothing is queued from these.
        params["do_remote_prefill"] = False
        return 0, False
"""


def _base_names(node: ast.ClassDef) -> set[str]:
    names = {b.id for b in node.bases if isinstance(b, ast.Name)}
    return names | {b.attr for b in node.bases if isinstance(b, ast.Attribute)}


def layout_of(source: str) -> BlockLayout:
    """The tree's block-id layout (what releases.block_layout asks of the imported connector):
    per KV cache group where MoRIIOConnector is a SupportsHMA connector, flat otherwise."""
    connector = c.ast_of(source, "MoRIIOConnector")
    assert isinstance(connector, ast.ClassDef)
    return BlockLayout.PER_GROUP if "SupportsHMA" in _base_names(connector) else BlockLayout.FLAT


def recognize(tree: SourceTree) -> tuple[BlockLayout, bool]:
    """(layout, hybrid) for the tree, or CannotCarry where the runtime fix would refuse it."""
    source = tree.read(MODULE)
    method = c.ast_of(source, QUALNAME)
    if isinstance(method, ast.ClassDef):
        raise CannotCarry(f"{QUALNAME} is a class, not a method")
    reason = shape_reason(c.param_names(method), method)
    if reason:
        raise CannotCarry(reason)
    names = c.module_names(source)
    missing = [n for n in MODULE_NAMES if n not in names]
    if missing:
        raise CannotCarry(f"{tree.relpath(MODULE)} has no module-level {', '.join(missing)}")
    if HELPER in names:
        raise CannotCarry(f"{tree.relpath(MODULE)} already defines {HELPER}")
    mode = c.ast_of(tree.read(COMMON), "MoRIIOMode")
    if not isinstance(mode, ast.ClassDef) or "READ" not in c.class_names_defined(mode):
        raise CannotCarry("MoRIIOMode has no READ member")
    layout = layout_of(source)
    scheduler = c.ast_of(source, "MoRIIOConnectorScheduler")
    hybrid = layout is BlockLayout.PER_GROUP and "_has_mamba" in self_attributes(scheduler)
    return layout, hybrid


def helpers_code(layout: BlockLayout, hybrid: bool) -> str:
    """The module-level helpers for this tree's layout (the README's rule table)."""
    if layout is BlockLayout.FLAT:
        needed, groups = _NEEDED_FLAT, _GROUPS_FLAT
    else:
        parts = (
            (_NEEDED_LOCAL, _NEEDED_HYBRID, _NEEDED_CLIPPED) if hybrid else (_NEEDED_LOCAL, _NEEDED_CLIPPED)
        )
        needed = "\n".join(part.strip("\n") for part in parts)
        groups = _GROUPS_PER_GROUP

    def indent(block: str, by: str) -> str:
        return "\n".join(by + line if line else line for line in block.strip("\n").splitlines())

    return HELPERS.format(
        needed=indent(needed, "    "),
        groups=indent(groups, ""),
        max_port=MAX_PORT,
    )


def _add_guard(func: cst.FunctionDef) -> cst.FunctionDef:
    guard = c.statements(GUARD)
    return c.prepend(func, [c.with_comment(guard[0], MARK_GUARD), *guard[1:]])


def transform(tree: SourceTree) -> list[NativeEdit]:
    layout, hybrid = recognize(tree)

    def change(source: str) -> str:
        guarded = c.change_function(source, QUALNAME, _add_guard)
        return c.add_before(guarded, "MoRIIOConnectorScheduler", helpers_code(layout, hybrid), MARK_HELPERS)

    return [tree.edit(MODULE, change)]


__all__ = ["helpers_code", "layout_of", "recognize", "transform"]
