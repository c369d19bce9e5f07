"""Issue 22 for read-failure-ownership, on real vLLM: every patched target observed, an oracle
that is not the fix's own rule, and the patched poll never raising where vLLM's did not
(other than the fail-closed TransferError that is the fix)."""

from __future__ import annotations

import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_fix_core import runtime
from vllm_fix_core.patching import original_of
from vllm_fix_read_failure_ownership import FIX, patch
from vllm_fix_read_failure_ownership.rule import Outcome as RuleOutcome
from vllm_fix_read_failure_ownership.rule import Ownership
from vllm_fix_testing import (
    applied,
    assert_every_target_observed,
    assert_verification_fails,
    done,
    failed,
    pending,
)
from vllm_fix_testing.hostile import patched_targets

TARGET = "MoRIIOConnectorWorker._pop_done_transfers"


@pytest.fixture(scope="module")
def patched_for_module() -> Iterator[None]:
    with applied(FIX):
        yield


def test_every_patched_target_is_observed() -> None:
    """vLLM's own _pop_done_transfers layered over the fix's one target: "failed to fix"."""
    runtime.revert(FIX)
    assert patched_targets(FIX) == [TARGET]
    decisions = assert_every_target_observed(FIX)
    assert "hybrid-failure-fails-open=affected" in decisions[TARGET].reason


# -- the oracle is the spec table, not the rule ---------------------------------------------------
#
# The probe's expected outcomes are the spec's ownership table written out as literals
# (probe.Outcome("TransferError", 0, True, False, frozenset()) for a hybrid failure, ...), and
# it drives vLLM's real get_finished; it never calls rule.classify or rule.ownership. Break the
# rule the patch uses, at the reference patch.py holds, and the ladder must answer "failed to fix".


def _hybrid_ignored(real: Callable[..., Ownership]) -> Callable[..., Ownership]:
    def broken(outcome: RuleOutcome, *, hybrid: bool) -> Ownership:
        return real(outcome, hybrid=False)  # vLLM's own behaviour: hybrid treated as attention

    return broken


def _failure_never_seen(real: Callable[..., RuleOutcome]) -> Callable[..., RuleOutcome]:
    def broken(**kwargs: Any) -> RuleOutcome:
        return real(**{**kwargs, "failed": False})  # a failed batch looks pending

    return broken


def _timeout_never_seen(real: Callable[..., RuleOutcome]) -> Callable[..., RuleOutcome]:
    def broken(**kwargs: Any) -> RuleOutcome:
        return real(**{**kwargs, "age": None})  # no READ ever times out

    return broken


BREAKS = {
    "ownership-hybrid-ignored": (
        "ownership",
        _hybrid_ignored,
        {"hybrid-failure-fails-open", "hybrid-timeout-fails-open"},
    ),
    "classify-failure-missed": ("classify", _failure_never_seen, {"hybrid-failure-fails-open"}),
    "classify-timeout-missed": ("classify", _timeout_never_seen, {"hybrid-timeout-fails-open"}),
}


