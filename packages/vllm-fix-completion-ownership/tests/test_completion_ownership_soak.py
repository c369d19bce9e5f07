"""Soak: random owner sets, completion order and timing, async-scheduling delay,
watchdog expiries and aborts, on the real MultiConnector / MoRIIO / scheduler free loop.

Prints the figures for unpatched and patched vLLM (run with -s to see them).
"""

from __future__ import annotations

import pytest
from packaging.version import Version

from vllm_fix_completion_ownership import FIX
from vllm_fix_completion_ownership.gate import RETIRED_WINDOW
from vllm_fix_completion_ownership.state import GATE_ATTR, LEDGER_ATTR
from vllm_fix_testing import applied, vllm_version
from vllm_fix_testing.prefill_instance import Figures, World, soak
from vllm_fix_testing.stress import scaled

# Written for the releases the package's sessions run it on (0.32.0, 0.33.0) and the prefill-
# instance harness of 0.24.0+; the older MultiConnector shapes are covered by
# test_completion_ownership_eras.py (session on 0.17.1) and the matrix sessions.
pytestmark = pytest.mark.skipif(
    vllm_version() < Version("0.24.0"),
    reason="scenarios for vLLM 0.24.0+; older releases: test_completion_ownership_eras.py",
)

DEFAULT_REQUESTS = 10_000


def run(requests: int, seed: int, patched: bool, **kwargs: object) -> tuple[World, Figures]:
    if patched:
        with applied(FIX):
            world = soak(requests, seed=seed, **kwargs)  # type: ignore[arg-type]
            figures = world.figures(LEDGER_ATTR, GATE_ATTR)
    else:
        world = soak(requests, seed=seed, **kwargs)  # type: ignore[arg-type]
        figures = world.figures(LEDGER_ATTR, GATE_ATTR)
    label = "patched  " if patched else "unpatched"
    print(f"\nvLLM {vllm_version()} {label} seed={seed} {kwargs}: {figures.line()}")
    return world, figures


def test_soak_unpatched_shows_the_bug() -> None:
    _, figures = run(DEFAULT_REQUESTS, seed=7, patched=False)
    assert figures.requests == DEFAULT_REQUESTS
    # The bug appears (how often depends on timing: at least once, count reported).
    assert figures.leaked >= 1, f"no leaked request (D1) in {figures.line()}"
    assert figures.early_frees >= 1, f"no early free (D2-D4) in {figures.line()}"


def test_soak_patched_frees_everything_exactly_once() -> None:
    world, figures = run(DEFAULT_REQUESTS, seed=7, patched=True)
    assert figures.requests == DEFAULT_REQUESTS
    assert figures.freed == DEFAULT_REQUESTS
    assert (figures.leaked, figures.double_frees, figures.early_frees) == (0, 0, 0)
    assert figures.watchdog_expiries > 0 and figures.aborts > 0
    assert len(figures.owner_sets) == 4
    # Bookkeeping: nothing left for live requests; retired ids age out.
    assert figures.ledger_entries == 0 and figures.gate_entries == 0
    # (at most 6 requests arrive per step in the soak)
    assert figures.retired_ids <= RETIRED_WINDOW * 6
    with applied(FIX):
        world.run(RETIRED_WINDOW + 1)
        assert world.figures(LEDGER_ATTR, GATE_ATTR).retired_ids == 0


@pytest.mark.stress
@pytest.mark.parametrize(
    ("seed", "workers", "async_scheduling"),
    [(11, 2, True), (12, 4, True), (13, 1, False), (14, 8, True)],
)
def test_soak_stress(seed: int, workers: int, async_scheduling: bool) -> None:
    requests = scaled(15_000, 3_000)
    shape = {"num_workers": workers, "async_scheduling": async_scheduling}
    _, before = run(requests, seed=seed, patched=False, **shape)
    _, after = run(requests, seed=seed, patched=True, **shape)
    assert before.leaked >= 1, f"no leaked request (D1) unpatched: {before.line()}"
    assert before.early_frees >= 1, f"no early free (D2-D4) unpatched: {before.line()}"
    assert after.freed == requests
    assert (after.leaked, after.double_frees, after.early_frees) == (0, 0, 0)
    assert after.ledger_entries == 0 and after.gate_entries == 0
