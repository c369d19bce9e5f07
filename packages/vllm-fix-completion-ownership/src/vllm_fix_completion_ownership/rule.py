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


class _Entry:
    """One finished request whose blocks are held: its owners and who is still pending."""

    __slots__ = ("owners", "remaining", "workers_done")

    def __init__(self, owners: tuple[int, ...]) -> None:
        self.owners = owners
        self.remaining = set(owners)  # owners that have not completed on the scheduler side
        self.workers_done = False  # every worker reported it (all owners completed there)


class SchedulerLedger:
    """Scheduler-side owner sets, completions and the per-step update for workers."""

    __slots__ = (
        "dropped_reports",
        "entries",
        "partial",
        "ready",
        "reported",
        "ship_forced",
        "ship_loaders",
        "ship_owners",
    )

    def __init__(self) -> None:
        # R -> entry, for every finished R whose blocks are held and not yet surfaced.
        self.entries: dict[str, _Entry] = {}
        # The entries every worker reported that some owner still holds back.
        self.reported: dict[str, _Entry] = {}
        self.ready: list[str] = []  # to surface at the end of this step
        # R -> children that accepted register_finished_partial_tail (before request_finished).
        self.partial: dict[str, set[int]] = {}
        self.ship_owners: dict[str, tuple[int, ...]] = {}
        self.ship_forced: dict[str, tuple[int, ...]] = {}
        self.ship_loaders: dict[str, int] = {}
        self.dropped_reports = 0  # finished_sending ids for untracked requests (diagnostics)

    # -- request lifecycle ------------------------------------------------------------
    def accept_partial_tail(self, req_id: str, child: int) -> None:
        self.partial.setdefault(req_id, set()).add(child)

    def record_finished(self, req_id: str, holders: list[int]) -> tuple[int, ...]:
        """R finished; `holders` are the children that asked to keep its blocks, in child
        order (each child is asked once, in order). Returns O(R), ascending."""
        owners = tuple(holders)
        if self.partial:
            partial = self.partial.pop(req_id, None)
            if partial:
                owners = tuple(sorted(partial.union(owners)))
        self.ship_owners[req_id] = owners
        if owners:
            self.entries[req_id] = _Entry(owners)
        else:
            self.entries.pop(req_id, None)
            self.reported.pop(req_id, None)
        return owners

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
        entries = self.entries
        for req_id in req_ids:
            entry = entries.get(req_id)
            if entry is None or entry.workers_done:
                self.dropped_reports += 1
                continue
            entry.workers_done = True
            if entry.remaining:
                self.reported[req_id] = entry
            else:  # every owner already completed on the scheduler side (watchdogs)
                del entries[req_id]
                self.ready.append(req_id)

    def step_views(self, incoming: Iterable[str] | None) -> dict[int, set[str]] | None:
        """One scheduler step: note the workers' reports and return the children's private
        views, or None when no child has anything to see."""
        if incoming:
            self.note_workers_done(incoming)
        return self.offers() if self.reported else None

    def offers(self) -> dict[int, set[str]]:
        """Per child, the ids for its private view: reported by every worker, owned by
        the child and not yet completed by it on the scheduler side."""
        out: dict[int, set[str]] = {}
        for req_id, entry in self.reported.items():
            for child in entry.remaining:
                view = out.get(child)
                if view is None:
                    out[child] = {req_id}
                else:
                    view.add(req_id)
        return out

    def offer(self, child: int) -> set[str]:
        return self.offers().get(child, set())

    def complete(self, child: int, req_id: str) -> bool:
        """`child` lets R go (scheduler side). False if it does not own R."""
        entry = self.entries.get(req_id)
        if entry is None or child not in entry.owners:
            return False
        remaining = entry.remaining
        if child not in remaining:
            return True
        remaining.discard(child)
        if not entry.workers_done:
            # A scheduler-side completion (e.g. a watchdog): the workers' gates must
            # count it too, or they would wait for a report that never comes.
            self.ship_forced[req_id] = (*self.ship_forced.get(req_id, ()), child)
        elif not remaining:
            del self.entries[req_id]
            del self.reported[req_id]
            self.ready.append(req_id)
        return True

    def release(self, req_id: str) -> None:
        """vLLM frees R through its finished_recving path (a finished request whose load
        completed): stop tracking R, and let the workers' gates settle it too."""
        entry = self.entries.pop(req_id, None)
        if entry is None:
            return
        self.reported.pop(req_id, None)
        if entry.remaining:
            self.ship_forced[req_id] = (*self.ship_forced.get(req_id, ()), *sorted(entry.remaining))
        if req_id in self.ready:
            self.ready.remove(req_id)

    def complete_all(self, child: int, req_ids: Iterable[str]) -> list[str]:
        """`complete` for each id (written out: this runs every step); returns the ids
        `child` does not own."""
        entries = self.entries
        ignored: list[str] = []
        for req_id in req_ids:
            entry = entries.get(req_id)
            if entry is None or child not in entry.owners:
                ignored.append(req_id)
                continue
            remaining = entry.remaining
            if child not in remaining:
                continue
            remaining.discard(child)
            if not entry.workers_done:
                self.ship_forced[req_id] = (*self.ship_forced.get(req_id, ()), child)
            elif not remaining:
                del entries[req_id]
                del self.reported[req_id]
                self.ready.append(req_id)
        return ignored

    def surface(self) -> set[str]:
        """Requests to free now: every worker reported them, every owner completed."""
        if not self.ready:
            return set()
        ready = set(self.ready)
        self.ready = []
        return ready

    def size(self) -> int:
        """Entries held (bounded-growth checks)."""
        return (
            len(self.entries)
            + len(self.reported)
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
