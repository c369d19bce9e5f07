"""Does this vLLM zero KV blocks that a synchronous MoRIIO READ is writing in the same step?

Calls the installed MoRIIO entry point the exclusion lives in: the connector's
``get_sync_load_block_ids`` where this vLLM has that API (the #59164 lineage), otherwise
``MoRIIOConnectorScheduler.build_connector_meta`` on a scheduler built like vLLM's own MoRIIO
tests build one (``__new__`` plus the attributes it reads). Each case of the decision table is
run under every KV-cache layout vLLM accepts for a hybrid model, and compared with the rule,
whose layout condition is computed from vLLM's own view builder, zeroer and READ offsets.

Those coverage facts (the oracle's input, not vLLM's behaviour under test) come from a
persistent memo where vLLM's worker utilities are not loaded yet (see
:mod:`vllm_fix_sync_load_zeroing.memo`): computing them imports ``vllm.v1.worker.utils``, about
100 ms a multi-process engine core would otherwise never spend. Where the module is loaded (a
worker) they are computed live and the memo is refreshed with them. The probe cases themselves
always run live.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from vllm_fix_core import Check, NotApplicable, ProbeReport
from vllm_fix_sync_load_zeroing.memo import WORKER_UTILS, CoverageFacts, coverage_facts
from vllm_fix_sync_load_zeroing.rule import Situation, excluded_blocks, filter_zeroing

MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_connector"
ZERO = (7, 8, 9, 90)
ATTENTION_READ = {"attn-import": ((7, 8), (90,))}  # block 9 is the locally recomputed tail
NO_ZEROER = "this vLLM has no KV-cache zeroing (KVBlockZeroer)"
PARAMS = {
    "remote_engine_id": "prefill-0",
    "remote_host": "127.0.0.1",
    "remote_handshake_port": 6301,
    "remote_notify_port": 61005,
}


@dataclass(frozen=True)
class Case:
    name: str
    read: bool = True
    consumer: bool = True
    hybrid: bool = True
    pending: tuple[tuple[tuple[int, ...], ...], ...] = ()


# The decision table as probe cases; `layout` is varied over them.
CASES = (
    Case("attn-import", pending=(((7, 8), (90,)),)),
    Case("two-reads", pending=(((7,), (90,)), ((8,), (91,)))),
    Case("state-only", pending=(((), (90,)),)),
    Case("nothing-pending"),
    # A producer never has READs pending (_reqs_need_recv stays empty on the prefill side).
    Case("producer", consumer=False),
    Case("attention-only-model", hybrid=False, pending=(((7, 8),),)),
    Case("write-mode", read=False, pending=(((7, 8), (90,)),)),
)


def require_feature() -> Any:
    """The moriio_connector module, or NotApplicable where the bug cannot happen."""
    mc = _hybrid_moriio_with_zeroing_list()
    loaded = sys.modules.get(WORKER_UTILS)
    zeroer = hasattr(loaded, "KVBlockZeroer") if loaded is not None else coverage_facts(attention_spec).zeroer
    if not zeroer:
        raise NotApplicable(NO_ZEROER)
    return mc


def _require_feature() -> tuple[Any, CoverageFacts]:
    """require_feature() and the coverage facts (from the memo where it is valid)."""
    mc = _hybrid_moriio_with_zeroing_list()
    facts = coverage_facts(attention_spec)
    if not facts.zeroer:
        raise NotApplicable(NO_ZEROER)
    return mc, facts


def _hybrid_moriio_with_zeroing_list() -> Any:
    import importlib

    # Cheapest first: the MoRIIO module is already imported when the ladder runs.
    mc = importlib.import_module(MODULE)
    init = getattr(mc.MoRIIOConnectorScheduler.__init__, "__code__", None)
    if init is None or "_has_mamba" not in init.co_names:
        raise NotApplicable("this vLLM's MoRIIO has no hybrid (Mamba) READ, so no synchronous hybrid load")
    output = importlib.import_module("vllm.v1.core.sched.output")
    fields = getattr(output.SchedulerOutput, "__dataclass_fields__", {})
    if "new_block_ids_to_zero" not in fields:
        raise NotApplicable("this vLLM has no KV-cache zeroing (SchedulerOutput.new_block_ids_to_zero)")
    return mc


def attention_spec() -> Any:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16)


def scheduler(mc: Any, case: Case, layout: str, spec: Any = None) -> Any:
    """A MoRIIOConnectorScheduler as vLLM's tests build one, with `case`'s READs pending."""
    sched = mc.MoRIIOConnectorScheduler.__new__(mc.MoRIIOConnectorScheduler)
    sched.mode = mc.MoRIIOMode.READ if case.read else mc.MoRIIOMode.WRITE
    sched.is_producer = not case.consumer
    sched._has_mamba = case.hybrid
    sched.vllm_config = SimpleNamespace(cache_config=SimpleNamespace(kv_cache_layout=layout))
    group = SimpleNamespace(kv_cache_spec=spec if spec is not None else attention_spec())
    sched.kv_cache_config = SimpleNamespace(transfer_groups=[group], kv_cache_layout=layout)
    sched._attn_group_ids = [0]
    sched._mamba_group_ids = [1] if case.hybrid else []
    sched.transfer_id_to_request_id = {}
    sched.request_id_to_transfer_id = {}
    sched._reqs_need_recv = {}
    sched._req_kv_params = {}
    sched._reqs_need_save = {}
    sched._reqs_need_send = {}
    sched._reqs_need_pending_save = {}
    sched._full_attn_group_idx = 0
    sched._full_attn_block_size = 16
    sched.block_size = 16
    for index, groups in enumerate(case.pending):
        rid = f"probe-{index}"
        params = {**PARAMS, "transfer_id": f"tx-{rid}", "remote_block_ids": [list(g) for g in groups]}
        request = SimpleNamespace(request_id=rid, kv_transfer_params=params, num_prompt_tokens=64)
        sched._reqs_need_recv[rid] = (request, [list(g) for g in groups])
        sched._req_kv_params[rid] = dict(params)
    return sched


def step_output(zero: tuple[int, ...] = ZERO) -> Any:
    """The fields of a SchedulerOutput that build_connector_meta reads."""
    return SimpleNamespace(
        new_block_ids_to_zero=list(zero),
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[]),
        scheduled_new_reqs=[],
        num_scheduled_tokens={},
        finished_req_ids=set(),
    )


def expected_zeroing(
    case: Case, layout: str, sched: Any, zero: tuple[int, ...] = ZERO, covered: bool | None = None
) -> list[int]:
    """What the rule leaves; `covered`: the layout's coverage for the probe's spec where known."""
    situation = Situation(
        case.read,
        case.consumer,
        case.hybrid,
        layout,
        sched.kv_cache_config.transfer_groups[0].kv_cache_spec,
        covered,
    )
    return filter_zeroing(zero, excluded_blocks(situation, sched._reqs_need_recv))


def observed_zeroing_meta(
    mc: Any, case: Case, layout: str, covered: bool | None = None
) -> tuple[list[int], list[int], list[str]]:
    """(zeroing list after build_connector_meta, what the rule leaves, READs in the metadata)."""
    sched = scheduler(mc, case, layout)
    expected = expected_zeroing(case, layout, sched, covered=covered)
    out = step_output()
    meta = sched.build_connector_meta(out)
    reads = sorted(getattr(meta, "reqs_to_recv", {}) or {})
    return list(out.new_block_ids_to_zero or []), expected, reads


def fork_connector(mc: Any, case: Case, layout: str) -> Any:
    """A MoRIIOConnector carrying the #59164 API, built with the attributes it reads."""
    from vllm.v1.kv_cache_layout import KVCacheLayout

    sched = scheduler(mc, case, layout)
    connector = mc.MoRIIOConnector.__new__(mc.MoRIIOConnector)
    connector.mode = sched.mode
    connector.kv_transfer_config = SimpleNamespace(
        is_kv_consumer=case.consumer, is_kv_producer=not case.consumer
    )
    cache_config = SimpleNamespace(
        get_resolved_kv_cache_layout=lambda: KVCacheLayout[layout], kv_cache_layout=layout
    )
    connector._vllm_config = SimpleNamespace(cache_config=cache_config)
    connector.connector_scheduler = sched
    connector.connector_worker = None
    return connector


