"""The harm, on vLLM's real Scheduler with a real MoRIIO READ consumer connector.

What the engine must never do: count prompt tokens as computed (loaded from the prefill
instance) that no READ loads. For every request admitted in a step we compare what the
connector claimed (prompt tokens minus what the step schedules) with the READ vLLM
queued for it in that step's connector metadata, and keep stepping to show no READ
comes later either. The forward would then attend to KV blocks nothing wrote.

vLLM's own unit tests (tests/v1/kv_connector/unit/test_moriio_hma_scheduler.py) expect
``{"do_remote_prefill": True}`` alone to claim N-1 tokens; the bare-flag scenario below
is why this fix disagrees.

At the end, the property tests: patched code never raises where vLLM did not, for the
shapes vLLM's own types allow (``kv_transfer_params: dict[str, Any] | None``, None for
every optional field included, any ``num_computed_tokens``, connector schedulers with
and without the engine facts the fix reads), and a patched scheduler step never raises.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from packaging.version import Version

from vllm_fix_read_eligibility import FIX
from vllm_fix_read_eligibility.probe import PROMPT, consumer, request
from vllm_fix_testing import applied, real_request, vllm_version

BLOCK = 16


def admit(sched: Any, rid: str, params: Any, first_token: int, steps: int = 3) -> dict[str, Any]:
    """Admit one request, step the scheduler; what was claimed, and what READ was queued."""
    from vllm.v1.request import RequestStatus

    req = real_request(rid, PROMPT, kv_transfer_params=params, first_token=first_token)
    sched.add_request(req)
    out = sched.schedule()
    claimed = PROMPT - int(out.num_scheduled_tokens[rid])
    reads = [out.kv_connector_metadata.reqs_to_recv.get(rid)]
    for _ in range(steps - 1):  # nothing is fed back: any READ would be queued by now
        reads.append(sched.schedule().kv_connector_metadata.reqs_to_recv.get(rid))
    sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
    queued = [r for r in reads if r is not None]
    destinations = [b for r in queued for b in r.local_block_ids[0]]  # attention group
    return {"claimed": claimed, "reads": len(queued), "loaded_tokens": len(destinations) * BLOCK}


def assert_every_claimed_token_is_loaded(result: dict[str, Any]) -> None:
    assert result["claimed"] <= result["loaded_tokens"], (
        f"{result['claimed']} prompt tokens counted as loaded remotely, but the READs queued "
        f"load {result['loaded_tokens']} ({result['reads']} READs)"
    )


def test_bare_remote_prefill_flag_counts_tokens_it_never_loads(read_consumer_scheduler: Any) -> None:
    """``{"do_remote_prefill": True}`` without remote_block_ids / remote_engine_id (what
    vLLM's unit tests pass): vLLM claims 31 of 32 prompt tokens, schedules 1, and its own
    update_state_after_alloc queues no READ for them (it needs both keys), then clears the
    flag, so none ever comes. Patched: nothing claimed, all 32 computed locally."""
    unpatched = admit(read_consumer_scheduler, "bare-unpatched", {"do_remote_prefill": True}, 100)
    assert unpatched == {"claimed": PROMPT - 1, "reads": 0, "loaded_tokens": 0}
    with pytest.raises(AssertionError, match="31 prompt tokens counted as loaded"):
        assert_every_claimed_token_is_loaded(unpatched)
    with applied(FIX):
        patched = admit(read_consumer_scheduler, "bare-patched", {"do_remote_prefill": True}, 200)
    assert patched == {"claimed": 0, "reads": 0, "loaded_tokens": 0}
    assert_every_claimed_token_is_loaded(patched)


def test_plain_request_counts_tokens_it_never_loads_before_0_33(read_consumer_scheduler: Any) -> None:
    """A plain request on a READ decode instance (vLLM 0.32.0's own unit test expects the
    N-1 claim for it): 31 tokens counted as loaded by a READ nobody queues. 0.33.0 fixed it."""
    unpatched = admit(read_consumer_scheduler, "plain-unpatched", None, 300)
    if vllm_version() >= Version("0.33.0"):
        assert unpatched["claimed"] == 0
    else:
        assert unpatched == {"claimed": PROMPT - 1, "reads": 0, "loaded_tokens": 0}
    with applied(FIX):
        patched = admit(read_consumer_scheduler, "plain-patched", None, 400)
    assert patched == {"claimed": 0, "reads": 0, "loaded_tokens": 0}


def test_empty_block_groups_never_claim(new_read_consumer_scheduler: Callable[[], Any]) -> None:
    """``remote_block_ids=[[]]``: vLLM claims 31 tokens against zero remote blocks and its
    own update_state_after_alloc then fails the scheduler step (ValueError: more decode
    blocks than prefill blocks), which takes the engine core down. Patched: nothing
    claimed, nothing queued, the prompt is computed locally."""
    params = {"do_remote_prefill": True, "remote_block_ids": [[]], "remote_engine_id": "p0"}
    with pytest.raises(ValueError, match="exceed prefill block ids"):
        admit(new_read_consumer_scheduler(), "groups-unpatched", dict(params), 500)
    with applied(FIX):
        patched = admit(new_read_consumer_scheduler(), "groups-patched", dict(params), 600)
    assert patched == {"claimed": 0, "reads": 0, "loaded_tokens": 0}


@pytest.mark.parametrize("patched", [False, True], ids=["unpatched", "patched"])
def test_well_formed_remote_prefill_is_loaded_by_one_read(
    read_consumer_scheduler: Any, patched: bool
) -> None:
    """The control: a real remote prefill claims 31 tokens and one READ loads them."""
    params = {
        "do_remote_prefill": True,
        "remote_block_ids": [[5, 6]],
        "remote_engine_id": "p0",
        "transfer_id": "tx-ok",
        # where the READ goes (vLLM's sidecar fallback; the request id embeds no address)
        "remote_host": "127.0.0.1",
        "remote_handshake_port": 6301,
        "remote_notify_port": 61005,
    }
    if patched:
        with applied(FIX):
            result = admit(read_consumer_scheduler, "ok-patched", params, 700)
    else:
        result = admit(read_consumer_scheduler, "ok-unpatched", params, 800)
    assert result == {"claimed": PROMPT - 1, "reads": 1, "loaded_tokens": 2 * BLOCK}
    assert_every_claimed_token_is_loaded(result)


ROUTE = {
    "transfer_id": "tx-row",
    "remote_host": "127.0.0.1",
    "remote_handshake_port": 6301,
    "remote_notify_port": 61005,
}
GOOD = {"do_remote_prefill": True, "remote_block_ids": [[5, 6]], "remote_engine_id": "p0", **ROUTE}
# The rows of issue 22 (README rule table): params no READ can honour for this 32-token
# prompt on this one-group, 16-token-block engine.
ISSUE_ROWS: dict[str, dict[str, Any]] = {
    "one-block-for-two": {**GOOD, "remote_block_ids": [[5]]},
    "one-group-too-many": {**GOOD, "remote_block_ids": [[5, 6], [7, 8]]},
    "no-host-no-ports": {k: v for k, v in GOOD.items() if k not in ROUTE or k == "transfer_id"},
    "junk-port-host-5": {**GOOD, "remote_host": 5, "remote_handshake_port": "junk"},
    "id-2**70": {**GOOD, "remote_block_ids": [[5, 2**70]]},
    "negative-id": {**GOOD, "remote_block_ids": [[-1, 6]]},
    "duplicate-ids": {**GOOD, "remote_block_ids": [[5, 5]]},
    "flag-string-false": {**GOOD, "do_remote_prefill": "false"},
    "bool-port": {**GOOD, "remote_notify_port": True},
    "dp-size-local-none": {**GOOD, "remote_dp_size_local": None},  # add_new_req: int(None)
}


def admit_or_raise(sched: Any, rid: str, params: dict[str, Any]) -> dict[str, Any] | str:
    try:
        return admit(sched, rid, dict(params), 900, steps=2)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


@pytest.mark.parametrize("row", sorted(ISSUE_ROWS))
def test_issue_rows_unpatched_claim_or_raise(
    new_read_consumer_scheduler: Callable[[], Any], row: str
) -> None:
    """Negative control: unpatched vLLM either fails the scheduler step (every running
    request lost) or claims 31 tokens on these params (a READ of too few blocks, or of
    ids no prefill can own)."""
    result = admit_or_raise(new_read_consumer_scheduler(), f"u-{row}", ISSUE_ROWS[row])
    assert isinstance(result, str) or result["claimed"] == PROMPT - 1, result


@pytest.mark.parametrize("row", sorted(ISSUE_ROWS))
def test_issue_rows_patched_never_claim_and_never_raise(
    new_read_consumer_scheduler: Callable[[], Any], row: str, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    with applied(FIX), caplog.at_level(logging.WARNING, logger="vllm.fixes.read-eligibility"):
        result = admit_or_raise(new_read_consumer_scheduler(), f"p-{row}", ISSUE_ROWS[row])
    assert result == {"claimed": 0, "reads": 0, "loaded_tokens": 0}
    lines = [r.getMessage() for r in caplog.records if r.name == "vllm.fixes.read-eligibility"]
    assert len(lines) == 1 and f"request p-{row} " in lines[0], lines  # one WARNING, naming it
    field = {"flag-string-false": "do_remote_prefill", "dp-size-local-none": "remote_dp_size"}.get(row)
    named = ("remote_block_ids", "remote_host", "remote_handshake_port", "remote_notify_port")
    assert field in lines[0] if field else any(f in lines[0] for f in named), lines[0]


def test_warnings_are_rate_limited(
    new_read_consumer_scheduler: Callable[[], Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A flood of bad requests: at most the budget's WARNINGs; every request still computed
    locally, none raises."""
    import logging

    from vllm_fix_read_eligibility import patch

    sched = new_read_consumer_scheduler()
    with applied(FIX), caplog.at_level(logging.WARNING, logger="vllm.fixes.read-eligibility"):
        for i in range(patch.WARN_LIMIT.burst + 5):
            result = admit(sched, f"flood-{i}", dict(ISSUE_ROWS["one-block-for-two"]), 1000 + 40 * i, steps=1)
            assert result["claimed"] == 0
    lines = [r for r in caplog.records if r.name == "vllm.fixes.read-eligibility"]
    assert len(lines) == patch.WARN_LIMIT.burst and patch.WARN_LIMIT.suppressed == 5


anything = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.text(max_size=4), st.floats()),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=3), inner, max_size=2)
    ),
    max_leaves=6,
)
KEYS = [
    "do_remote_prefill",
    "remote_block_ids",
    "remote_engine_id",
    "transfer_id",
    "remote_host",
    "remote_handshake_port",
    "remote_notify_port",
    "remote_hosts",
    "remote_dp_rank",
    "remote_dp_size",
    "remote_dp_size_local",
    "remote_tp_size",
    "tp_size",
]
params = st.one_of(
    st.none(),
    st.dictionaries(st.sampled_from(KEYS), anything, max_size=6),
    st.fixed_dictionaries({k: st.just(v) for k, v in GOOD.items()}).flatmap(
        lambda good: st.dictionaries(st.sampled_from(KEYS), st.one_of(st.none(), anything), max_size=3).map(
            lambda over: {**good, **over}
        )
    ),
)


