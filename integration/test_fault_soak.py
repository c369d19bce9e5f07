"""Fault soak with every fix applied at once: the MultiConnector[MoRIIO READ producer, X] soak
(random owner sets, completion order and timing, async-scheduling delay, watchdog expiries,
aborts) on the real MultiConnector / MoRIIO scheduler / scheduler free loop, while all other
fixes are layered onto their own targets in the same process. Nothing leaks, nothing is freed
twice or early, and every fix's probe still reports fixed afterwards."""

from __future__ import annotations

import pytest

from vllm_fix_core import Answer, runtime
from vllm_fix_core.registry import Installed
from vllm_fix_testing import STRICT
from vllm_fix_testing.prefill_instance import soak
from vllm_fix_testing.stress import scaled


def run_soak_with_all_fixes(fixes: list[Installed], requests: int, seed: int, workers: int) -> None:
    for item in fixes:
        runtime.revert(item.fix)
    try:
        decisions = {i.fix.id: runtime.apply(i.fix, STRICT) for i in fixes}
        assert decisions["completion-ownership"].answer is Answer.AFFECTED_FIXED
        world = soak(requests, seed=seed, num_workers=workers, async_scheduling=True)
        figures = world.figures()
        print(f"\nall fixes applied, seed={seed}, workers={workers}: {figures.line()}")
        assert figures.requests == requests
        assert (figures.leaked, figures.double_frees, figures.early_frees) == (0, 0, 0)
        assert figures.freed == requests
        for item in fixes:
            report = item.fix.run_probe()
            assert not report.affected and not report.broken_guards, (item.fix.id, report.summary())
    finally:
        for item in fixes:
            runtime.revert(item.fix)


def test_fault_soak_with_every_fix_applied(fixes: list[Installed]) -> None:
    run_soak_with_all_fixes(fixes, requests=2_000, seed=101, workers=2)


@pytest.mark.stress
@pytest.mark.parametrize("seed,workers", [(202, 4), (303, 8)])
def test_fault_soak_with_every_fix_applied_stress(fixes: list[Installed], seed: int, workers: int) -> None:
    run_soak_with_all_fixes(fixes, requests=scaled(10_000, 2_000), seed=seed, workers=workers)