@pytest.mark.parametrize("name", list(BREAKS))
def test_broken_rule_fails_verification(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    runtime.revert(FIX)
    cls = patch._mc().MoRIIOConnectorWorker
    original = cls.__dict__["_pop_done_transfers"]
    attr, breaker, expected = BREAKS[name]
    monkeypatch.setattr(patch, attr, breaker(getattr(patch, attr)))
    assert_verification_fails(FIX, expected)
    assert cls.__dict__["_pop_done_transfers"] is original  # the ladder reverted exactly


# -- patched never raises where vLLM did not ------------------------------------------------------
#
# The shapes vLLM's types allow for the consumer's tracking (dict[ReqId, dict[layer,
# list[TransferStatus]]] plus the callback address, start time and local blocks per request):
# 0-3 requests, 0-2 layers each with 0-2 statuses (empty lists included), each status done,
# failed or pending, a start time far inside or far past recv_abort_timeout or absent, the
# local blocks present or absent, hybrid or attention-only. Both runs go through vLLM's real
# get_finished on identical fresh workers; "unpatched" shadows _pop_done_transfers on the
# instance with vLLM's own body.

AGES = {"fresh": 0.5, "expired": 10_000.0}


@dataclass(frozen=True)
class Tracked:
    layers: tuple[tuple[str, ...], ...]
    age: str | None  # None: no start time recorded
    blocks: bool


@st.composite
def trackings(draw: st.DrawFn) -> tuple[bool, tuple[Tracked, ...]]:
    status = st.sampled_from(["done", "failed", "pending"])
    layer = st.lists(status, max_size=2).map(tuple)
    one = st.builds(
        Tracked,
        layers=st.lists(layer, max_size=2).map(tuple),
        age=st.sampled_from([None, "fresh", "expired"]),
        blocks=st.booleans(),
    )
    return draw(st.booleans()), tuple(draw(st.lists(one, max_size=3)))


@dataclass
class Seen:
    raised: BaseException | None
    recving: set[str]
    releases: list[tuple[Any, Any]]
    reported: set[int]
    tracked: dict[str, dict[str, bool]]


def _run(kit: SimpleNamespace, hybrid: bool, reads: tuple[Tracked, ...], *, unpatched: bool) -> Seen:
    make = {"done": done, "failed": failed, "pending": pending}
    h = kit.build_worker(hybrid=hybrid)
    if unpatched:
        original = original_of(kit.mc().MoRIIOConnectorWorker, "_pop_done_transfers")
        h.worker._pop_done_transfers = types.MethodType(original, h.worker)
    for i, read in enumerate(reads):
        by_layer = {f"l{j}": [make[s]() for s in statuses] for j, statuses in enumerate(read.layers)}
        started = time.monotonic() - AGES[read.age] if read.age else 0.0
        h.add(kit.Read(f"r{i}", f"x{i}", [10 * i, 10 * i + 1], by_layer), started=started)
        if read.age is None:
            del h.worker._recving_transfers_start[f"r{i}"]
        if not read.blocks:
            del h.worker._recving_local_blocks[f"r{i}"]
    raised: BaseException | None = None
    recving: set[str] = set()
    try:
        _, recving = h.worker.get_finished()
    except Exception as exc:
        raised = exc
    return Seen(
        raised,
        set(recving),
        h.releases(),
        set(h.worker.get_block_ids_with_load_errors()),
        {f"r{i}": h.tracked(f"r{i}") for i in range(len(reads))},
    )


def _fails_closed(hybrid: bool, reads: tuple[Tracked, ...]) -> bool:
    """A hybrid READ that failed or timed out (spec §3.3): the one place the fix raises by design.

    A READ without any status is never complete, so it times out like a pending one."""

    def failed_or_timed_out(read: Tracked) -> bool:
        statuses = [s for layer in read.layers for s in layer]
        complete = bool(statuses) and all(s == "done" for s in statuses)
        return "failed" in statuses or (read.age == "expired" and not complete)

    return hybrid and any(failed_or_timed_out(r) for r in reads)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(drawn=trackings())
def test_patched_never_raises_where_vllm_does_not(
    kit: SimpleNamespace, patched_for_module: None, drawn: tuple[bool, tuple[Tracked, ...]]
) -> None:
    hybrid, reads = drawn
    transfer_error = kit.mc().TransferError
    before = _run(kit, hybrid, reads, unpatched=True)
    after = _run(kit, hybrid, reads, unpatched=False)
    if isinstance(after.raised, transfer_error) and not isinstance(before.raised, transfer_error):
        assert _fails_closed(hybrid, reads), f"TransferError without a hybrid failure/timeout: {after.raised}"
        return
    if before.raised is None:
        assert after.raised is None, f"patched raised {after.raised!r} where vLLM did not"
    elif after.raised is not None:
        assert type(after.raised) is type(before.raised), (before.raised, after.raised)
    if before.raised is None and after.raised is None:
        # Nothing failed closed: the fix behaves exactly as vLLM does.
        assert (after.recving, sorted(after.releases), after.reported, after.tracked) == (
            before.recving,
            sorted(before.releases),
            before.reported,
            before.tracked,
        )
