"""Per-process runtime: what the vLLM plugin entry points call."""

from __future__ import annotations

import json
import os
import sys
import threading
from types import ModuleType

from vllm_fix_core.declaration import Fix
from vllm_fix_core.environment import register_switches
from vllm_fix_core.hooks import when_imported
from vllm_fix_core.ladder import Answer, Decision, at_install, evaluate, pending, trigger_failed
from vllm_fix_core.log import get_logger
from vllm_fix_core.settings import REPORT_ENV, Settings, unknown_ids_message

_lock = threading.RLock()
_decisions: dict[str, Decision] = {}


def decisions() -> dict[str, Decision]:
    """This process's decision per fix id (a copy)."""
    with _lock:
        return dict(_decisions)


def _store(decision: Decision) -> Decision:
    with _lock:
        _decisions[decision.fix_id] = decision
        report(decision)
    return decision


_warned_report = False


def report_record(decision: Decision) -> dict[str, object]:
    """The report file's record of one decision: which process decided what."""
    import multiprocessing

    return {
        "pid": os.getpid(),
        "process": multiprocessing.current_process().name,
        "argv0": os.path.basename(sys.argv[0]) if sys.argv else "",
        **decision.record(),
    }


def report(decision: Decision) -> None:
    """Append the decision as one JSON line to $VLLM_FIXES_REPORT (unset: nothing is written).

    The line goes out in one write on a file opened for appending, so the lines of the
    processes vLLM starts never interleave. A path that cannot be written is one WARNING per
    process (the decision is still in the log); each later decision tries the path again, so
    nothing is lost once it can be written. An audit file never breaks vLLM.
    """
    global _warned_report
    path = os.environ.get(REPORT_ENV)
    if not path:
        return
    line = (json.dumps(report_record(decision), ensure_ascii=False) + "\n").encode("utf-8")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
    except OSError as exc:
        with _lock:
            if _warned_report:
                return
            _warned_report = True
        get_logger("report").warning(
            "%s=%s cannot be written (%s): this process's decisions are not in the report "
            "(they are still logged); said once per process",
            REPORT_ENV,
            path,
            exc.strerror or exc,
        )


def install(fix: Fix, settings: Settings | None = None) -> Decision:
    """The body of every fix's `vllm.general_plugins` entry point.

    Decides now if the trigger module is already imported, otherwise when vLLM
    imports it. Never raises into vLLM's plugin loader unless strict mode is on.
    """
    register_switches()
    settings = settings or Settings.from_env()  # an invalid strict value raises: loud, not "off"
    _warn_unknown_ids(settings)
    with _lock:
        current = _decisions.get(fix.id)
        if current is not None and current.answer in (Answer.AFFECTED_FIXED, Answer.PENDING):
            return current  # applying twice is a no-op
    early = at_install(fix, settings)
    if early is not None:
        early.log()
        return _store(early)

    def on_loaded(_module: ModuleType) -> None:
        _store(evaluate(fix, settings, apply=True))

    def on_failed(exc: BaseException) -> None:
        decision = trigger_failed(fix, exc)
        decision.log()
        _store(decision)

    _store(pending(fix))
    when_imported(fix.trigger_module, on_loaded, on_failed)
    return decisions()[fix.id]


_warned_unknown = False


def _warn_unknown_ids(settings: Settings) -> None:
    """One WARNING per process when the disable switch names an id no installed fix has."""
    global _warned_unknown
    if _warned_unknown or not settings.disabled:
        return
    _warned_unknown = True
    from vllm_fix_core.registry import installed_ids

    valid = installed_ids()
    unknown = settings.unknown_ids(valid)
    if unknown:
        get_logger("settings").warning("%s", unknown_ids_message(unknown, valid))


def apply(fix: Fix, settings: Settings | None = None) -> Decision:
    """Import the targets and run the ladder now (tests, verify)."""
    settings = settings or Settings.from_env()
    with _lock:
        current = _decisions.get(fix.id)
        if current is not None and current.answer is Answer.AFFECTED_FIXED:
            return current
    return _store(evaluate(fix, settings, apply=True))


def revert(fix: Fix | str) -> bool:
    """Undo what this process applied for `fix`; True if something was reverted."""
    fix_id = fix if isinstance(fix, str) else fix.id
    with _lock:
        decision = _decisions.pop(fix_id, None)
    if decision is None or decision.patch is None:
        return False
    decision.patch.revert()
    return True


__all__ = ["apply", "decisions", "install", "report", "report_record", "revert"]
