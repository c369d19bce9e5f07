"""The exclusion rule: which newly allocated blocks a step must not zero.

Remove block b from ``new_block_ids_to_zero`` in step s iff

1. the connector is a MoRIIO READ-mode KV consumer;
2. the model is hybrid (attention + Mamba): MoRIIO then fails the step closed on any READ
   error, so an excluded block is never consumed unwritten;
3. b is an aligned attention destination of a READ drained into step s's metadata: in one of
   its attention groups, which the hybrid READ metadata holds first (``block_ids[0]`` where
   MoRIIO's READ carries one attention group, ``block_ids[:len(_attn_group_ids)]`` where it
   carries several, vLLM 0.34.0; a group that is not prefix-cacheable is read, and so
   excluded, even on a full local hit of the others): never the locally recomputed tail, never
   Mamba state blocks, nothing for state-only loads;
4. under the KV-cache layout in use, the READ rewrites every byte the zeroer zeroes for b, for
   every attention group (computed by :mod:`vllm_fix_sync_load_zeroing.coverage`, never
   listed).

Every input that cannot be read keeps zeroing: zeroing too much costs a kernel launch,
zeroing too little loses KV.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from itertools import filterfalse
from typing import Any

from vllm_fix_sync_load_zeroing.coverage import read_rewrites_zeroed_bytes


@dataclass(frozen=True)
class Situation:
    """What the rule needs to know about the connector, besides the pending READs."""

    read: bool
    consumer: bool
    hybrid: bool
    layout: Any  # the resolved KV-cache layout name
    spec: Any  # the first attention group's KVCacheSpec
    # Condition 4 when the caller already knows it; None: computed from vLLM for `layout` and
    # the specs.
    covered: bool | None = None
    more_specs: tuple[Any, ...] = ()  # the other attention groups' specs, in group order

    @property
    def attention_groups(self) -> int:
        """How many groups, at the front of each READ's block ids, are attention groups."""
        return 1 + len(self.more_specs)

    @property
    def may_exclude(self) -> bool:
        """Conditions 1, 2 and 4: whether any READ destination may skip zeroing."""
        return (
            self.read is True
            and self.consumer is True
            and self.hybrid is True
            and (
                read_rewrites_zeroed_bytes(self.layout, self.spec, more_specs=self.more_specs)
                if self.covered is None
                else self.covered is True
            )
        )


def _attention_destinations(entry: Any, groups: int = 1) -> list[Any] | None:
    """Condition 3 for one ``_reqs_need_recv`` entry: (request, per-group block ids), the
    `groups` attention groups first. None for a malformed entry (its blocks stay zeroed); a
    malformed group of a well-formed entry is skipped."""
    try:
        attention = [entry[1][index] for index in range(groups)]
    except (TypeError, IndexError, KeyError):
        return None
    found: list[Any] = []
    for group in attention:
        if isinstance(group, (list, tuple)):
            found.extend(group)
    return found


def read_destinations(pending: Mapping[Any, Any], groups: int = 1) -> list[int]:
    """The aligned attention destinations of the pending READs (MoRIIO's ``_reqs_need_recv``),
    in order, over the `groups` attention groups of each."""
    found: list[int] = []
    for entry in pending.values():
        attention = _attention_destinations(entry, groups)
        if attention:
            found.extend(attention)
    return found


def excluded_blocks(situation: Situation, pending: Mapping[Any, Any]) -> frozenset[int] | set[int]:
    """The blocks to remove from this step's zeroing list.

    Runs once per scheduler step over every pending READ destination: set operations only (C
    speed), no per-block Python code. A destination that is not an int matches no block id."""
    if not pending or not situation.may_exclude:
        return frozenset()
    groups = situation.attention_groups
    try:  # the well-formed case in one pass at C speed (an id that is not an int matches nothing)
        if groups == 1:
            return set().union(*[entry[1][0] for entry in pending.values()])
        return set().union(*[group for entry in pending.values() for group in entry[1][:groups]])
    except (TypeError, IndexError, KeyError):
        pass  # some entry is malformed: skip it, keep the others
    found: set[int] = set()
    for entry in pending.values():
        destinations = _attention_destinations(entry, groups)
        if destinations:
            found.update(destinations)
    return found


def filter_zeroing(blocks: Iterable[int], excluded: frozenset[int] | set[int]) -> list[int]:
    if not excluded:
        return list(blocks)
    return list(filterfalse(excluded.__contains__, blocks))


def scheduler_situation(sched: Any, read_mode: Any) -> Situation:
    """The situation of a MoRIIOConnectorScheduler (the layout as the engine core resolved it)."""
    # The engine core records the resolved layout on the KV cache config it hands the connector
    # (and on the cache config); None means unresolved, which keeps zeroing.
    layout = getattr(getattr(sched, "kv_cache_config", None), "kv_cache_layout", None)
    if layout is None:
        cache_config = getattr(getattr(sched, "vllm_config", None), "cache_config", None)
        layout = getattr(cache_config, "kv_cache_layout", None)
    specs = attention_specs(sched)
    return Situation(
        read=getattr(sched, "mode", None) is read_mode,
        consumer=getattr(sched, "is_producer", True) is False,
        hybrid=getattr(sched, "_has_mamba", False) is True,
        layout=layout,
        spec=specs[0],
        more_specs=specs[1:],
    )


def attention_spec(sched: Any) -> Any:
    """The spec of the first transferable attention group of a hybrid READ consumer, or None."""
    return attention_specs(sched)[0]


def attention_specs(sched: Any) -> tuple[Any, ...]:
    """The specs of the transferable attention groups, in the order the hybrid READ metadata
    holds their block ids (``_attn_group_ids``; before vLLM 0.34.0 MoRIIO's scheduler refuses a
    hybrid READ with more than one). (None,) where they cannot be read (nothing is then
    excluded)."""
    try:
        group_ids = list(sched._attn_group_ids)
        groups = sched.kv_cache_config.transfer_groups
        specs = tuple(groups[group_id].kv_cache_spec for group_id in group_ids)
    except (AttributeError, IndexError, KeyError, TypeError):
        return (None,)
    return specs or (None,)
