"""The owner-set rule, importable without vLLM.

A request R that finished on the scheduler has an owner set O(R): the MultiConnector
children whose ``request_finished*`` returned True for R, plus the children that
accepted ``register_finished_partial_tail`` for R.  R reaches the scheduler's
``finished_sending`` exactly once, at the first step where every owner has completed
on every worker (and, on the scheduler side, no owner holds it back).

Two halves share one wire format:

* :class:`SchedulerLedger` (engine-core process) records O(R), decides what each
  child's private view of the step output holds, collects scheduler-side child
  completions (watchdogs) and says which requests may be freed.  Every step it hands
  the workers an *update* (:func:`encode_update`): owner sets of newly finished
  requests (empty ones included), scheduler-side child completions, and the loader
  child of newly matched requests.
* :class:`WorkerGate` (every worker process) applies those updates and gates the
  children's ``finished_sending`` reports: a report counts only from an owner, a
  report before O(R) is known is buffered per (child, R) and discarded if
  O(R) = {}, and R is reported upward once, when all of O(R) have completed on this
  worker.  ``finished_recving`` / ``failed_recving`` are accepted only from R's
  loader child when the loader is known.

The update is a plain dict of builtins (str, int, tuple, dict) so that a process
without this package can unpickle the metadata object that carries it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

# Instance attribute on MultiKVConnectorMetadata that carries the update. vLLM's
# MultiKVConnectorMetadata is a dataclass pickled with its __dict__, so an extra
# instance attribute survives the trip and an unpatched reader simply ignores it.
META_ATTR = "vllm_fix_completion_ownership"
WIRE_VERSION = 1

# Worker-side memory, in steps (bind_connector_metadata calls).
RETIRED_WINDOW = 1024  # how long a finished request's id is remembered (late/duplicate reports)
EARLY_WINDOW = 1024  # how long a report for a request with unknown owners is kept


def encode_update(
    owners: dict[str, tuple[int, ...]],
    forced: dict[str, tuple[int, ...]],
    loaders: dict[str, int],
) -> dict[str, Any]:
    if not (owners or forced or loaders):
        return EMPTY_UPDATE
    return {"v": WIRE_VERSION, "owners": owners, "forced": forced, "loaders": loaders}


# The update of a step with nothing to ship (nearly every step): one shared object, never
# mutated, so an idle step allocates nothing. Absent keys read as empty.
EMPTY_UPDATE: dict[str, Any] = {"v": WIRE_VERSION}
_NOTHING: dict[str, Any] = {}


class WireError(ValueError):
    """An update this version of the rule cannot read."""


def decode_update(
    update: Any,
) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]], dict[str, int]]:
    if not isinstance(update, dict) or update.get("v") != WIRE_VERSION:
        raise WireError(f"unsupported completion-ownership update: {update!r:.200}")
    return update.get("owners", _NOTHING), update.get("forced", _NOTHING), update.get("loaders", _NOTHING)


_CHILDREN: dict[int, tuple[int, ...]] = {}


def children_of(mask: int) -> tuple[int, ...]:
    """The child indexes in an owner mask (child i is bit ``1 << i``), ascending."""
    children = _CHILDREN.get(mask)
    if children is None:  # first sight of this owner set
        children = tuple(child for child in range(mask.bit_length()) if mask >> child & 1)
        if len(_CHILDREN) < 4096:  # masks of a few children: a handful of entries
            _CHILDREN[mask] = children
    return children


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


class WorkerGate:
    """Worker-side gate over the children's finished_sending / finished_recving."""

    __slots__ = ("early", "expired_reports", "loaders", "pending", "ready", "retired", "step")

    def __init__(self) -> None:
        self.pending: dict[str, set[int]] = {}  # R -> owners not yet complete on this worker
        self.early: OrderedDict[str, tuple[int, set[int]]] = OrderedDict()  # R -> (step, children)
        self.retired: OrderedDict[str, int] = OrderedDict()  # R -> step it was retired
        self.loaders: dict[str, int] = {}  # R -> loader child (until R finishes)
        self.ready: set[str] = set()  # to report upward in the next get_transfer_results
        self.step = 0
        self.expired_reports = 0  # buffered reports dropped after EARLY_WINDOW steps

    def apply_update(self, update: Any) -> None:
        if type(update) is dict and len(update) == 1 and update.get("v") == WIRE_VERSION:
            self.step += 1  # an idle step: nothing shipped
            if self.retired or self.early:
                self._expire()
            return
        owners, forced, loaders = decode_update(update)
        self.step += 1
        if loaders:
            self.loaders.update(loaders)
        for req_id, owner_set in owners.items():
            self._learn_owners(req_id, owner_set)
        for req_id, children in forced.items():
            remaining = self.pending.get(req_id)
            if remaining is None:
                continue  # already reported by this worker: the forced completion is moot
            remaining.difference_update(children)
            if not remaining:
                self._retire(req_id, report=True)
        if self.retired or self.early:
            self._expire()

    def _learn_owners(self, req_id: str, owner_set: tuple[int, ...]) -> None:
        self.loaders.pop(req_id, None)
        if req_id in self.pending:
            return  # the scheduler ships an owner set once per finish: nothing new
        # A retired id finishing again is a new lifetime of a reused request id.
        self.retired.pop(req_id, None)
        early = self.early.pop(req_id, None)
        if not owner_set:
            self._retire(req_id, report=False)  # stray early reports are discarded
            return
        remaining = set(owner_set)
        if early is not None:
            remaining.difference_update(early[1])
        if remaining:
            self.pending[req_id] = remaining
        else:
            self._retire(req_id, report=True)

    def report_sending(self, child: int, req_id: str) -> None:
        remaining = self.pending.get(req_id)
        if remaining is not None:
            if child in remaining:
                remaining.discard(child)
                if not remaining:
                    del self.pending[req_id]
                    self._retire(req_id, report=True)
            return  # non-owner or repeat: ignored
        if req_id in self.retired:
            return  # late or duplicate report for a request this worker already settled
        entry = self.early.get(req_id)
        if entry is None:
            self.early[req_id] = (self.step, {child})
        else:
            entry[1].add(child)

    def report_all(self, child: int, req_ids: Iterable[str]) -> None:
        pending = self.pending
        for req_id in req_ids:
            remaining = pending.get(req_id)
            if remaining is not None and len(remaining) > 1:
                remaining.discard(child)  # fast path: another owner still pending
            else:
                self.report_sending(child, req_id)

    def accepted_recv(self, child: int, req_ids: Iterable[str]) -> Iterable[str]:
        loaders = self.loaders
        if not loaders:
            return req_ids
        return [r for r in req_ids if loaders.get(r, child) == child]

    def accept_recv(self, child: int, req_id: str) -> bool:
        loader = self.loaders.get(req_id)
        return loader is None or loader == child

    def take_ready(self) -> set[str]:
        ready, self.ready = self.ready, set()
        return ready

    def _retire(self, req_id: str, *, report: bool) -> None:
        self.pending.pop(req_id, None)
        if report:
            self.ready.add(req_id)
        self.retired[req_id] = self.step

    def _expire(self) -> None:
        horizon = self.step - RETIRED_WINDOW
        retired = self.retired
        while retired:
            _, step = next(iter(retired.items()))
            if step > horizon:
                break
            retired.popitem(last=False)
        horizon = self.step - EARLY_WINDOW
        early = self.early
        while early:
            _, (step, _) = next(iter(early.items()))
            if step > horizon:
                break
            early.popitem(last=False)
            self.expired_reports += 1

    def size(self) -> int:
        """Entries that belong to live requests (retired ids age out on their own)."""
        return len(self.pending) + len(self.early) + len(self.loaders) + len(self.ready)
