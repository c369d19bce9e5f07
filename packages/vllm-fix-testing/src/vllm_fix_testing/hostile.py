"""Hostile wrappers: prove a fix's probe observes vLLM, not the fix.

Right after the fix applies, a layer is put over what the fix patched that calls vLLM's
original object instead of what is installed (undoing the fix's effect there while the fix's
own layers stay in the chain). A probe that calls vLLM's entry points through whatever is
installed must then see the bug again, so the ladder must answer "failed to fix", revert, and
leave every target exactly as it was. A probe that checks its own wrapper, or calls the fix's
code by hand, says "fixed" and the test that uses this helper fails.

Two forms:

* ``assert_hostile_wrapper_fails(fix)``: the undo layer over *every* patched target at once;
* ``assert_every_target_observed(fix)``: one patched target at a time (vLLM's original over
  that target only, the fix's other layers in place), for each target the fix's apply
  patched on this vLLM (not only the declared ones: what ``PatchSet.targets`` recorded).
  A target whose undo the probe does not notice is a patched function nobody verifies.

``main([--fix ID]...)`` runs the per-target form for every installed fix that this vLLM needs
and prints one JSON line per fix (the release matrix runs it on every release).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Collection, Sequence
from typing import Any

from vllm_fix_core import Answer, Decision, Fix, FixFailed, PatchSet, Settings, evaluate, original_of
from vllm_fix_core.declaration import Links, static_lookup

HOSTILE_ID = "hostile-wrapper"


def label(owner: Any, attr: str) -> str:
    """A patched target's name: ``Class.attr`` or ``module.attr``."""
    name = owner.__qualname__ if isinstance(owner, type) else getattr(owner, "__name__", repr(owner))
    return f"{name}.{attr}"


def _undo_wrapper(owner: Any, attr: str) -> Any:
    original = original_of(owner, attr)

    def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        del wrapped  # the fix's chain: skipped on purpose
        if isinstance(original, classmethod):
            bound = original.__get__(None, instance if isinstance(instance, type) else owner)
        elif isinstance(original, staticmethod):
            bound = original.__func__
        elif instance is not None and hasattr(original, "__get__"):
            bound = original.__get__(instance, type(instance))
        else:
            bound = original
        return bound(*args, **kwargs)

    return wrapper


@dataclasses.dataclass
class _Plan:
    fix: Fix
    only: str | None  # a target's label, or None for every patched target
    seen: list[str] = dataclasses.field(default_factory=list)


_PLANS: dict[str, _Plan] = {}


def hostile_apply(patch: PatchSet, shape: str) -> None:
    """The fix's own apply, then the undo layer over the chosen patched target(s)."""
    plan = _PLANS[patch.fix_id]
    plan.fix.links().apply(patch, shape)
    hostile = PatchSet(HOSTILE_ID)
    plan.seen = [label(owner, attr) for owner, attr in patch.targets]
    for owner, attr in patch.targets:
        if plan.only is None or label(owner, attr) == plan.only:
            hostile.wrap(owner, attr, _undo_wrapper(owner, attr))
    if plan.only is not None and not hostile.applied:
        raise LookupError(f"{plan.fix.id} did not patch {plan.only} on this vLLM (it patched {plan.seen})")
    # The fix's revert takes the hostile layer off first, so both come off exactly.
    patch.on_revert(hostile.revert)


def hostile_decision(fix: Fix, *, strict: bool = False, only: str | None = None) -> Decision:
    """The ladder's decision for `fix` with the undo layer over `only` (default: every target)."""
    _PLANS[fix.id] = _Plan(fix, only)

    def links() -> Links:
        return dataclasses.replace(fix.links(), apply=hostile_apply)

    variant = dataclasses.replace(fix, links=links)
    return evaluate(variant, Settings(disabled=frozenset(), strict=strict), apply=True, honour_disable=False)


def patched_targets(fix: Fix) -> list[str]:
    """The labels of what the fix's apply patches on this vLLM (applied, recorded, reverted)."""
    plan = _Plan(fix, only="")  # matches nothing: records the targets, layers nothing
    _PLANS[fix.id] = plan
    patch = PatchSet(fix.id)
    try:
        hostile_apply(patch, fix.run_recognize())
    except LookupError:
        pass
    finally:
        patch.revert()
    return plan.seen


