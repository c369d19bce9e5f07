"""Ownership invariants over randomized status sequences, on the real vLLM worker.

A scenario: a hybrid or attention-only READ consumer tracking 1-3 transfers of 1-3
statuses each; every status lands (succeeds or fails) at a random step or never; the
clock advances between steps (sums never come near the 120 s boundary). After every
``get_finished`` the invariants of spec §3.3 are checked:

* at most one release per holder per transfer;
* no hybrid block id ever reaches get_block_ids_with_load_errors;
* nothing dropped silently: a transfer leaves tracking only completed and released,
  or (attention-only) with its blocks reported in that same step;
* hybrid failure / timeout fails the step closed (TransferError), keeps tracking and
  sends nothing for it; attention-only never raises;
* tracking is all-or-nothing across the four dicts; completed transfers are not held.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_fix_core import runtime
from vllm_fix_read_failure_ownership import FIX
from vllm_fix_testing import FakeStatus, applied
from vllm_fix_testing.stress import scaled

TIMEOUT = 120.0
STEP_SECONDS = [0.0, 1.0, 50.0, 130.0]  # no sum of <= 5 of these lies in (118, 122)


@dataclass(frozen=True)
class Scenario:
    hybrid: bool
    # per transfer, per status: (step at which it lands, "done" | "failed"); step == steps: never
    fates: tuple[tuple[tuple[int, str], ...], ...]
    advance: tuple[float, ...]  # clock advance before each step

    @property
    def steps(self) -> int:
        return len(self.advance)


@st.composite
def scenarios(draw: Any) -> Scenario:
    steps = draw(st.integers(1, 5))
    fate = st.tuples(st.integers(0, steps), st.sampled_from(["done", "done", "failed"]))
    fates = draw(st.lists(st.lists(fate, min_size=1, max_size=3).map(tuple), min_size=1, max_size=3))
    advance = draw(st.lists(st.sampled_from(STEP_SECONDS), min_size=steps, max_size=steps))
    return Scenario(draw(st.booleans()), tuple(fates), tuple(advance))


def check(kit: SimpleNamespace, sc: Scenario) -> list[str]:
    """Run the scenario on the currently installed _pop_done_transfers; list the violations."""
    transfer_error = kit.mc().TransferError
    h = kit.build_worker(hybrid=sc.hybrid, timeout=TIMEOUT)
    holders = kit.holders()
    statuses: dict[str, list[FakeStatus]] = {}
    blocks: dict[str, set[int]] = {}
    for i, fates in enumerate(sc.fates):
        req = f"r{i}"
        statuses[req] = [FakeStatus() for _ in fates]
        blocks[req] = {10 * i, 10 * i + 1}
        # one layer per status, like one READ per layer
        by_layer = {f"l{j}": [s] for j, s in enumerate(statuses[req])}
        h.add(kit.Read(req, f"x{i}", sorted(blocks[req]), by_layer), started=time.monotonic())
    violations: list[str] = []
    elapsed = 0.0
    for step in range(sc.steps):
        elapsed += sc.advance[step]
        for i, fates in enumerate(sc.fates):
            for status, (when, final) in zip(statuses[f"r{i}"], fates, strict=True):
                if when == step:
                    status.succeed() if final == "done" else status.fail("lost", 5)
        before = {r for r in statuses if all(h.tracked(r).values())}
        for r in before:  # age of every tracked transfer == simulated elapsed time
            h.worker._recving_transfers_start[r] = time.monotonic() - elapsed
        sent_before = Counter(h.releases())
        raised = h.finish()
        reported = h.worker.get_block_ids_with_load_errors()
        sent = Counter(h.releases())
        new = sent - sent_before
        where = f"step {step}"
        if raised is not None and not isinstance(raised, transfer_error):
            violations.append(f"{where}: unexpected {raised!r}")
        for key, count in sent.items():
            if count > 1:
                violations.append(f"{where}: {count} releases of {key}")
        if sc.hybrid and reported:
            violations.append(f"{where}: hybrid block ids reported {sorted(reported)}")
        fatal = set()
        for r in sorted(before):
            xfer = f"x{r[1:]}"
            is_failed = any(s.Failed() for s in statuses[r])
            is_done = all(s.Succeeded() for s in statuses[r])
            timed_out = not is_done and not is_failed and elapsed > TIMEOUT
            state = h.tracked(r)
            if len(set(state.values())) != 1:
                violations.append(f"{where}: {r} half-tracked {state}")
            gone = not any(state.values())
            released = sorted(p for (x, p) in new if x == xfer)
            if sc.hybrid and (is_failed or timed_out):
                fatal.add(r)
                if gone or released:
                    violations.append(
                        f"{where}: hybrid {r} failed/timed out but dropped={gone} released={released}"
                    )
            elif gone:
                completed = is_done and released == sorted(holders)
                recovered = not sc.hybrid and blocks[r] <= reported
                if not (completed or recovered):
                    violations.append(
                        f"{where}: {r} dropped silently (released={released}, reported={reported})"
                    )
            elif is_done:
                violations.append(f"{where}: completed {r} still held")
        if fatal and not isinstance(raised, transfer_error):
            violations.append(f"{where}: hybrid {sorted(fatal)} failed/timed out, step did not fail closed")
        if not fatal and raised is not None:
            violations.append(f"{where}: raised {raised!r} without a hybrid failure")
    return violations


@given(sc=scenarios())
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_invariants_hold_patched(kit: SimpleNamespace, sc: Scenario) -> None:
    with applied(FIX):
        assert check(kit, sc) == []


@pytest.mark.stress
@given(sc=scenarios())
@settings(
    max_examples=scaled(3000, 600), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_invariants_hold_patched_stress(kit: SimpleNamespace, sc: Scenario) -> None:
    with applied(FIX):
        assert check(kit, sc) == []


@pytest.mark.parametrize(
    ("sc", "expected"),
    [
        (Scenario(True, (((0, "failed"), (1, "done")),), (1.0, 1.0)), "did not fail closed"),
        (Scenario(True, (((5, "done"),),), (130.0,)), "did not fail closed"),
    ],
    ids=["hybrid-failure", "hybrid-timeout"],
)
def test_invariants_catch_the_bug_unpatched(kit: SimpleNamespace, sc: Scenario, expected: str) -> None:
    """The checker is not vacuous: on unpatched vLLM it flags the bug."""
    runtime.revert(FIX)
    violations = check(kit, sc)
    assert any(expected in v for v in violations), violations
    assert any("dropped" in v for v in violations), violations


def test_invariants_hold_unpatched_attention_only(kit: SimpleNamespace) -> None:
    """Attention-only behaviour is unchanged: vLLM itself satisfies the invariants there."""
    runtime.revert(FIX)
    for sc in (
        Scenario(False, (((0, "failed"), (1, "done")), ((0, "done"),)), (1.0, 1.0)),
        Scenario(False, (((5, "done"),), ((1, "done"),)), (1.0, 130.0)),
    ):
        assert check(kit, sc) == []
