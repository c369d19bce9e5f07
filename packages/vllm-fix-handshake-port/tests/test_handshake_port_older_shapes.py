"""Older shapes on the installed vLLM: a scheduler without the 0.24+ release sender (vLLM
0.14-0.23 and the forks built from them) is still recognized, patched and verified, and the
probe's router request id is one vLLM's own parser reads.

The release matrix (``matrix-<release>``) runs the probe and the per-target check on every
release 0.14.1-0.33.0; these tests make the same shape on the releases the sessions install,
by taking the newer method away from vLLM's real scheduler class for the test's duration.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_fix_core import Answer, Settings, evaluate
from vllm_fix_handshake_port import FIX
from vllm_fix_handshake_port.probe import HANDSHAKE, HOST, NOTIFY, _router_request_id
from vllm_fix_handshake_port.sites import callers
from vllm_fix_testing.hostile import assert_every_target_observed, patched_targets

LADDER = Settings(disabled=frozenset(), strict=False)
RELEASE = "_release_write_prefill_blocks"


@pytest.fixture
def without_release_sender(monkeypatch: pytest.MonkeyPatch, mods: SimpleNamespace) -> None:
    """vLLM's real scheduler class as 0.14-0.23 have it: no WRITE prefill-block release sender."""
    sched = mods.connector.MoRIIOConnectorScheduler
    if not hasattr(sched, RELEASE):
        pytest.skip("this vLLM has no release sender already")
    monkeypatch.delattr(sched, RELEASE)


@pytest.mark.usefixtures("without_release_sender")
def test_a_scheduler_without_the_release_sender_is_fixed() -> None:
    """'Not applicable' only where the bug's code is absent: the listener sites are there."""
    assert ("moriio_connector", f"MoRIIOConnectorScheduler.{RELEASE}") not in callers()
    before = FIX.run_probe()
    assert before.affected, before.summary()
    assert "release-misses-listener" not in {c.name for c in before.checks}  # nothing to drive
    decision = evaluate(FIX, LADDER, apply=True, honour_disable=False)
    try:
        assert decision.answer is Answer.AFFECTED_FIXED, decision.reason
        assert not FIX.run_probe().affected
    finally:
        assert decision.patch is not None
        decision.patch.revert()
    assert FIX.run_probe().affected


@pytest.mark.usefixtures("without_release_sender")
def test_every_target_is_observed_without_the_release_sender() -> None:
    targets = patched_targets(FIX)
    assert f"MoRIIOConnectorScheduler.{RELEASE}" not in targets
    assert "MoRIIOConnectorScheduler.update_state_after_alloc" in targets
    assert set(assert_every_target_observed(FIX)) == set(targets)


@pytest.mark.parametrize("is_producer", [True, False])
def test_the_probe_request_id_is_one_vllm_parses(mods: SimpleNamespace, is_producer: bool) -> None:
    """0.20+ schedulers read the peer's notify base from the router's request id: vLLM's own
    parser must read the probe's bases back from it, on either side."""
    parse = getattr(mods.common, "parse_moriio_zmq_address", None)
    peer = getattr(mods.common, "get_peer_zmq_from_request_id", None)
    if parse is None or peer is None:
        pytest.skip("this vLLM reads no address from the request id")
    address = peer(_router_request_id("probe-alloc-1"), is_producer=is_producer)
    assert parse(address) == (HOST, HANDSHAKE, NOTIFY)
