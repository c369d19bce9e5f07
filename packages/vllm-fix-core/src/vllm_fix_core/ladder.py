"""The decision ladder: per fix, per process, one decision and one log line."""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field

from vllm_fix_core.declaration import Fix, NotApplicable, ProbeReport, UnknownShape
from vllm_fix_core.guest import guest
from vllm_fix_core.hooks import locate
from vllm_fix_core.log import get_logger, probing
from vllm_fix_core.patching import PatchSet
from vllm_fix_core.settings import Settings


class Answer(str, enum.Enum):
    """What the ladder decided for one fix in one process. The value is the one wording used
    everywhere: log lines, `vllm-fixes status` / `verify` text and JSON (key "answer"), the
    report file, the docs."""

    DISABLED = "disabled"
    NOT_APPLICABLE = "not applicable"  # the code the bug lives in is not part of this vLLM
    CANNOT_CHECK = "cannot check"  # a target exists but cannot be imported or probed here
    FIXED_UPSTREAM = "fixed upstream"  # this vLLM already behaves correctly
    REFUSED = "refused"  # affected, but patching would be unsafe; not patched
    FAILED_TO_FIX = "failed to fix"  # applied, the probe still saw the bug, reverted
    AFFECTED_FIXED = "affected → fixed"  # applied and verified
    PENDING = "pending"  # waiting for vLLM to import the trigger module
    WOULD_FIX = "would fix"  # dry run (status): affected, a known shape, would apply

    def __str__(self) -> str:
        return self.value

    @property
    def in_a_tree(self) -> str:
        """The same answer said of a fork's source tree (`status --source`, `verify --source`)."""
        return _IN_A_TREE[self]

    @property
    def level(self) -> int:
        """The log level of a decision with this answer."""
        return _LEVEL[self]


_IN_A_TREE = {
    Answer.AFFECTED_FIXED: "needs it (the tree has the bug; the runtime fix applies and verifies)",
    Answer.WOULD_FIX: "needs it (the tree has the bug; the runtime fix would apply)",
    Answer.FIXED_UPSTREAM: "carries it already",
    Answer.NOT_APPLICABLE: "not applicable (the code the bug lives in is not in the tree)",
    Answer.REFUSED: "cannot be patched safely here",
    Answer.FAILED_TO_FIX: "cannot be patched safely here (the fix did not verify)",
    Answer.CANNOT_CHECK: "cannot check",
    Answer.DISABLED: "disabled",
    Answer.PENDING: "pending",
}

_LEVEL = {
    Answer.DISABLED: logging.DEBUG,
    Answer.NOT_APPLICABLE: logging.DEBUG,
    Answer.CANNOT_CHECK: logging.WARNING,
    Answer.FIXED_UPSTREAM: logging.INFO,
    Answer.REFUSED: logging.WARNING,
    Answer.FAILED_TO_FIX: logging.ERROR,
    Answer.AFFECTED_FIXED: logging.INFO,
    Answer.PENDING: logging.DEBUG,
    Answer.WOULD_FIX: logging.DEBUG,
}


class GuardAnswer(str, enum.Enum):
    """`verify`'s answer for one guard check (a behaviour that must stay correct)."""

    KEPT = "guard kept"
    BROKEN_HERE = "guard broken on this vLLM"
    BROKEN_BY_FIX = "GUARD BROKEN BY FIX"

    def __str__(self) -> str:
        return self.value


# The order summary lines count answers in.
SUMMARY_ORDER = (
    Answer.AFFECTED_FIXED,
    Answer.WOULD_FIX,
    Answer.FIXED_UPSTREAM,
    Answer.NOT_APPLICABLE,
    Answer.REFUSED,
    Answer.FAILED_TO_FIX,
    Answer.CANNOT_CHECK,
    Answer.DISABLED,
    Answer.PENDING,
)
# Always shown in a summary line, even at 0 (the others only when they occur).
SUMMARY_ALWAYS = (Answer.FIXED_UPSTREAM, Answer.REFUSED, Answer.CANNOT_CHECK)


