"""The harm, on vLLM's real Scheduler with a real MoRIIO READ consumer connector.

What the engine must never do: count prompt tokens as computed (loaded from the prefill
instance) that no READ loads. For every request admitted in a step we compare what the
connector claimed (prompt tokens minus what the step schedules) with the READ vLLM
queued for it in that step's connector metadata, and keep stepping to show no READ
comes later either. The forward would then attend to KV blocks nothing wrote.

vLLM's own unit tests (tests/v1/kv_connector/unit/test_moriio_hma_scheduler.py) expect
``{"do_remote_prefill": True}`` alone to claim N-1 tokens; the bare-flag scenario below
is why this fix disagrees.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from packaging.version import Version

from vllm_fix_read_eligibility import FIX
from vllm_fix_read_eligibility.probe import PROMPT
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
