"""The READ consumer's claim on real vLLM: negative controls, the fix, what must not change.

Requests are real vLLM requests (vLLM's own constructor); the connector scheduler is
MoRIIO's own class. On the real Scheduler further down, the harm is shown the way the
engine meets it: tokens counted as computed that no READ ever loads.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from packaging.version import Version

from vllm_fix_read_eligibility import FIX
from vllm_fix_read_eligibility.patch import block_layout
from vllm_fix_read_eligibility.probe import (
    PLAIN,
    PROMPT,
    consumer,
    malformed,
    matched,
    request,
    row_id,
    well_formed,
)
from vllm_fix_testing import applied, vllm_version

PLAIN_FIXED_UPSTREAM = vllm_version() >= Version("0.33.0")
MALFORMED = malformed(block_layout())


@pytest.mark.parametrize("case", sorted(PLAIN))
def test_plain_request_claims_remote_kv_until_0_33(case: str) -> None:
    """Negative control: before 0.33.0 a READ consumer claims N-1 tokens for a request that
    never asked for a remote prefill (plain, preempted-and-resumed, retried)."""
    expected_unpatched = (0, False) if PLAIN_FIXED_UPSTREAM else (PROMPT - 1, False)
    assert matched(consumer(), PLAIN[case]) == expected_unpatched
    with applied(FIX):
        assert matched(consumer(), PLAIN[case]) == (0, False)


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_remote_prefill_claims_remote_kv(case: str) -> None:
    """Negative control on every release: do_remote_prefill with params that cannot drive
    a READ (empty groups included) claims N-1 tokens; patched it claims none."""
    assert matched(consumer(), MALFORMED[case], rid=row_id(case)) == (PROMPT - 1, False)
    with applied(FIX):
        assert matched(consumer(), MALFORMED[case], rid=row_id(case)) == (0, False)


def test_malformed_params_warn_once_naming_the_request(caplog: pytest.LogCaptureFixture) -> None:
    sched = consumer()
    req = request(MALFORMED["empty-groups"], rid="req-malformed-7")
    with applied(FIX), caplog.at_level(logging.WARNING, logger="vllm.fixes.read-eligibility"):
        first = sched.get_num_new_matched_tokens(req, 0)
        second = sched.get_num_new_matched_tokens(req, 0)  # preempted and resumed, say
    assert first == second == (0, False)
    warnings = [r for r in caplog.records if "req-malformed-7" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert "no blocks in KV cache group 0" in warnings[0].getMessage()
    assert req.kv_transfer_params["do_remote_prefill"] is False  # nothing will be queued for it


@pytest.mark.parametrize("computed", [0, 16, 31, 32])
def test_well_formed_remote_prefill_claims_what_vllm_claims(computed: int) -> None:
    """An eligible remote prefill gets vLLM's own answer, whatever the computed prefix: N-c-1,
    clamped at 0 from vLLM 0.31.0; before, ``-1`` for a prompt fully computed locally (a
    value vLLM's scheduler never passes while the request still asks for its READ: its
    prefix-cache hit stops at N-1 and the flag is cleared at the first allocation). The
    wrapper passes that through unchanged: clamping it to 0 would leave the scheduler
    nothing to schedule for the request (``assert num_new_tokens > 0``)."""
    params = well_formed(block_layout())
    unpatched = matched(consumer(), params, computed)
    assert unpatched in {(PROMPT - computed - 1, False), (max(PROMPT - computed - 1, 0), False)}
    with applied(FIX):
        assert matched(consumer(), params, computed) == unpatched


def side(*, read: bool, producer: bool) -> Any:
    """A connector scheduler on either side, in either mode (WRITE also reads _has_mamba)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector as mc

    sched = consumer()
    sched.is_producer = producer
    sched.mode = mc.MoRIIOMode.READ if read else mc.MoRIIOMode.WRITE
    sched._has_mamba = False
    return sched


@pytest.mark.parametrize(
    "params",
    [None, {}, {"do_remote_prefill": False}, MALFORMED["flag-only"], MALFORMED["empty-groups"]],
    ids=["none", "empty", "flag-false", "flag-only", "empty-groups"],
)
@pytest.mark.parametrize("where", ["producer-read", "consumer-write", "producer-write"])
def test_write_mode_and_producer_unchanged(where: str, params: Any) -> None:
    def call() -> Any:
        sched = side(read=where.endswith("read"), producer=where.startswith("producer"))
        req = request(params)
        return sched.get_num_new_matched_tokens(req, 0), req.kv_transfer_params

    before = call()
    with applied(FIX):
        assert call() == before


def no_new_blocks(manager: Any) -> Any:
    if hasattr(manager, "create_kv_cache_blocks"):
        return manager.create_kv_cache_blocks(([],))
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks

    return KVCacheBlocks(([],))


def test_lifecycle_flag_cleared_then_claims_nothing(read_consumer_scheduler: Any) -> None:
    """On the real scheduler's real MoRIIO connector: the first query claims N-1 and
    queues exactly one READ, which clears the flag; a second query (preempted and resumed,
    or retried) must claim nothing. Before 0.33.0 vLLM claims N-1 again."""
    from vllm_fix_testing import real_request

    connector = read_consumer_scheduler.connector.connector_scheduler
    manager = read_consumer_scheduler.kv_cache_manager

    def run(rid: str) -> tuple[Any, Any, bool]:
        params = {**well_formed(block_layout()), "remote_block_ids": [[10, 11]], "transfer_id": f"tx-{rid}"}
        req = real_request(rid, PROMPT, kv_transfer_params=params)
        first = connector.get_num_new_matched_tokens(req, 0)
        connector.update_state_after_alloc(req, no_new_blocks(manager), first[0])
        queued = rid in connector._reqs_need_recv
        connector._reqs_need_recv.pop(rid, None)
        second = connector.get_num_new_matched_tokens(req, 0)
        return first, second, queued

    first, second, queued = run("life-unpatched")
    assert first == (PROMPT - 1, False) and queued
    assert second == ((0, False) if PLAIN_FIXED_UPSTREAM else (PROMPT - 1, False))
    with applied(FIX):
        first, second, queued = run("life-patched")
    assert first == (PROMPT - 1, False) and queued
    assert second == (0, False)
