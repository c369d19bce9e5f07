"""The claim, for any kv_transfer_params, against an oracle written from the rule table.

The table (README, "The rule"), for a READ consumer with N prompt tokens and c computed:

1. no do_remote_prefill (None, {}, falsy flag): (0, False);
2. do_remote_prefill, remote_engine_id a non-empty str, remote_block_ids a non-empty list
   of non-empty per-group lists of int block ids (a flat non-empty list of int ids before
   0.30.0): (max(N-c-1, 0), False);
3. do_remote_prefill with anything else (malformed): (0, False).

The oracle below restates that table on its own (it shares no code with the fix), and
the strategy is built to hit every row boundary: missing keys, empty lists, empty
groups, flat-vs-grouped, non-int and bool ids anywhere in a group, non-str engine ids.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from vllm_fix_read_eligibility import FIX
from vllm_fix_read_eligibility.patch import block_layout
from vllm_fix_read_eligibility.probe import consumer, request
from vllm_fix_read_eligibility.rule import BlockLayout, malformed_reason
from vllm_fix_testing import applied


def is_block_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def oracle_can_read(params: dict[str, Any], grouped: bool) -> bool:
    """Row 2 of the table, restated."""
    engine = params.get("remote_engine_id")
    if not (isinstance(engine, str) and engine != ""):
        return False
    blocks = params.get("remote_block_ids")
    if not isinstance(blocks, (list, tuple)) or len(blocks) == 0:
        return False
    if grouped:
        return all(
            isinstance(g, (list, tuple)) and len(g) > 0 and all(is_block_id(b) for b in g) for g in blocks
        )
    return all(is_block_id(b) for b in blocks)


def oracle_claim(params: Any, n: int, c: int, grouped: bool) -> tuple[int, bool]:
    if not isinstance(params, dict) or not params.get("do_remote_prefill"):
        return 0, False
    if not oracle_can_read(params, grouped):
        return 0, False
    return max(n - c - 1, 0), False


FLAG = {"do_remote_prefill": True}
ENGINE = {"remote_engine_id": "p0"}
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 50), st.text(max_size=3), st.floats(allow_nan=False)
)
ids = st.integers(0, 1000)
group = st.one_of(
    st.lists(ids, max_size=4),
    st.lists(ids, min_size=1, max_size=4).flatmap(  # one bad id somewhere in a good group
        lambda g: st.tuples(st.integers(0, len(g)), scalars).map(lambda p: [*g[: p[0]], p[1], *g[p[0] :]])
    ),
    scalars,
)
block_ids = st.one_of(
    scalars,
    st.lists(ids, max_size=4),  # flat
    st.lists(group, max_size=3),  # per group
    st.lists(st.lists(ids, min_size=1, max_size=4), min_size=1, max_size=3),  # well-formed groups
)
params = st.one_of(
    st.none(),
    st.fixed_dictionaries(
        {},
        optional={
            "do_remote_prefill": st.one_of(st.booleans(), scalars),
            "remote_block_ids": block_ids,
            "remote_engine_id": st.one_of(st.just("p0"), st.text(max_size=4), scalars),
        },
    ),
)


@pytest.fixture
def patched() -> Iterator[None]:
    """The fix applied for the whole test (all examples), then reverted."""
    with applied(FIX):
        yield


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(p=params, n=st.integers(1, 64), computed=st.integers(0, 64))
@example(p={**FLAG, "remote_block_ids": [[]], **ENGINE}, n=32, computed=0)
@example(p={**FLAG, "remote_block_ids": [[1, 2], []], **ENGINE}, n=32, computed=0)
@example(p={**FLAG, "remote_block_ids": [[1, "x", 2]], **ENGINE}, n=32, computed=0)
@example(p={**FLAG, "remote_block_ids": [[1, True]], **ENGINE}, n=32, computed=0)
@example(p=FLAG, n=10, computed=0)
@pytest.mark.usefixtures("patched")
def test_patched_claim_matches_the_table(p: Any, n: int, computed: int) -> None:
    grouped = block_layout() is BlockLayout.PER_GROUP
    claim = consumer().get_num_new_matched_tokens(request(p, num_tokens=n), computed)
    assert tuple(claim) == oracle_claim(p, n, computed, grouped)


@settings(max_examples=500, deadline=None)
@given(
    p=st.fixed_dictionaries(
        {"do_remote_prefill": st.just(True)},
        optional={
            "remote_block_ids": block_ids,
            "remote_engine_id": st.one_of(st.just("p0"), scalars),
        },
    ),
    grouped=st.booleans(),
)
def test_rule_agrees_with_the_table_for_both_layouts(p: dict[str, Any], grouped: bool) -> None:
    """Both block-id layouts (the flat one only exists in vLLM before 0.30.0)."""
    layout = BlockLayout.PER_GROUP if grouped else BlockLayout.FLAT
    assert (malformed_reason(p, layout) is None) == oracle_can_read(p, grouped)
