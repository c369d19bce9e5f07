"""The decision ladder: per fix, per process, one decision and one log line."""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field

from vllm_fix_core.declaration import Fix, NotApplicable, ProbeReport, UnknownShape
from vllm_fix_core.hooks import locate
from vllm_fix_core.log import get_logger, probing
from vllm_fix_core.patching import PatchSet
from vllm_fix_core.settings import Settings


class Rung(str, enum.Enum):
    """Where a fix landed on the ladder. The value is the one word used everywhere: log lines,
    `vllm-fixes status` / `verify` text and JSON, the report file, the docs."""

    DISABLED = "disabled"  # 1
    NOT_APPLICABLE = "not applicable"  # 2: the code the bug lives in is not part of this vLLM
    CANNOT_CHECK = "cannot check"  # 2: a target exists but cannot be imported or probed here
    UPSTREAM_FIXED = "fixed upstream"  # 3
    REFUSED = "refused"  # 4: affected, but patching would be unsafe; not patched
    FAILED = "failed to fix"  # 5: applied, probe still saw the bug, reverted
    APPLIED = "affected → fixed"  # 5: applied and verified
    PENDING = "pending"  # waiting for vLLM to import the trigger module
    EVALUATED = "would fix"  # dry run (status): affected, a known shape, would apply

    def __str__(self) -> str:
        return self.value


# The order verdict lines count rungs in.
VERDICT_ORDER = (
    Rung.APPLIED,
    Rung.EVALUATED,
    Rung.UPSTREAM_FIXED,
    Rung.NOT_APPLICABLE,
    Rung.REFUSED,
    Rung.FAILED,
    Rung.CANNOT_CHECK,
    Rung.DISABLED,
    Rung.PENDING,
)
# Always shown in a verdict line, even at 0 (the others only when they occur).
VERDICT_ALWAYS = (Rung.UPSTREAM_FIXED, Rung.REFUSED, Rung.CANNOT_CHECK)

_LEVEL = {
    Rung.DISABLED: logging.DEBUG,
    Rung.NOT_APPLICABLE: logging.DEBUG,
    Rung.CANNOT_CHECK: logging.WARNING,
    Rung.UPSTREAM_FIXED: logging.INFO,
    Rung.REFUSED: logging.WARNING,
    Rung.FAILED: logging.ERROR,
    Rung.APPLIED: logging.INFO,
    Rung.PENDING: logging.DEBUG,
    Rung.EVALUATED: logging.DEBUG,
}


class FixRefused(RuntimeError):
    """Strict mode: a fix could not be applied to this vLLM (rung 4)."""


class FixFailed(RuntimeError):
    """Strict mode: a fix was applied but its probe still sees the bug (rung 5)."""


@dataclass
class Decision:
    fix_id: str
    rung: Rung
    reason: str
    before: ProbeReport | None = None
    after: ProbeReport | None = None
    shape: str | None = None
    patch: PatchSet | None = field(default=None, repr=False)

    @property
    def message(self) -> str:
        return f"vllm-fix {self.fix_id}: {self.rung.value}: {self.reason}"


def verdict(vllm: str, decisions: list[Decision]) -> str:
    """One line per vLLM: 'vLLM 0.33.0: 7 fixes — 6 affected → fixed, 1 fixed upstream, ...'."""
    counts = {rung: 0 for rung in VERDICT_ORDER}
    for d in decisions:
        counts[d.rung] += 1
    parts = [f"{n} {rung.value}" for rung, n in counts.items() if n or rung in VERDICT_ALWAYS]
    noun = "fix" if len(decisions) == 1 else "fixes"
    return f"vLLM {vllm}: {len(decisions)} {noun} — " + ", ".join(parts)


def _log(fix: Fix, decision: Decision) -> None:
    get_logger(fix.id).log(_LEVEL[decision.rung], "%s", decision.message)


def _raise_if_strict(settings: Settings, decision: Decision) -> None:
    if not settings.strict:
        return
    if decision.rung is Rung.REFUSED:
        raise FixRefused(decision.message)
    if decision.rung is Rung.FAILED:
        raise FixFailed(decision.message)


def _describe_before(report: ProbeReport) -> str:
    fixed = report.names(False)
    text = "this vLLM has the bug (" + ", ".join(report.names(True)) + ")"
    if fixed:
        text += "; already fixed upstream: " + ", ".join(fixed)
    return text


def evaluate(fix: Fix, settings: Settings, *, apply: bool, honour_disable: bool = True) -> Decision:
    """Run the ladder for `fix` (trigger module importable or imported).

    Never raises except in strict mode (FixRefused / FixFailed)."""
    decision = _evaluate(fix, settings, apply=apply, honour_disable=honour_disable)
    if apply:
        _log(fix, decision)
        _raise_if_strict(settings, decision)
    return decision