class FixRefused(RuntimeError):
    """Strict mode: a fix could not be applied to this vLLM (refused)."""


class FixFailed(RuntimeError):
    """Strict mode: a fix was applied but its probe still sees the bug (failed to fix)."""


@dataclass
class Decision:
    fix_id: str
    answer: Answer
    reason: str
    before: ProbeReport | None = None
    after: ProbeReport | None = None
    shape: str | None = None
    patch: PatchSet | None = field(default=None, repr=False)

    @property
    def message(self) -> str:
        """The log line (and the text `status` / `verify` show): 'vllm-fix ID: ANSWER: REASON'."""
        return f"vllm-fix {self.fix_id}: {self.answer.value}: {self.reason}"

    def record(self) -> dict[str, str]:
        """The decision as data: the report file's record and the CLI's JSON row start here."""
        return {"fix": self.fix_id, "answer": self.answer.value, "reason": self.reason}

    def log(self) -> None:
        """The one log line of this decision, at its answer's level."""
        get_logger(self.fix_id).log(self.answer.level, "%s", self.message)


def summary_line(vllm: str, decisions: list[Decision]) -> str:
    """One line per vLLM: 'vLLM 0.33.0: 7 fixes — 6 affected → fixed, 1 fixed upstream, ...'."""
    counts = {answer: 0 for answer in SUMMARY_ORDER}
    for d in decisions:
        counts[d.answer] += 1
    parts = [f"{n} {answer.value}" for answer, n in counts.items() if n or answer in SUMMARY_ALWAYS]
    noun = "fix" if len(decisions) == 1 else "fixes"
    return f"vLLM {vllm}: {len(decisions)} {noun} — " + ", ".join(parts)


def disabled(fix: Fix) -> Decision:
    return Decision(fix.id, Answer.DISABLED, "disabled by VLLM_FIXES_DISABLE")


def at_install(fix: Fix, settings: Settings) -> Decision | None:
    """What a process decides when a fix's plugin loads, before its trigger module is imported:
    disabled, not applicable (no trigger module), or None (wait for the import: `pending`)."""
    if settings.is_disabled(fix.id):
        return disabled(fix)
    try:
        present = locate(fix.trigger_module)
    except Exception as exc:  # a broken sys.path entry must not reach vLLM
        return Decision(fix.id, Answer.NOT_APPLICABLE, f"{fix.trigger_module} is {exc!r}")
    if not present:
        return Decision(fix.id, Answer.NOT_APPLICABLE, f"{fix.trigger_module} is not part of this vLLM")
    return None


def pending(fix: Fix) -> Decision:
    return Decision(fix.id, Answer.PENDING, f"waiting for vLLM to import {fix.trigger_module}")


def trigger_failed(fix: Fix, exc: BaseException) -> Decision:
    """The trigger module is part of this vLLM but cannot be imported in this environment (a
    missing dependency, say): vLLM cannot use it here either, so nothing is patched, but the bug
    may well be there; said loudly."""
    return Decision(fix.id, Answer.CANNOT_CHECK, f"{fix.trigger_module} failed to import: {exc!r}")


def _raise_if_strict(settings: Settings, decision: Decision) -> None:
    if not settings.strict:
        return
    if decision.answer is Answer.REFUSED:
        raise FixRefused(decision.message)
    if decision.answer is Answer.FAILED_TO_FIX:
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
        decision.log()
        _raise_if_strict(settings, decision)
    return decision


def _resolve_targets(fix: Fix) -> Decision | None:
    """Answer 2: every required target exists and imports. None when the fix can go on."""
    modules = dict.fromkeys(t.module for t in fix.targets if not t.optional)
    for module in modules:
        if not locate(module):
            return Decision(fix.id, Answer.NOT_APPLICABLE, f"{module} is not part of this vLLM")
    for target in fix.targets:
        if target.optional and not locate(target.module):
            continue
        try:
            target.resolve()
        except AttributeError as exc:
            if target.optional:
                continue
            return Decision(fix.id, Answer.NOT_APPLICABLE, f"{target.path} is not part of this vLLM ({exc})")
        except Exception as exc:  # the module is there but cannot be imported here
            return Decision(fix.id, Answer.CANNOT_CHECK, f"{target.module} failed to import: {exc!r}")
    return None


