"""Does this vLLM's MoRIIO READ consumer claim remote KV it will never load?

Asks the installed ``MoRIIOConnectorScheduler.get_num_new_matched_tokens`` (whatever is
installed in the process, our wrapper included) about real vLLM requests, built with
vLLM's own ``Request`` constructor and ``SamplingParams`` (the way the engine core builds
them: ``kv_transfer_params`` arrive in ``extra_args``). The connector scheduler is built
with ``__new__``, like vLLM's own MoRIIO tests build it, with the attributes its answer
depends on (consumer side, READ mode, block size, one full-attention KV cache group in
vLLM's own ``KVCacheConfig``): a real one needs a model config, which the probe cannot
have. It needs no mori, no model. Every expected answer is the README's rule table
(``(0, False)`` for each row no READ can honour), never the fix's code.
"""

from __future__ import annotations

from typing import Any

from vllm_fix_core import Check, ProbeReport
from vllm_fix_read_eligibility.releases import block_layout, new_request, route_fields, router_request_id
from vllm_fix_read_eligibility.rule import BlockLayout

PROMPT = 32

PLAIN: dict[str, dict[str, Any] | None] = {
    "none": None,
    "empty": {},
    "flag-false": {"do_remote_prefill": False},
}
ENGINE = {"remote_engine_id": "probe-prefill"}
# Where the READ goes: in the params, with the fields this vLLM's proxy sends
# (releases.route_fields), and in the request id the router builds (what 0.20.0 to 0.23.x
# route by). The "no-route" row has neither.
ADDRESS = ("127.0.0.1", 6301, 61005)
ROUTED_ID = router_request_id(*ADDRESS)
PLAIN_ID = "vllm-fix-probe"


def row_id(row: str) -> str:
    """The request id a malformed row is asked with: the router's, except for "no-route"."""
    return PLAIN_ID if row == "no-route" else ROUTED_ID


def route() -> dict[str, Any]:
    return {"transfer_id": "probe-tx", **route_fields(*ADDRESS)}


BLOCK = 16  # the probe engine's block size: a 32-token prompt fills 2 blocks


def well_formed(layout: BlockLayout) -> dict[str, Any]:
    """A remote prefill this vLLM can READ: its block ids in the layout it exchanges."""
    blocks: list[Any] = [[5, 6]] if layout is BlockLayout.PER_GROUP else [5, 6]
    return {"do_remote_prefill": True, "remote_block_ids": blocks, **ENGINE, **route()}


def malformed(layout: BlockLayout) -> dict[str, dict[str, Any]]:
    """do_remote_prefill params no READ can honour for a 32-token prompt on the probe's
    one-group engine (the README's rule table, one row each)."""
    good = well_formed(layout)

    def ids(*group: Any) -> list[Any]:
        return [list(group)] if layout is BlockLayout.PER_GROUP else list(group)

    routing = route()
    no_route = {k: v for k, v in good.items() if k not in routing or k == "transfer_id"}
    rows: dict[str, dict[str, Any]] = {
        "flag-only": {"do_remote_prefill": True},
        "no-block-ids": {"do_remote_prefill": True, **ENGINE, **routing},
        "empty-block-ids": {**good, "remote_block_ids": []},
        "empty-groups": {**good, "remote_block_ids": [[]]},
        "string-block-ids": {**good, "remote_block_ids": "0,1"},
        "no-engine-id": {k: v for k, v in good.items() if k != "remote_engine_id"},
        "too-few-blocks": {**good, "remote_block_ids": ids(5)},
        "negative-id": {**good, "remote_block_ids": ids(-1, 6)},
        "id-beyond-int64": {**good, "remote_block_ids": ids(5, 2**63)},  # SamplingParams allows < 2**64
        "duplicate-ids": {**good, "remote_block_ids": ids(5, 5)},
        "flag-not-true": {**good, "do_remote_prefill": "false"},
        "no-route": no_route,
        "junk-port": {**good, "remote_host": 5, "remote_handshake_port": "junk"},
    }
    if layout is BlockLayout.PER_GROUP:
        rows["extra-group"] = {**good, "remote_block_ids": [[5, 6], [7, 8]]}
    return rows


def consumer() -> Any:
    """A MoRIIO connector scheduler on the decode (kv_consumer) side, in READ mode, with
    the engine facts its answer depends on: one full-attention KV cache group of
    16-token blocks (vLLM's own KVCacheConfig), no hybrid state groups."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector as mc
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    sched = mc.MoRIIOConnectorScheduler.__new__(mc.MoRIIOConnectorScheduler)
    sched.is_producer = False
    sched.mode = mc.MoRIIOMode.READ
    sched.block_size = BLOCK
    sched._has_mamba = False
    sched._is_hma_required = False
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    sched.kv_cache_config = KVCacheConfig(
        num_blocks=100, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)]
    )
    return sched


def request(params: dict[str, Any] | None, rid: str = PLAIN_ID, num_tokens: int = PROMPT) -> Any:
    """A real vLLM request with `num_tokens` prompt tokens and a copy of `params`."""
    from vllm import SamplingParams

    extra = {"kv_transfer_params": None if params is None else dict(params)}
    return new_request(rid, list(range(num_tokens)), SamplingParams(max_tokens=1, extra_args=extra))


def matched(
    sched: Any, params: dict[str, Any] | None, num_computed_tokens: int = 0, rid: str = ROUTED_ID
) -> tuple[int, bool]:
    claimed = sched.get_num_new_matched_tokens(request(params, rid), num_computed_tokens)
    return int(claimed[0]), bool(claimed[1])


def probe() -> ProbeReport:
    sched = consumer()
    plain = {name: matched(sched, p) for name, p in PLAIN.items()}
    layout = block_layout()
    bad = {name: matched(sched, p, rid=row_id(name)) for name, p in malformed(layout).items()}
    good = matched(sched, well_formed(layout))
    wrong_plain = {k: v for k, v in plain.items() if v != (0, False)}
    wrong_bad = {k: v for k, v in bad.items() if v != (0, False)}
    return ProbeReport(
        (
            Check(
                "plain-request-claims-remote-kv",
                bool(wrong_plain),
                f"claimed {wrong_plain}" if wrong_plain else "",
            ),
            Check(
                "malformed-params-claim-remote-kv",
                bool(wrong_bad),
                f"claimed {wrong_bad}" if wrong_bad else "",
            ),
            # Guard: a real remote prefill must still claim N-1 tokens synchronously.
            Check("remote-prefill-loads", good != (PROMPT - 1, False), f"claimed {good}", guard=True),
        )
    )
