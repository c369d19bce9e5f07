"""Bind outcomes of listener threads, waited on (bounded) by the thread that started them.

No vLLM imports. A listener thread reports exactly once: bound, or the exception its
bind raised. The initializing thread waits for that report instead of waiting forever
for an event the dead thread will never set.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass


@dataclass(frozen=True)
class Outcome:
    address: str
    error: BaseException | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


_cond = threading.Condition()
_outcomes: weakref.WeakKeyDictionary[threading.Thread, Outcome] = weakref.WeakKeyDictionary()


def report(outcome: Outcome, thread: threading.Thread | None = None) -> None:
    """Record the bind outcome of `thread` (default: the calling thread); first report wins."""
    thread = thread or threading.current_thread()
    with _cond:
        _outcomes.setdefault(thread, outcome)
        _cond.notify_all()


def outcome_of(thread: threading.Thread | None) -> Outcome | None:
    if thread is None:
        return None
    with _cond:
        return _outcomes.get(thread)


def wait_for(thread: threading.Thread, timeout: float) -> Outcome | None:
    """The outcome `thread` reports within `timeout` s; None if it neither reports nor dies.

    A thread that dies without reporting gets an Outcome with a RuntimeError.
    """
    deadline = time.monotonic() + timeout
    with _cond:
        while True:
            found = _outcomes.get(thread)
            if found is not None:
                return found
            if not thread.is_alive() and thread.ident is not None:
                return Outcome("", RuntimeError(f"thread {thread.name!r} exited before binding"))
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            _cond.wait(min(left, 0.05))
