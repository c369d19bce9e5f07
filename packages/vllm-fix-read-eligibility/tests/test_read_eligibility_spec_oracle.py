"""The claim, for any kv_transfer_params, against an oracle written from the rule table.

The table (README, "The rule"), for a READ consumer with N prompt tokens, c computed,
on an engine reading G KV cache groups of B-token blocks (the probe's engine: G=1, B=16):

1. no do_remote_prefill (None, {}, falsy flag): (0, False);
2. do_remote_prefill exactly True, remote_engine_id a non-empty str, remote_block_ids a
   list of exactly G non-empty lists (a flat non-empty list before 0.30.0) of int ids
   (never bool), each 0 <= id <= 2**63-1, no id twice in a list except 0, each list at
   least ceil((N-1)/B) ids long when N-c-1 > 0; the READ routable: remote_host a
   non-empty str, remote_handshake_port and remote_notify_port an int (not bool) or a
   decimal str, with value 1..65535; remote_dp_rank absent or an int >= 0, remote_dp_size
   absent or an int >= 1; transfer_id absent/None or a non-empty str:
   (max(N-c-1, 0), False);
3. do_remote_prefill truthy with anything else: (0, False).

The oracle below restates that table on its own (it shares no code with the fix), and
the strategy is built to hit every row boundary.
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
from vllm_fix_read_eligibility.rule import BlockLayout
from vllm_fix_testing import applied

B = 16  # the probe engine's block size; one KV cache group


def is_block_id(x: Any) -> bool:
    return type(x) is int and 0 <= x <= 2**63 - 1


def good_list(ids: Any, n: int, c: int) -> bool:
    if not isinstance(ids, (list, tuple)) or len(ids) == 0 or not all(is_block_id(b) for b in ids):
        return False
    non_null = [b for b in ids if b != 0]
    if len(set(non_null)) != len(non_null):
        return False
    claimed = max(n - c - 1, 0)
    return claimed == 0 or len(ids) * B >= n - 1


def is_port(x: Any) -> bool:
    if type(x) is int:
        return 1 <= x <= 65535
    if type(x) is str:
        try:
            return 1 <= int(x) <= 65535
        except ValueError:
            return False
    return False


def oracle_can_read(params: dict[str, Any], n: int, c: int, grouped: bool) -> bool:
    """Row 2 of the table, restated."""
    if params.get("do_remote_prefill") is not True:
        return False
    engine = params.get("remote_engine_id")
    if not (isinstance(engine, str) and engine != ""):
        return False
    blocks = params.get("remote_block_ids")
    if grouped:
        if not isinstance(blocks, (list, tuple)) or len(blocks) != 1:
            return False
        if not all(good_list(g, n, c) for g in blocks):
            return False
    elif not good_list(blocks, n, c):
        return False
    host = params.get("remote_host")
    if not (isinstance(host, str) and host):
        return False
    if not (is_port(params.get("remote_handshake_port")) and is_port(params.get("remote_notify_port"))):
        return False
    for name, least in (("remote_dp_rank", 0), ("remote_dp_size", 1)):
        if name in params and not (type(params[name]) is int and params[name] >= least):
            return False
    tx = params.get("transfer_id")
    return tx is None or (isinstance(tx, str) and tx != "")


def oracle_claim(params: Any, n: int, c: int, grouped: bool) -> tuple[int, bool]:
    if not isinstance(params, dict) or not params.get("do_remote_prefill"):
        return 0, False
    if not oracle_can_read(params, n, c, grouped):
        return 0, False
    return max(n - c - 1, 0), False


ROUTE = {"remote_host": "10.0.0.1", "remote_handshake_port": 6301, "remote_notify_port": 61005}
GOOD = {"do_remote_prefill": True, "remote_engine_id": "p0", "transfer_id": "tx", **ROUTE}
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 50), st.text(max_size=3), st.floats(allow_nan=False)
)
ids = st.one_of(st.integers(0, 40), st.sampled_from([0, -1, 2**63 - 1, 2**63]))
group = st.one_of(
    st.lists(ids, max_size=5),
    st.lists(st.integers(1, 1000), min_size=1, max_size=5, unique=True),  # well-formed
    st.lists(ids, min_size=1, max_size=4).flatmap(  # one bad id somewhere in a group
        lambda g: st.tuples(st.integers(0, len(g)), scalars).map(lambda p: [*g[: p[0]], p[1], *g[p[0] :]])
    ),
    scalars,
)
block_ids = st.one_of(
    scalars,
    st.lists(ids, max_size=5),  # flat
    st.lists(group, max_size=3),  # per group
    st.lists(st.lists(st.integers(1, 1000), min_size=1, max_size=5, unique=True), min_size=1, max_size=2),
)
port = st.one_of(
    st.sampled_from([6301, "6301", 0, 65535, 65536, -1, True, "junk", 6301.0, None]), st.integers(-2, 70000)
)
params = st.one_of(
    st.none(),
    st.fixed_dictionaries(
        {},
        optional={
            "do_remote_prefill": st.one_of(st.just(True), st.booleans(), scalars),
            "remote_block_ids": block_ids,
            "remote_engine_id": st.one_of(st.just("p0"), st.text(max_size=4), scalars),
            "transfer_id": st.one_of(st.just("tx"), scalars),
            "remote_host": st.one_of(st.just("10.0.0.1"), scalars),
            "remote_handshake_port": port,
            "remote_notify_port": port,
            "remote_dp_rank": st.one_of(st.integers(-1, 2), scalars),
            "remote_dp_size": st.one_of(st.integers(0, 2), scalars),
        },
    ),
    # mostly routable, to reach the block-id rows
    st.fixed_dictionaries(
        {k: st.just(v) for k, v in GOOD.items() if k != "remote_handshake_port"},
        optional={"remote_block_ids": block_ids, "remote_handshake_port": st.one_of(st.just(6301), port)},
    ),
)


@pytest.fixture
def patched() -> Iterator[None]:
    """The fix applied for the whole test (all examples), then reverted."""
    with applied(FIX):
        yield


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(p=params, n=st.integers(1, 64), computed=st.integers(0, 64))
@example(p={**GOOD, "remote_block_ids": [[]]}, n=32, computed=0)
@example(p={**GOOD, "remote_block_ids": [[5]]}, n=32, computed=0)  # too few blocks
@example(p={**GOOD, "remote_block_ids": [[5]]}, n=17, computed=0)  # 16 claimed: one block is enough
@example(p={**GOOD, "remote_block_ids": [[5]]}, n=32, computed=31)  # nothing claimed
@example(p={**GOOD, "remote_block_ids": [[5, 6], [7, 8]]}, n=32, computed=0)  # one group too many
@example(p={**GOOD, "remote_block_ids": [[5, 5]]}, n=32, computed=0)
@example(p={**GOOD, "remote_block_ids": [[0, 0]]}, n=32, computed=0)  # null blocks may repeat
@example(p={**GOOD, "remote_block_ids": [[-1, 6]]}, n=32, computed=0)
@example(p={**GOOD, "remote_block_ids": [[5, 2**63]]}, n=32, computed=0)
@example(p={**GOOD, "remote_block_ids": [[1, True]]}, n=32, computed=0)
@example(p={**GOOD, "do_remote_prefill": "false", "remote_block_ids": [[5, 6]]}, n=32, computed=0)
@example(
    p={**GOOD, "remote_host": 5, "remote_handshake_port": "junk", "remote_block_ids": [[5, 6]]},
    n=32,
    computed=0,
)
@example(p={**GOOD, "remote_notify_port": True, "remote_block_ids": [[5, 6]]}, n=32, computed=0)
@example(p={**GOOD, "remote_handshake_port": "6301", "remote_block_ids": [[5, 6]]}, n=32, computed=0)
@example(
    p={"do_remote_prefill": True, "remote_engine_id": "p0", "remote_block_ids": [[5, 6]]}, n=32, computed=0
)
@pytest.mark.usefixtures("patched")
def test_patched_claim_matches_the_table(p: Any, n: int, computed: int) -> None:
    grouped = block_layout() is BlockLayout.PER_GROUP
    claim = consumer().get_num_new_matched_tokens(request(p, num_tokens=n), computed)
    assert tuple(claim) == oracle_claim(p, n, computed, grouped)
