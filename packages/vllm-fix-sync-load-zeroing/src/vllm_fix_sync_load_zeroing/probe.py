"""Does this vLLM zero KV blocks that a synchronous MoRIIO READ is writing in the same step?

Calls the installed MoRIIO entry point the exclusion lives in: the connector's
``get_sync_load_block_ids`` where this vLLM has that API (the #59164 lineage), otherwise
``MoRIIOConnectorScheduler.build_connector_meta`` on a scheduler built like vLLM's own MoRIIO
tests build one (``__new__`` plus the attributes it reads, each a vLLM object: its
``VllmConfig`` / ``CacheConfig`` built by ``vllm_fix_core.guest.build``, its ``KVCacheConfig``,
``KVCacheGroupSpec``, ``Request`` and ``SchedulerOutput`` by vLLM's own constructors). Each case
of the decision table is run under every KV-cache layout vLLM accepts for a hybrid model; where
this vLLM's hybrid READ carries several attention groups (0.34.0: its ``split_block_groups``
returns one list per attention group), the cases with two attention groups are run too.

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

Those coverage facts (the oracle's input, not vLLM's behaviour under test) are measured where
vLLM's worker utilities are loaded (a worker); elsewhere (a multi-process engine core, which
never imports ``vllm.v1.worker.utils``, nor does this fix) they come from the memo a worker
wrote, else from the specification (see :mod:`vllm_fix_sync_load_zeroing.memo`). The probe
cases themselves always run live. The probe imports no module the serving process has not
imported itself.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from vllm_fix_core import Check, NotApplicable, ProbeReport, original_of
from vllm_fix_core.guest import build
from vllm_fix_core.moriio_probe import scheduler_without_requests
from vllm_fix_sync_load_zeroing.facts import WORKER_UTILS, CoverageFacts, second_group_spec
from vllm_fix_sync_load_zeroing.memo import coverage_facts

MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_connector"
ZERO = (7, 8, 9, 90)
# With two attention groups: 10 is the second group's READ destination, 11 its recomputed tail.
ZERO_GROUPS = (7, 8, 9, 10, 11, 90)
NO_ZEROER = "this vLLM has no KV-cache zeroing (KVBlockZeroer)"
BLOCK_SIZE = 16
PROMPT_TOKENS = 64
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
    attention_groups: int = 1  # the model's attention groups, ahead of its Mamba group

    @property
    def zero(self) -> tuple[int, ...]:
        """The step's zeroing list before the connector: every block the case allocated."""
        return ZERO if self.attention_groups == 1 else ZERO_GROUPS


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
# Where the hybrid READ carries several attention groups (0.34.0): the metadata holds every
# attention group first, then the Mamba group; a group that is not prefix-cacheable (state) is
# read even on a full local hit of the others.
GROUP_CASES = (
    Case("two-attention-groups", pending=(((7, 8), (10,), (90,)),), attention_groups=2),
    Case("state-group-on-full-hit", pending=(((), (10,), (90,)),), attention_groups=2),
    Case("state-only-two-groups", pending=(((), (), (90,)),), attention_groups=2),
    Case("write-mode-two-groups", read=False, pending=(((7, 8), (10,), (90,)),), attention_groups=2),
)

# Spec §4.3: what the step zeroes of the case's zeroing list when the layout lets the READ
# rewrite every byte the zeroer clears. 7, 8 (and 10, in the second attention group) are the
# aligned attention READ destinations, 9 (11) the locally recomputed tail, 90 / 91 Mamba state
# slots (never excluded). Under a layout the READ does not fully rewrite, every case zeroes its
# whole list.
COVERED: dict[str, tuple[int, ...]] = {
    "attn-import": (9, 90),
    "two-reads": (9, 90),
    "state-only": ZERO,
    "nothing-pending": ZERO,
    "producer": ZERO,
    "attention-only-model": ZERO,
    "write-mode": ZERO,
    "two-attention-groups": (9, 11, 90),
    "state-group-on-full-hit": (7, 8, 9, 11, 90),
    "state-only-two-groups": ZERO_GROUPS,
    "write-mode-two-groups": ZERO_GROUPS,
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

    return FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=8, dtype=torch.float16)


def mamba_spec() -> Any:
    import torch
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(block_size=BLOCK_SIZE, shapes=((4, 8), (2, 8, 8)), dtypes=(torch.float16, torch.float16))


def vllm_config(layout: str | None) -> Any:
    """vLLM's VllmConfig (no __post_init__, no platform hook) whose CacheConfig records `layout`
    as the engine core resolved it."""
    from vllm.config import CacheConfig, VllmConfig

    cache = build(CacheConfig, block_size=BLOCK_SIZE, kv_cache_layout=layout)
    return build(VllmConfig, cache_config=cache)


