"""moriio-read.md §1 on real vLLM: negative controls, the fix, and what must not change."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
from packaging.version import Version

from vllm_fix_read_eligibility import FIX
from vllm_fix_read_eligibility.probe import MALFORMED, PLAIN, WELL_FORMED, consumer, matched
from vllm_fix_testing import applied, real_request, vllm_version

PROMPT = 32
V032 = vllm_version() < Version("0.33.0")


@pytest.mark.parametrize("case", sorted(PLAIN))
def test_plain_request_claims_remote_kv_on_0_32_only(case: str) -> None:
    """Negative control: 0.32.0 claims N-1 tokens for a request that never asked for them."""
    expected_unpatched = (PROMPT - 1, False) if V032 else (0, False)
    assert matched(consumer(), PLAIN[case]) == expected_unpatched
    with applied(FIX):
        assert matched(consumer(), PLAIN[case]) == (0, False)


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_remote_prefill_claims_remote_kv_on_both(case: str) -> None:
    """Negative control on both releases: do_remote_prefill without usable params claims N-1."""
    assert matched(consumer(), MALFORMED[case]) == (PROMPT - 1, False)
    with applied(FIX):
        assert matched(consumer(), MALFORMED[case]) == (0, False)


def test_malformed_params_warn_once_naming_the_request(caplog: pytest.LogCaptureFixture) -> None:
    sched = consumer()
    params = dict(MALFORMED["string-block-ids"])
    req = SimpleNamespace(request_id="req-malformed-7", num_prompt_tokens=PROMPT, kv_transfer_params=params)
    with applied(FIX), caplog.at_level(logging.WARNING, logger="vllm.fixes.read-eligibility"):
        first = sched.get_num_new_matched_tokens(req, 0)
        second = sched.get_num_new_matched_tokens(req, 0)
    assert first == second == (0, False)
    warnings = [
        r for r in caplog.records if r.levelno == logging.WARNING and "req-malformed-7" in r.getMessage()
    ]
    assert len(warnings) == 1
    assert "remote_block_ids is a str" in warnings[0].getMessage()
    assert params["do_remote_prefill"] is False  # nothing will be queued for it


def test_well_formed_remote_prefill_still_claims_n_minus_1() -> None:
    for patched in (False, True):
        if patched:
            with applied(FIX):
                assert matched(consumer(), WELL_FORMED) == (PROMPT - 1, False)
        else:
            assert matched(consumer(), WELL_FORMED) == (PROMPT - 1, False)


@pytest.mark.parametrize(
    "params", [None, {}, WELL_FORMED, MALFORMED["no-block-ids"], {"do_remote_prefill": False}]
)
@pytest.mark.parametrize("side", ["producer-read", "consumer-write", "producer-write"])
def test_write_mode_and_producer_unchanged(side: str, params: Any) -> None:
    def sched() -> Any:
        return consumer(read=side.endswith("read"), producer=side.startswith("producer"))

    def call() -> Any:
        p = None if params is None else dict(params)
        return sched().get_num_new_matched_tokens(
            SimpleNamespace(request_id="r", num_prompt_tokens=PROMPT, kv_transfer_params=p), 0
        )

    before = call()
    with applied(FIX):
        assert call() == before


def test_lifecycle_flag_cleared_then_claims_nothing(read_consumer_scheduler: Any) -> None:
    """§1.4 lifecycle, on the real scheduler's real MoRIIO connector: the first query claims
    N-1 and queues exactly one READ, which clears the flag; a second query (preempted and
    resumed, or retried) must claim nothing. 0.32.0 claims N-1 again."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks

    connector = read_consumer_scheduler.connector.connector_scheduler
    manager = read_consumer_scheduler.kv_cache_manager

    def run(rid: str) -> tuple[Any, Any, bool]:
        params = {
            "do_remote_prefill": True,
            "remote_block_ids": [[10, 11]],
            "remote_engine_id": "p0",
            "transfer_id": f"tx-{rid}",
        }
        req = real_request(rid, PROMPT, kv_transfer_params=params)
        first = connector.get_num_new_matched_tokens(req, 0)
        blocks = (
            manager.create_kv_cache_blocks(([],))
            if hasattr(manager, "create_kv_cache_blocks")
            else KVCacheBlocks(([],))
        )
        connector.update_state_after_alloc(req, blocks, first[0])
        queued = rid in connector._reqs_need_recv
        connector._reqs_need_recv.pop(rid, None)
        second = connector.get_num_new_matched_tokens(req, 0)
        return first, second, queued

    first, second, queued = run("life-unpatched")
    assert first == (PROMPT - 1, False) and queued
    assert second == ((PROMPT - 1, False) if V032 else (0, False))
    with applied(FIX):
        first, second, queued = run("life-patched")
    assert first == (PROMPT - 1, False) and queued
    assert second == (0, False)


def test_real_scheduler_plain_request_on_read_consumer(read_consumer_scheduler: Any) -> None:
    """The symptom as the engine sees it: a plain request on a READ decode instance.

    Unpatched 0.32.0 schedules only the last prompt token (31 counted as loaded
    remotely, synchronously, from a READ nobody queued); 0.33.0 schedules all 32.
    """

    def schedule_plain(rid: str, first_token: int) -> int:
        sched = read_consumer_scheduler
        req = real_request(rid, PROMPT, first_token=first_token)
        sched.add_request(req)
        out = sched.schedule()
        n = out.num_scheduled_tokens[rid]
        sched.finish_requests([rid], _finished_status())
        return int(n)

    assert schedule_plain("plain-unpatched", 100) == (1 if V032 else PROMPT)
    with applied(FIX):
        assert schedule_plain("plain-patched", 200) == PROMPT


def test_real_scheduler_malformed_request_recomputes_locally(read_consumer_scheduler: Any) -> None:
    """Residual (both releases): do_remote_prefill without block ids is scheduled in full patched;
    unpatched it computes only the last token on KV nobody reads in."""

    def schedule(rid: str, first_token: int) -> tuple[int, bool]:
        sched = read_consumer_scheduler
        params = dict(MALFORMED["no-block-ids"])
        req = real_request(rid, PROMPT, kv_transfer_params=params, first_token=first_token)
        sched.add_request(req)
        out = sched.schedule()
        queued = rid in sched.connector.connector_scheduler._reqs_need_recv
        sched.finish_requests([rid], _finished_status())
        return int(out.num_scheduled_tokens[rid]), queued

    with applied(FIX):
        assert schedule("malformed-patched", 500) == (PROMPT, False)
    n, _ = schedule("malformed-unpatched", 600)
    assert n == 1  # negative control: only the last token is computed locally


def _finished_status() -> Any:
    from vllm.v1.request import RequestStatus

    return RequestStatus.FINISHED_ABORTED