def _evaluate(fix: Fix, settings: Settings, *, apply: bool, honour_disable: bool) -> Decision:
    if honour_disable and settings.is_disabled(fix.id):
        return disabled(fix)
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
            fix.id,
            Answer.WOULD_FIX,
            _describe_before(before) + f"; shape {shape}",
            before=before,
            shape=shape,
        )
    return _apply_and_verify(fix, before, shape)


def _probe_before(fix: Fix) -> ProbeReport | Decision:
    """Answer 3: does this vLLM have the bug? The report, or the decision that ends the ladder."""
    try:
        before = run_probe(fix)
    except NotApplicable as exc:
        return Decision(fix.id, Answer.NOT_APPLICABLE, str(exc))
    except Exception as exc:
        return Decision(fix.id, Answer.CANNOT_CHECK, f"the probe could not run on this vLLM: {exc!r}")
    if not before.affected:
        return Decision(
            fix.id,
            Answer.FIXED_UPSTREAM,
            "this vLLM already behaves correctly (" + before.summary() + "); nothing patched",
            before=before,
        )
    return before


def _recognize(fix: Fix, before: ProbeReport) -> str | Decision:
    """Answer 4: only known shapes, and only a vLLM that behaves as the fix assumes."""
    seen = "affected, not patched: " + _describe_before(before)
    try:
        shape = fix.run_recognize()
    except NotApplicable as exc:
        return Decision(fix.id, Answer.NOT_APPLICABLE, str(exc), before=before)
    except UnknownShape as exc:
        return Decision(fix.id, Answer.REFUSED, f"{seen}; unknown target shape: {exc}", before=before)
    except Exception as exc:
        return Decision(fix.id, Answer.REFUSED, f"{seen}; the shape check failed: {exc!r}", before=before)
    if before.broken_guards:
        return Decision(
            fix.id,
            Answer.REFUSED,
            f"{seen}; this vLLM does not behave as the fix assumes ({before.summary()})",
            before=before,
        )
    return shape


def _apply_and_verify(fix: Fix, before: ProbeReport, shape: str) -> Decision:
    """Answer 5: apply, probe again through what is installed, keep or revert."""
    patch = PatchSet(fix.id)
    try:
        fix.run_apply(patch, shape)
    except Exception as exc:
        _safe_revert(patch)
        return Decision(
            fix.id, Answer.FAILED_TO_FIX, f"apply raised {exc!r}; reverted", before=before, shape=shape
        )
    try:
        after = run_probe(fix)
    except Exception as exc:
        _safe_revert(patch)
        return Decision(
            fix.id,
            Answer.FAILED_TO_FIX,
            f"probe after apply raised {exc!r}; reverted",
            before=before,
            shape=shape,
        )
    if after.affected or after.broken_guards:
        _safe_revert(patch)
        return Decision(
            fix.id,
            Answer.FAILED_TO_FIX,
            "still affected after apply (" + after.summary() + "); reverted",
            before=before,
            after=after,
            shape=shape,
        )
    return Decision(
        fix.id,
        Answer.AFFECTED_FIXED,
        _describe_before(before) + f"; patched ({shape}) and verified",
        before=before,
        after=after,
        shape=shape,
        patch=patch,
    )


def run_probe(fix: Fix) -> ProbeReport:
    """Run the fix's probe as a guest of this process (see guest.guest: vLLM's records on this
    thread dropped, nothing left behind) with the fixes' own log lines silenced (log.probing)."""
    with guest(), probing():
        return fix.run_probe()


def _safe_revert(patch: PatchSet) -> None:
    try:
        patch.revert()
    except Exception:  # pragma: no cover - reported by the caller's line
        logging.getLogger("vllm.fixes").exception("revert of %s failed", patch.fix_id)