def kv_cache_config(case: Case, layout: str | None, spec: Any = None) -> Any:
    """vLLM's KVCacheConfig of the case's model: its attention groups (the first of `spec`, the
    others sliding-window groups of the same page), then a Mamba group for a hybrid model."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    attention = spec if spec is not None else attention_spec()
    specs = [attention] + [second_group_spec(attention)] * (case.attention_groups - 1)
    groups = [
        KVCacheGroupSpec(layer_names=[f"model.layers.{index}.self_attn.attn"], kv_cache_spec=group_spec)
        for index, group_spec in enumerate(specs)
    ]
    if case.hybrid:
        groups.append(KVCacheGroupSpec(layer_names=["model.layers.9.mixer"], kv_cache_spec=mamba_spec()))
    config = KVCacheConfig(num_blocks=128, kv_cache_tensors=[], kv_cache_groups=groups)
    config.kv_cache_layout = layout  # as the engine core records the resolved layout
    return config


def request(rid: str, params: dict[str, Any]) -> Any:
    """vLLM's Request for a prompt of PROMPT_TOKENS tokens carrying `params` as its
    kv_transfer_params."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    req = Request(
        request_id=rid,
        prompt_token_ids=[0] * PROMPT_TOKENS,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
    )
    req.kv_transfer_params = params
    return req


def scheduler(mc: Any, case: Case, layout: str | None, spec: Any = None, config: Any = None) -> Any:
    """A MoRIIOConnectorScheduler as vLLM's tests build one, with `case`'s READs pending (its
    VllmConfig `config`, else vllm_config(layout))."""
    sched = scheduler_without_requests(mc)
    sched.mode = mc.MoRIIOMode.READ if case.read else mc.MoRIIOMode.WRITE
    sched.is_producer = not case.consumer
    sched._has_mamba = case.hybrid
    sched.vllm_config = config if config is not None else vllm_config(layout)
    sched.kv_cache_config = kv_cache_config(case, layout, spec)
    groups = case.attention_groups + (1 if case.hybrid else 0)
    # What __init__ derives from the KV cache config (the transfer groups' kinds, in order).
    sched._attn_group_ids = list(range(case.attention_groups))
    sched._mamba_group_ids = [case.attention_groups] if case.hybrid else []
    sched._attn_group_is_state = [False] * case.attention_groups
    sched._is_hma_required = False
    sched.blocks_per_sw = [0] * groups
    sched._num_ssm_scratch_blocks = 0
    sched._ssm_state_slots_are_positional = False
    sched._full_attn_group_idx = 0
    sched._full_attn_block_size = BLOCK_SIZE
    sched.block_size = BLOCK_SIZE
    for index, pending in enumerate(case.pending):
        rid = f"probe-{index}"
        params = {**PARAMS, "transfer_id": f"tx-{rid}", "remote_block_ids": [list(g) for g in pending]}
        sched._reqs_need_recv[rid] = (request(rid, params), [list(g) for g in pending])
        sched._req_kv_params[rid] = dict(params)
    return sched


def step_output(zero: tuple[int, ...] = ZERO) -> Any:
    """vLLM's SchedulerOutput of an empty step that zeroes `zero`."""
    from vllm.v1.core.sched.output import SchedulerOutput

    out = SchedulerOutput.make_empty()
    out.new_block_ids_to_zero = list(zero)
    return out


def attention_groups_read(mc: Any) -> int:
    """How many attention groups this vLLM's hybrid READ carries, asked of its own
    ``split_block_groups`` for a model with two: one list per attention group (0.34.0), or the
    first group's blocks alone (0.31.0 - 0.33.0, whose hybrid READ requires one)."""
    sched = scheduler(mc, Case("groups", attention_groups=2), None)
    attention, _ = sched.split_block_groups([[1], [2], [3]])
    if attention and all(isinstance(group, list) for group in attention):
        return len(attention)
    return 1


def expected_zeroing(case: Case, covered: bool) -> list[int]:
    """The table's answer for `case`, under a layout whose coverage is `covered`."""
    return list(COVERED[case.name] if covered else case.zero)


def _zeroing_after(
    method: Any, mc: Any, case: Case, layout: str, config: Any = None
) -> tuple[list[int], list[str]]:
    """(the step's zeroing list after `method` built the metadata, the READs it carries)."""
    sched = scheduler(mc, case, layout, config=config)
    out = step_output(case.zero)
    meta = method(sched, out)
    reads = sorted(getattr(meta, "reqs_to_recv", {}) or {})
    return list(out.new_block_ids_to_zero or []), reads