def bare_consumer() -> Any:
    """Only what vLLM's own body reads: the fix's engine facts are missing."""
    sched = consumer()
    del sched.kv_cache_config
    del sched.block_size
    return sched


def outcome(make: Callable[[], Any], p: Any, n: int, c: int) -> str:
    try:
        make().get_num_new_matched_tokens(request(p, num_tokens=n), c)
    except Exception as exc:
        return type(exc).__name__
    return "ok"


@settings(max_examples=300, deadline=None)
@given(p=params, n=st.integers(1, 80), c=st.integers(0, 100), bare=st.booleans())
def test_patched_method_never_raises_where_vllm_did_not(p: Any, n: int, c: int, bare: bool) -> None:
    make = bare_consumer if bare else consumer
    try:
        request(p, num_tokens=n)
    except Exception:  # vLLM's SamplingParams refuses these params before any scheduler sees them
        return
    before = outcome(make, p, n, c)
    with applied(FIX):
        after = outcome(make, p, n, c)
    assert after == "ok" or after == before, (before, after)


def hashable_transfer_id(p: Any) -> bool:
    # An unhashable transfer_id fails vLLM's update_state_after_alloc (map_request_id) for
    # any request, remote claim or not: outside this fix (it claims nothing for it).
    return not isinstance(p, dict) or not isinstance(p.get("transfer_id"), (list, dict))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(p=params.filter(hashable_transfer_id))
def test_patched_scheduler_step_never_raises(new_read_consumer_scheduler: Callable[[], Any], p: Any) -> None:
    """Through vLLM's real Scheduler: no exception out of schedule(), and every claimed
    token is loaded by the READ queued for it."""
    with applied(FIX):
        result = admit(new_read_consumer_scheduler(), "prop", p, 100, steps=2)
    assert result["claimed"] in (0, 31)
    assert result["claimed"] <= result["loaded_tokens"], result