def observed_zeroing_fork(
    mc: Any, case: Case, layout: str, covered: bool | None = None
) -> tuple[list[int], list[int]]:
    connector = fork_connector(mc, case, layout)
    expected = expected_zeroing(case, layout, connector.connector_scheduler, covered=covered)
    skipped = set(connector.get_sync_load_block_ids())
    return [b for b in ZERO if b not in skipped], expected


def has_fork_api(mc: Any) -> bool:
    return callable(getattr(mc.MoRIIOConnector, "get_sync_load_block_ids", None))


def cases(layouts: tuple[str, ...]) -> Iterator[tuple[Case, str]]:
    for layout in layouts:
        for case in CASES:
            yield case, layout


def probe() -> ProbeReport:
    mc, facts = _require_feature()
    layouts = facts.layouts
    if not layouts:
        raise RuntimeError("vLLM accepts no KV-cache layout for a hybrid model here")
    for layout in layouts:
        # The rule cannot be judged where the coverage cannot be computed (the zeroer's segment
        # table changed, say): "cannot check", rather than undoing vLLM's own exclusion.
        if layout in facts.errors:
            raise RuntimeError(
                f"cannot compute what zeroing and a READ touch under {layout}: {facts.errors[layout]}"
            )
    races: list[str] = []
    over: list[str] = []
    lost_reads: list[str] = []
    fork = has_fork_api(mc)
    for case, layout in cases(layouts):
        covered = facts.covered[layout]
        if fork:
            got, want = observed_zeroing_fork(mc, case, layout, covered)
        else:
            got, want, reads = observed_zeroing_meta(mc, case, layout, covered)
            if sorted(reads) != sorted(f"probe-{i}" for i in range(len(case.pending))):
                lost_reads.append(f"{case.name}/{layout}: metadata carries {reads}")
        if [b for b in got if b not in want]:
            races.append(f"{case.name}/{layout} zeroes {[b for b in got if b not in want]}")
        if [b for b in want if b not in got]:
            over.append(f"{case.name}/{layout} skips {[b for b in want if b not in got]}")
    api = "get_sync_load_block_ids" if fork else "build_connector_meta"
    return ProbeReport(
        (
            Check("zeroing-races-sync-read", bool(races), f"{api}: " + "; ".join(races[:4]) if races else ""),
            Check(
                "zeroing-skipped-for-unwritten-block",
                bool(over),
                f"{api}: " + "; ".join(over[:4]) if over else "",
            ),
            # Guard: the READs still reach the worker's metadata.
            Check("reads-reach-metadata", bool(lost_reads), "; ".join(lost_reads[:4]), guard=True),
        )
    )
