"""Who owns a MoRIIO READ transfer's blocks once its statuses are polled (spec §3.3).

Pure logic, importable without vLLM. One READ transfer (one request on a decode worker)
is spread over one status per layer (two per KDA layer); a poll of all of them gives a
batch verdict (done / failed / pending), and a pending transfer older than
``recv_abort_timeout`` has timed out.

| outcome  | attention-only (one KV group)                   | hybrid (attention + Mamba/KDA)       |
|----------|-------------------------------------------------|--------------------------------------|
| done     | release once per holder, drop tracking          | same                                 |
| failed   | report the blocks once, release, drop tracking  | fail closed: raise, keep everything  |
| timeout  | report the blocks once, drop tracking           | fail closed: raise, keep everything  |
| pending  | nothing                                         | nothing                              |

Fail closed, because in-flight RDMA may still target both sides: no release (the
producer's watchdog reclaims), no block ids reported (the scheduler's recovery cannot
handle several KV cache groups), tracking kept, and the step raises.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Outcome(str, enum.Enum):
    DONE = "done"
    FAILED = "failed"
    TIMED_OUT = "timed-out"
    PENDING = "pending"


@dataclass(frozen=True)
class Ownership:
    """What the decode worker does with one transfer after a poll."""

    release: bool = False  # send one release to every holder prefill TP rank
    report: bool = False  # hand the local blocks to get_block_ids_with_load_errors
    drop: bool = False  # forget the transfer (statuses, callback addr, start, blocks)
    completed: bool = False  # the transfer id counts as done
    fail_closed: bool = False  # raise TransferError, touch nothing

    @property
    def acts(self) -> bool:
        return self.release or self.report or self.drop or self.fail_closed


WAIT = Ownership()
COMPLETE = Ownership(release=True, drop=True, completed=True)
RECOVER_FAILED = Ownership(release=True, report=True, drop=True)
RECOVER_TIMED_OUT = Ownership(report=True, drop=True)
FAIL_CLOSED = Ownership(fail_closed=True)


def classify(*, has_statuses: bool, done: bool, failed: bool, age: float | None, timeout: float) -> Outcome:
    """The outcome of one poll.

    ``done`` / ``failed`` are the batch verdict (every status succeeded / at least one
    failed); ``age`` is seconds since the first READ of the transfer was posted
    (``None`` if unknown). A transfer without statuses is never done. Timeout is
    strictly older than ``timeout``.
    """
    if failed:
        return Outcome.FAILED
    if done and has_statuses:
        return Outcome.DONE
    if age is not None and age > timeout:
        return Outcome.TIMED_OUT
    return Outcome.PENDING


def ownership(outcome: Outcome, *, hybrid: bool) -> Ownership:
    """The row of the ownership table for one transfer."""
    if outcome is Outcome.DONE:
        return COMPLETE
    if outcome is Outcome.PENDING:
        return WAIT
    if hybrid:
        return FAIL_CLOSED
    return RECOVER_FAILED if outcome is Outcome.FAILED else RECOVER_TIMED_OUT
