"""Every installed fix together on real vLLM: apply in any order, each probe stays fixed,
each reverts alone, and revert restores vLLM's exact original objects."""

from __future__ import annotations

import random
from typing import Any

import pytest

from vllm_fix_core import Answer, runtime
from vllm_fix_core.declaration import static_lookup
from vllm_fix_core.registry import Installed
from vllm_fix_testing import STRICT


def originals(items: list[Installed]) -> dict[tuple[str, str], Any]:
    out = {}
    for item in items:
        for target in item.fix.targets:
            try:
                owner, attr, raw = target.resolve()
            except (ImportError, AttributeError):
                if target.optional:  # a method this release does not have
                    continue
                raise
            out[(target.module, target.qualname)] = (owner, attr, raw)
    return out


def assert_restored(before: dict[tuple[str, str], Any]) -> None:
    for (module, qualname), (owner, attr, raw) in before.items():
        assert static_lookup(owner, attr) is raw, f"{module}:{qualname} was not restored"


@pytest.mark.parametrize("order", ["declared", "reversed", "shuffled-1", "shuffled-2"])
def test_all_fixes_compose_in_any_order(fixes: list[Installed], order: str) -> None:
    items = list(fixes)
    if order == "reversed":
        items.reverse()
    elif order.startswith("shuffled"):
        random.Random(order).shuffle(items)
    for item in items:
        runtime.revert(item.fix)
    before = originals(items)
    decisions = {}
    try:
        for item in items:
            decisions[item.fix.id] = runtime.apply(item.fix, STRICT)
        applied = [i for i in items if decisions[i.fix.id].answer is Answer.AFFECTED_FIXED]
        assert applied, "no fix applied on this vLLM"
        for item in items:
            assert decisions[item.fix.id].answer in (Answer.AFFECTED_FIXED, Answer.FIXED_UPSTREAM), decisions[
                item.fix.id
            ].message
            # Every fix's probe still sees it fixed with all the others on top of or under it.
            report = item.fix.run_probe()
            assert not report.affected and not report.broken_guards, (item.fix.id, report.summary())
        # Revert one at a time in another order: the rest stay fixed.
        remaining = list(applied)
        random.Random(order + "-revert").shuffle(remaining)
        while remaining:
            gone = remaining.pop()
            assert runtime.revert(gone.fix)
            for item in remaining:
                assert not item.fix.run_probe().affected, (item.fix.id, "broken by reverting", gone.fix.id)
    finally:
        for item in items:
            runtime.revert(item.fix)
    assert_restored(before)