def observed_zeroing_meta(
    mc: Any, case: Case, layout: str, config: Any = None
) -> tuple[list[int], list[str]]:
    """What the installed build_connector_meta gives (through the instance, as vLLM calls it)."""
    return _zeroing_after(lambda sched, out: sched.build_connector_meta(out), mc, case, layout, config)


def vllm_own_zeroing(mc: Any, case: Case, layout: str, config: Any = None) -> list[int]:
    """The zeroing list vLLM's own build_connector_meta (the object before any fix) leaves."""
    original = original_of(mc.MoRIIOConnectorScheduler, "build_connector_meta")

    def own(sched: Any, out: Any) -> Any:
        return original.__get__(sched, type(sched))(out)

    return _zeroing_after(own, mc, case, layout, config)[0]


def fork_connector(mc: Any, case: Case, layout: str) -> Any:
    """A MoRIIOConnector carrying the #59164 API, built with the attributes it reads: vLLM's
    KVTransferConfig and VllmConfig (guest-built) and the probe's scheduler."""
    from vllm.config import KVTransferConfig

    sched = scheduler(mc, case, layout)
    connector = mc.MoRIIOConnector.__new__(mc.MoRIIOConnector)
    connector.mode = sched.mode
    connector.kv_transfer_config = build(
        KVTransferConfig,
        kv_connector="MoRIIOConnector",
        kv_role="kv_consumer" if case.consumer else "kv_producer",
    )
    connector._vllm_config = vllm_config(layout)
    connector.connector_scheduler = sched
    connector.connector_worker = None
    return connector


def observed_zeroing_fork(mc: Any, case: Case, layout: str) -> list[int]:
    connector = fork_connector(mc, case, layout)
    skipped = set(connector.get_sync_load_block_ids())
    return [b for b in case.zero if b not in skipped]


def has_fork_api(mc: Any) -> bool:
    return callable(getattr(mc.MoRIIOConnector, "get_sync_load_block_ids", None))


def cases(layouts: tuple[str, ...], attention_groups: int = 1) -> Iterator[tuple[Case, str]]:
    table = CASES + (GROUP_CASES if attention_groups > 1 else ())
    for layout in layouts:
        for case in table:
            yield case, layout


def _covered(facts: CoverageFacts, case: Case, layout: str) -> bool:
    return bool((facts.grouped if case.attention_groups > 1 else facts.covered)[layout])


def probe() -> ProbeReport:
    mc, facts = _require_feature()
    layouts = facts.layouts
    if not layouts:
        raise RuntimeError("vLLM accepts no KV-cache layout for a hybrid model here")
    groups = attention_groups_read(mc)
    for layout in layouts:
        # The rule cannot be judged where the coverage cannot be computed (the zeroer's segment
        # table changed, say): "cannot check", rather than undoing vLLM's own exclusion.
        if layout in facts.errors:
            raise RuntimeError(
                f"cannot compute what zeroing and a READ touch under {layout}: {facts.errors[layout]}"
            )
        if groups > 1 and layout in facts.grouped_errors:
            raise RuntimeError(
                f"cannot compute what zeroing and a READ of two attention groups touch under {layout}: "
                f"{facts.grouped_errors[layout]}"
            )
    races: list[str] = []
    over: list[str] = []
    lost_reads: list[str] = []
    departs: list[str] = []
    fork = has_fork_api(mc)
    # One VllmConfig per layout (the scheduler only reads it), not one per scheduler.
    configs = {layout: vllm_config(layout) for layout in layouts}
    own: dict[tuple[Case, str], list[int]] = {}
    if not fork:
        own = {
            (case, layout): vllm_own_zeroing(mc, case, layout, configs[layout])
            for case, layout in cases(layouts, groups)
        }
    # vLLM excludes READ destinations itself (0.32.0 on): its own answer is a second reference.
    own_exclusion = any(got != list(case.zero) for (case, _), got in own.items())
    for case, layout in cases(layouts, groups):
        want = expected_zeroing(case, _covered(facts, case, layout))
        if fork:
            got = observed_zeroing_fork(mc, case, layout)
        else:
            got, reads = observed_zeroing_meta(mc, case, layout, configs[layout])
            if sorted(reads) != sorted(f"probe-{i}" for i in range(len(case.pending))):
                lost_reads.append(f"{case.name}/{layout}: metadata carries {reads}")
            if own_exclusion and got != own[case, layout]:
                departs.append(f"{case.name}/{layout} zeroes {got}, vLLM's own exclusion {own[case, layout]}")
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
