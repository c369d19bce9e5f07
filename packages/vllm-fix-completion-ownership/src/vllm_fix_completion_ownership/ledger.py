"""The scheduler half of the owner-set rule (engine-core process; see ``rule.py``),
importable without vLLM."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vllm_fix_completion_ownership.rule import EMPTY_UPDATE, WIRE_VERSION, children_of


class SchedulerLedger:
    """Scheduler-side owner sets, completions and the per-step update for workers.

    This runs in every scheduler step, so it is laid out for the step: owner sets are int
    bit masks (child i is bit ``1 << i``), and what each child still holds back is a set per
    child, so that a child's private view is a copy of its set and a child letting its whole
    view go is one set operation. Every tracked request is in ``entries`` and either in
    ``waiting`` (some worker has not reported it yet) or in the ``held`` set of each owner
    that has not let it go on the scheduler side."""

    __slots__ = (
        "done",
        "dropped_reports",
        "entries",
        "held",
        "partial",
        "ready",
        "ship_forced",
        "ship_loaders",
        "ship_owners",
        "waiting",
    )

    def __init__(self, children: int = 0) -> None:
        # R -> O(R) as a mask, for every finished R whose blocks are held and not yet surfaced.
        self.entries: dict[str, int] = {}
        # R -> the owners that have not completed R on the scheduler side (may be 0), until
        # every worker reported R.
        self.waiting: dict[str, int] = {}
        # Per child: the ids every worker reported that the child owns and still holds back.
        self.held: list[set[str]] = [set() for _ in range(children)]
        self.done: set[str] = set()  # let go by some owner this step (surfaced if by the last)
        self.ready: list[str] = []  # surfaced at the end of this step
        # R -> children that accepted register_finished_partial_tail (before request_finished).
        self.partial: dict[str, set[int]] = {}
        self.ship_owners: dict[str, tuple[int, ...]] = {}
        self.ship_forced: dict[str, tuple[int, ...]] = {}
        self.ship_loaders: dict[str, int] = {}
        self.dropped_reports = 0  # finished_sending ids for untracked requests (diagnostics)

    # -- request lifecycle ------------------------------------------------------------
    def accept_partial_tail(self, req_id: str, child: int) -> None:
        self.partial.setdefault(req_id, set()).add(child)

    def record_finished(self, req_id: str, owners: int) -> tuple[int, ...]:
        """R finished; `owners` is the mask of the children that asked to keep its blocks
        (child i is bit ``1 << i``). Returns O(R), ascending."""
        if self.partial:
            partial = self.partial.pop(req_id, None)
            if partial:
                for child in partial:
                    owners |= 1 << child
        listed = children_of(owners)
        self.ship_owners[req_id] = listed
        entries = self.entries
        if req_id in entries:  # a reused id: its earlier lifetime is over
            self._forget(req_id)
        if owners:
            entries[req_id] = self.waiting[req_id] = owners
            held = self.held
            while owners >> len(held):
                held.append(set())
        return listed

    def record_loader(self, req_id: str, child: int) -> None:
        self.ship_loaders[req_id] = child

    def take_update(self) -> dict[str, Any]:
        """This step's update for the workers (only the non-empty parts; absent ones read as
        empty), or the shared EMPTY_UPDATE."""
        owners, forced, loaders = self.ship_owners, self.ship_forced, self.ship_loaders
        if not (owners or forced or loaders):
            return EMPTY_UPDATE
        update: dict[str, Any] = {"v": WIRE_VERSION}
        if owners:
            update["owners"] = owners
            self.ship_owners = {}
        if forced:
            update["forced"] = forced
            self.ship_forced = {}
        if loaders:
            update["loaders"] = loaders
            self.ship_loaders = {}
        return update

    # -- one scheduler step -----------------------------------------------------------
    def note_workers_done(self, req_ids: Iterable[str]) -> None:
        waiting = self.waiting
        held = self.held
        for req_id in req_ids:
            remaining = waiting.pop(req_id, None)
            if remaining is None:  # untracked, or already reported
                self.dropped_reports += 1
            elif remaining:
                for child in children_of(remaining):
                    held[child].add(req_id)
            else:  # every owner already completed on the scheduler side (watchdogs)
                del self.entries[req_id]
                self.ready.append(req_id)

    def view(self, child: int) -> set[str] | None:
        """A private copy of what `child` may see in this step's output (None: nothing):
        every worker reported it, the child owns it and has not let it go."""
        held = self.held
        mine = held[child] if child < len(held) else None
        return set(mine) if mine else None

    def let_go(self, child: int, returned: set[str]) -> list[str] | None:
        """`child` handed back `returned` (non-empty) from its view: it lets those ids go.
        Returns the ids it does not own (None when there are none)."""
        held = self.held
        mine = held[child] if child < len(held) else None
        # The usual case: exactly what it holds (its view was a copy of it, taken just before).
        if mine and returned == mine:
            self.done |= mine
            mine.clear()
            return None
        return self.complete_all(child, returned) or None

    def complete(self, child: int, req_id: str) -> bool:
        """`child` lets R go (scheduler side). False if it does not own R."""
        return not self.complete_all(child, (req_id,))

    def complete_all(self, child: int, req_ids: Iterable[str]) -> list[str]:
        """`child` lets each of `req_ids` go (scheduler side); returns the ids it does not own."""
        entries = self.entries
        mine = self.held[child] if child < len(self.held) else set()
        bit = 1 << child
        ignored: list[str] = []
        for req_id in req_ids:
            owners = entries.get(req_id)
            if owners is None or not owners & bit:
                ignored.append(req_id)
            elif req_id in mine:
                mine.discard(req_id)
                self.done.add(req_id)
            else:
                remaining = self.waiting.get(req_id)
                if remaining is not None and remaining & bit:
                    # A scheduler-side completion (e.g. a watchdog) before every worker
                    # reported: the workers' gates must count it too, or they would wait for
                    # a report that never comes.
                    self.waiting[req_id] = remaining ^ bit
                    self.ship_forced[req_id] = (*self.ship_forced.get(req_id, ()), child)
        return ignored

    def release(self, req_id: str) -> None:
        """vLLM frees R through its finished_recving path (a finished request whose load
        completed): stop tracking R, and let the workers' gates settle it too."""
        remaining = self._forget(req_id)
        if remaining:
            self.ship_forced[req_id] = (*self.ship_forced.get(req_id, ()), *children_of(remaining))

    def _forget(self, req_id: str) -> int:
        """Stop tracking R; returns the owners that had not let it go (a mask)."""
        if self.entries.pop(req_id, None) is None:
            return 0
        remaining = self.waiting.pop(req_id, None)
        if remaining is None:
            remaining = 0
            for child, mine in enumerate(self.held):
                if req_id in mine:
                    mine.discard(req_id)
                    remaining |= 1 << child
        self.done.discard(req_id)
        return remaining

    def surface(self) -> set[str]:
        """Requests to free now: every worker reported them, every owner let them go."""
        done = self.done
        if not done:
            ready = set(self.ready)
            self.ready = []
            return ready
        self.done = set()
        entries = self.entries
        freed = done.difference(*self.held)  # let go by their last owner
        for req_id in freed:
            del entries[req_id]
        if self.ready:
            freed.update(self.ready)
            self.ready = []
        return freed

    def size(self) -> int:
        """Entries held (bounded-growth checks)."""
        return (
            len(self.entries)
            + len(self.waiting)
            + sum(map(len, self.held))
            + len(self.done)
            + len(self.ready)
            + len(self.partial)
            + len(self.ship_owners)
            + len(self.ship_forced)
            + len(self.ship_loaders)
        )