def _resolve_targets(fix: Fix) -> Decision | None:
    """Rung 2: every required target exists and imports. None when the fix can go on."""
    modules = dict.fromkeys(t.module for t in fix.targets if not t.optional)
    for module in modules:
        if not locate(module):
            return Decision(fix.id, Rung.NOT_APPLICABLE, f"{module} is not part of this vLLM")
    for target in fix.targets:
        if target.optional and not locate(target.module):
            continue
        try:
            target.resolve()
        except AttributeError as exc:
            if target.optional:
                continue
            return Decision(fix.id, Rung.NOT_APPLICABLE, f"{target.path} is not part of this vLLM ({exc})")
        except Exception as exc:  # the module is there but cannot be imported here
            return Decision(fix.id, Rung.CANNOT_CHECK, f"{target.module} failed to import: {exc!r}")
    return None


def _evaluate(fix: Fix, settings: Settings, *, apply: bool, honour_disable: bool) -> Decision:
    if honour_disable and settings.is_disabled(fix.id):
        return Decision(fix.id, Rung.DISABLED, "disabled by VLLM_FIXES_DISABLE")
    missing = _resolve_targets(fix)
    if missing is not None:
        return missing
    before = _probe_before(fix)
    if isinstance(before, Decision):
        return before
    shape = _recognize(fix, before)
    if isinstance(shape, Decision):
        return shape
    if not apply:
        return Decision(
            fix.id, Rung.EVALUATED, _describe_before(before) + f"; shape {shape}", before=before, shape=shape
        )
    return _apply_and_verify(fix, before, shape)


def _probe_before(fix: Fix) -> ProbeReport | Decision:
    """Rung 3: does this vLLM have the bug? The report, or the decision that ends the ladder."""
    try:
        before = run_probe(fix)
    except NotApplicable as exc:
        return Decision(fix.id, Rung.NOT_APPLICABLE, str(exc))
    except Exception as exc:
        return Decision(fix.id, Rung.CANNOT_CHECK, f"the probe could not run on this vLLM: {exc!r}")
    if not before.affected:
        return Decision(
            fix.id,
            Rung.UPSTREAM_FIXED,
            "this vLLM already behaves correctly (" + before.summary() + "); nothing patched",
            before=before,
        )
    return before


def _recognize(fix: Fix, before: ProbeReport) -> str | Decision:
    """Rung 4: only known shapes, and only a vLLM that behaves as the fix assumes."""
    seen = "affected, not patched: " + _describe_before(before)
    try:
        shape = fix.run_recognize()
    except NotApplicable as exc:
        return Decision(fix.id, Rung.NOT_APPLICABLE, str(exc), before=before)
    except UnknownShape as exc:
        return Decision(fix.id, Rung.REFUSED, f"{seen}; unknown target shape: {exc}", before=before)
    except Exception as exc:
        return Decision(fix.id, Rung.REFUSED, f"{seen}; the shape check failed: {exc!r}", before=before)
    if before.broken_guards:
        return Decision(
            fix.id,
            Rung.REFUSED,
            f"{seen}; this vLLM does not behave as the fix assumes ({before.summary()})",
            before=before,
        )
    return shape


def _apply_and_verify(fix: Fix, before: ProbeReport, shape: str) -> Decision:
    """Rung 5: apply, probe again through what is installed, keep or revert."""
    patch = PatchSet(fix.id)
    try:
        fix.run_apply(patch, shape)
    except Exception as exc:
        _safe_revert(patch)
        return Decision(fix.id, Rung.FAILED, f"apply raised {exc!r}; reverted", before=before, shape=shape)
    try:
        after = run_probe(fix)
    except Exception as exc:
        _safe_revert(patch)
        return Decision(
            fix.id, Rung.FAILED, f"probe after apply raised {exc!r}; reverted", before=before, shape=shape
        )
    if after.affected or after.broken_guards:
        _safe_revert(patch)
        return Decision(
            fix.id,
            Rung.FAILED,
            "still affected after apply (" + after.summary() + "); reverted",
            before=before,
            after=after,
            shape=shape,
        )
    return Decision(
        fix.id,
        Rung.APPLIED,
        _describe_before(before) + f"; patched ({shape}) and verified",
        before=before,
        after=after,
        shape=shape,
        patch=patch,
    )


def run_probe(fix: Fix) -> ProbeReport:
    """Run the fix's probe with the fixes' own log lines silenced (see log.probing)."""
    with probing():
        return fix.run_probe()


def _safe_revert(patch: PatchSet) -> None:
    try:
        patch.revert()
    except Exception:  # pragma: no cover - reported by the caller's line
        logging.getLogger("vllm.fixes").exception("revert of %s failed", patch.fix_id)
