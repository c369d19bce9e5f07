"""A hostile wrapper: proves a fix's probe observes vLLM, not the fix.

`hostile_decision(fix)` runs the real decision ladder with one change: right after the fix
applies, another wrapper is layered over every target the fix declares, and that wrapper calls
vLLM's original object instead of what is installed (undoing the fix's effect while the fix's
own wrappers stay in the chain). A probe that calls vLLM's entry points through whatever is
installed must then see the bug again, so the ladder must answer "failed to fix", revert, and
leave every target exactly as it was. A probe that checks its own wrapper, or calls the fix's
code by hand, says "fixed" and the test that uses this helper fails.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm_fix_core import Decision, Fix, PatchSet, Settings, evaluate, original_of
from vllm_fix_core.declaration import _load, static_lookup

_REAL_APPLY: dict[str, str] = {}
HOSTILE_ID = "hostile-wrapper"


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


def hostile_apply(patch: PatchSet, shape: str) -> None:
    """The fix's own apply, then a layer over each declared target that calls vLLM's original."""
    fix: Fix = _FIXES[patch.fix_id]
    real: Any = _load(_REAL_APPLY[patch.fix_id])
    real(patch, shape)
    hostile = PatchSet(HOSTILE_ID)
    for target in fix.targets:
        try:
            owner, attr, _ = target.resolve()
        except (ImportError, AttributeError):
            if target.optional:
                continue
            raise
        hostile.wrap(owner, attr, _undo_wrapper(owner, attr))
    # The fix's revert takes the hostile layer off first, so both come off exactly.
    patch.on_revert(hostile.revert)


_FIXES: dict[str, Fix] = {}


def hostile_decision(fix: Fix, *, strict: bool = False) -> Decision:
    """The ladder's decision for `fix` with the hostile layer over it (strict: raises FixFailed)."""
    _REAL_APPLY[fix.id] = fix.apply
    _FIXES[fix.id] = fix
    variant = dataclasses.replace(fix, apply=f"{__name__}:hostile_apply")
    return evaluate(variant, Settings(disabled=frozenset(), strict=strict), apply=True, honour_disable=False)


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


def assert_hostile_wrapper_fails(fix: Fix) -> Decision:
    """The check every fix package runs where its vLLM is affected.

    The ladder must say "failed to fix" (not "affected → fixed"), revert, and leave every
    target object identical to what it was before; strict mode must raise FixFailed.
    """
    from vllm_fix_core import FixFailed, Rung

    before = target_objects(fix)
    decision = hostile_decision(fix)
    assert decision.rung is Rung.FAILED, (
        f"{fix.id}: with vLLM's original behaviour layered over the fix, the ladder said "
        f"{decision.rung.value!r} ({decision.reason}); its probe does not observe vLLM"
    )
    after = target_objects(fix)
    assert all(after[k] is v for k, v in before.items()), f"{fix.id}: targets not restored exactly"
    try:
        hostile_decision(fix, strict=True)
    except FixFailed:
        pass
    else:
        raise AssertionError(f"{fix.id}: strict mode did not raise FixFailed under the hostile wrapper")
    after = target_objects(fix)
    assert all(after[k] is v for k, v in before.items()), f"{fix.id}: strict run did not restore targets"
    return decision