def target_objects(fix: Fix) -> dict[str, Any]:
    """Each declared target's raw object as it is now (compare before/after for exact revert)."""
    found: dict[str, Any] = {}
    for target in fix.targets:
        try:
            owner, attr, _ = target.resolve()
        except (ImportError, AttributeError):
            continue
        found[target.path] = static_lookup(owner, attr)
    return found


def _check_fails(fix: Fix, only: str | None) -> Decision:
    what = "every patched target" if only is None else only
    before = target_objects(fix)
    decision = hostile_decision(fix, only=only)
    if decision.patch is not None:  # "affected → fixed" keeps its patch: take it off again
        decision.patch.revert()
    assert decision.answer is Answer.FAILED_TO_FIX, (
        f"{fix.id}: with vLLM's original layered over {what}, the ladder said "
        f"{decision.answer.value!r} ({decision.reason}); its probe does not observe that target"
    )
    after = target_objects(fix)
    assert all(after[k] is v for k, v in before.items()), f"{fix.id}: targets not restored exactly"
    try:
        strict = hostile_decision(fix, strict=True, only=only)
    except FixFailed:
        pass
    else:
        if strict.patch is not None:
            strict.patch.revert()
        raise AssertionError(f"{fix.id}: strict mode did not raise FixFailed with {what} undone")
    after = target_objects(fix)
    assert all(after[k] is v for k, v in before.items()), f"{fix.id}: strict run did not restore targets"
    return decision


def assert_hostile_wrapper_fails(fix: Fix) -> Decision:
    """vLLM's originals over every patched target: "failed to fix", exact revert, FixFailed strict."""
    return _check_fails(fix, None)


def assert_verification_fails(fix: Fix, symptoms: Collection[str] = ()) -> Decision:
    """The real ladder on `fix` (a rule of its patch broken by the caller, say) must answer
    "failed to fix", with `symptoms` among what the probe still saw (symptoms it shows or guards
    it finds broken), and leave every declared
    target exactly as it was."""
    before = target_objects(fix)
    decision = evaluate(fix, Settings(disabled=frozenset(), strict=False), apply=True, honour_disable=False)
    if decision.patch is not None:
        decision.patch.revert()
    assert decision.answer is Answer.FAILED_TO_FIX, (
        f"{fix.id}: the ladder said {decision.answer.value!r} ({decision.reason})"
    )
    assert decision.after is not None, decision.reason
    seen = {*decision.after.names(True), *decision.after.broken_guards}
    assert set(symptoms) <= seen, decision.after.summary()
    after = target_objects(fix)
    assert all(after[k] is v for k, v in before.items()), f"{fix.id}: targets not restored exactly"
    return decision


def assert_every_target_observed(fix: Fix) -> dict[str, Decision]:
    """For each target the fix patches here, undone alone: "failed to fix" (and FixFailed strict).

    Every unobserved target is named in one AssertionError (not only the first)."""
    decisions: dict[str, Decision] = {}
    unobserved: list[str] = []
    targets = patched_targets(fix)
    assert targets, f"{fix.id}: its apply patched nothing on this vLLM"
    for name in targets:
        try:
            decisions[name] = _check_fails(fix, name)
        except AssertionError as exc:
            unobserved.append(str(exc))
    assert not unobserved, "\n".join(unobserved)
    return decisions


def main(argv: Sequence[str] | None = None) -> int:
    """Per-target check for every installed fix this vLLM needs; JSON lines on stdout."""
    from vllm_fix_core import registry

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--fix", action="append", default=[], help="only this fix id (repeatable)")
    args = parser.parse_args(argv)
    fixes = [i.fix for i in registry.installed_fixes() if not args.fix or i.fix.id in args.fix]
    failed = 0
    for fix in fixes:
        decision = evaluate(
            fix, Settings(disabled=frozenset(), strict=False), apply=False, honour_disable=False
        )
        if decision.answer is not Answer.WOULD_FIX:
            print(json.dumps({"fix": fix.id, "answer": decision.answer.value, "targets": {}}), flush=True)
            continue
        results: dict[str, str] = {}
        for name in patched_targets(fix):
            try:
                _check_fails(fix, name)
                results[name] = "observed"
            except AssertionError as exc:
                failed += 1
                results[name] = f"NOT observed: {exc}"
        print(json.dumps({"fix": fix.id, "answer": decision.answer.value, "targets": results}), flush=True)
    print(f"hostile: {len(fixes)} fixes checked, {failed} patched targets not observed", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
