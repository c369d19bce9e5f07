"""Does this vLLM zero KV blocks that a synchronous MoRIIO READ is writing in the same step?

Calls the installed MoRIIO entry point the exclusion lives in: the connector's
``get_sync_load_block_ids`` where this vLLM has that API (the #59164 lineage), otherwise
``MoRIIOConnectorScheduler.build_connector_meta`` on a scheduler built like vLLM's own MoRIIO
tests build one (``__new__`` plus the attributes it reads). Each case of the decision table is
run under every KV-cache layout vLLM accepts for a hybrid model.

The expected answer never comes from the fix's code (``rule``, ``coverage``, ``patch``):

* the decision table of the bug's specification (§4.3), written out below (``COVERED``): what
  a step zeroes of ``ZERO`` when the layout lets the READ rewrite every byte the zeroer clears;
  ``ZERO`` unchanged otherwise;
* whether the layout does is measured on vLLM's own objects by
  :mod:`vllm_fix_sync_load_zeroing.oracle` (vLLM's view builder, the segment table of vLLM's
  ``KVBlockZeroer``, the READ offsets of MoRIIO's worker);
* where vLLM's own ``build_connector_meta`` excludes READ destinations itself (0.32.0 on), its
  result is a second reference: the installed method, called on an identical scheduler, must
  give what vLLM's original gives (a guard: a layer that changes vLLM's own exclusion is
  "failed to fix", never "fixed").

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

from vllm_fix_core import Check, NotApplicable, ProbeReport, original_of
from vllm_fix_core.moriio_probe import scheduler_without_requests
from vllm_fix_sync_load_zeroing.facts import WORKER_UTILS, CoverageFacts
from vllm_fix_sync_load_zeroing.memo import coverage_facts

MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_connector"
ZERO = (7, 8, 9, 90)
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

# Spec §4.3: what the step zeroes of ZERO = [7, 8, 9, 90] when the layout lets the READ rewrite
# every byte the zeroer clears. 7 and 8 are the aligned attention READ destinations, 9 the
# locally recomputed tail, 90 / 91 Mamba state slots (never excluded). Under a layout the READ
# does not fully rewrite, every case zeroes ZERO.
COVERED: dict[str, tuple[int, ...]] = {
    "attn-import": (9, 90),
    "two-reads": (9, 90),
    "state-only": ZERO,
    "nothing-pending": ZERO,
    "producer": ZERO,
    "attention-only-model": ZERO,
    "write-mode": ZERO,
}


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
    sched = scheduler_without_requests(mc)
    sched.mode = mc.MoRIIOMode.READ if case.read else mc.MoRIIOMode.WRITE
    sched.is_producer = not case.consumer
    sched._has_mamba = case.hybrid
    sched.vllm_config = SimpleNamespace(cache_config=SimpleNamespace(kv_cache_layout=layout))
    group = SimpleNamespace(kv_cache_spec=spec if spec is not None else attention_spec())
    sched.kv_cache_config = SimpleNamespace(transfer_groups=[group], kv_cache_layout=layout)
    sched._attn_group_ids = [0]
    sched._mamba_group_ids = [1] if case.hybrid else []
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


def expected_zeroing(case: Case, covered: bool) -> list[int]:
    """The table's answer for `case`, under a layout whose coverage is `covered`."""
    return list(COVERED[case.name] if covered else ZERO)


def _zeroing_after(method: Any, mc: Any, case: Case, layout: str) -> tuple[list[int], list[str]]:
    """(the step's zeroing list after `method` built the metadata, the READs it carries)."""
    sched = scheduler(mc, case, layout)
    out = step_output()
    meta = method(sched, out)
    reads = sorted(getattr(meta, "reqs_to_recv", {}) or {})
    return list(out.new_block_ids_to_zero or []), reads


def observed_zeroing_meta(mc: Any, case: Case, layout: str) -> tuple[list[int], list[str]]:
    """What the installed build_connector_meta gives (through the instance, as vLLM calls it)."""
    return _zeroing_after(lambda sched, out: sched.build_connector_meta(out), mc, case, layout)


def vllm_own_zeroing(mc: Any, case: Case, layout: str) -> list[int]:
    """The zeroing list vLLM's own build_connector_meta (the object before any fix) leaves."""
    original = original_of(mc.MoRIIOConnectorScheduler, "build_connector_meta")
    return _zeroing_after(lambda sched, out: original.__get__(sched, type(sched))(out), mc, case, layout)[0]


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


def observed_zeroing_fork(mc: Any, case: Case, layout: str) -> list[int]:
    connector = fork_connector(mc, case, layout)
    skipped = set(connector.get_sync_load_block_ids())
    return [b for b in ZERO if b not in skipped]


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
    departs: list[str] = []
    fork = has_fork_api(mc)
    own: dict[tuple[str, str], list[int]] = {}
    if not fork:
        own = {(case.name, layout): vllm_own_zeroing(mc, case, layout) for case, layout in cases(layouts)}
    # vLLM excludes READ destinations itself (0.32.0 on): its own answer is a second reference.
    own_exclusion = any(got != list(ZERO) for got in own.values())
    for case, layout in cases(layouts):
        want = expected_zeroing(case, facts.covered[layout])
        if fork:
            got = observed_zeroing_fork(mc, case, layout)
        else:
            got, reads = observed_zeroing_meta(mc, case, layout)
            if sorted(reads) != sorted(f"probe-{i}" for i in range(len(case.pending))):
                lost_reads.append(f"{case.name}/{layout}: metadata carries {reads}")
            if own_exclusion and got != own[case.name, layout]:
                departs.append(
                    f"{case.name}/{layout} zeroes {got}, vLLM's own exclusion {own[case.name, layout]}"
                )
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
            # Guard: where vLLM excludes READ destinations itself, what is installed gives its answer.
            Check("vllm-own-exclusion-kept", bool(departs), "; ".join(departs[:4]), guard=True),
        )
    )
