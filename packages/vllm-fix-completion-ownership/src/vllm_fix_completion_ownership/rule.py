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
    return {"v": WIRE_VERSION, "owners": owners, "forced": forced, "loaders": loaders}


class WireError(ValueError):
    """An update this version of the rule cannot read."""


def decode_update(
    update: Any,
) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]], dict[str, int]]:
    if not isinstance(update, dict) or update.get("v") != WIRE_VERSION:
        raise WireError(f"unsupported completion-ownership update: {update!r:.200}")
    return update["owners"], update["forced"], update["loaders"]


class SchedulerLedger:
    """Scheduler-side owner sets, completions and the per-step update for workers."""

    __slots__ = (
        "done",
        "dropped_reports",
        "owners",
        "partial",
        "ship_forced",
        "ship_loaders",
        "ship_owners",
        "workers_done",
    )

    def __init__(self) -> None:
        # R -> owners, for every finished R whose blocks are held and not yet surfaced.
        self.owners: dict[str, frozenset[int]] = {}
        # R -> owners that completed on the scheduler side (their hook let R through,
        # or their watchdog completed it).
        self.done: dict[str, set[int]] = {}
        # R reported by every worker (all owners completed there), not yet surfaced.
        self.workers_done: set[str] = set()
        # R -> children that accepted register_finished_partial_tail (before request_finished).
        self.partial: dict[str, set[int]] = {}
        self.ship_owners: dict[str, tuple[int, ...]] = {}
        self.ship_forced: dict[str, tuple[int, ...]] = {}
        self.ship_loaders: dict[str, int] = {}
        self.dropped_reports = 0  # finished_sending ids for untracked requests (diagnostics)

    # -- request lifecycle ------------------------------------------------------------
    def accept_partial_tail(self, req_id: str, child: int) -> None:
        self.partial.setdefault(req_id, set()).add(child)

    def record_finished(self, req_id: str, holders: Iterable[int]) -> frozenset[int]:
        """R finished; `holders` are the children that asked to keep its blocks."""
        owners = frozenset(holders) | frozenset(self.partial.pop(req_id, ()))
        self.ship_owners[req_id] = tuple(sorted(owners))
        if owners:
            self.owners[req_id] = owners
            self.done[req_id] = set()
        else:
            self._forget(req_id)
        return owners

    def record_loader(self, req_id: str, child: int) -> None:
        self.ship_loaders[req_id] = child

    def take_update(self) -> dict[str, Any]:
        update = encode_update(self.ship_owners, self.ship_forced, self.ship_loaders)
        self.ship_owners, self.ship_forced, self.ship_loaders = {}, {}, {}
        return update

    # -- one scheduler step -----------------------------------------------------------
    def note_workers_done(self, req_ids: Iterable[str]) -> None:
        owners = self.owners
        for req_id in req_ids:
            if req_id in owners:
                self.workers_done.add(req_id)
            else:
                self.dropped_reports += 1

    def offer(self, child: int) -> set[str]:
        """Ids that go into `child`'s private view: reported by every worker, owned by
        `child` and not yet completed by it on the scheduler side."""
        done = self.done
        owners = self.owners
        return {r for r in self.workers_done if child in owners[r] and child not in done[r]}

    def complete(self, child: int, req_id: str) -> bool:
        """`child` lets R go (scheduler side). False if it does not own R."""
        owners = self.owners.get(req_id)
        if owners is None or child not in owners:
            return False
        done = self.done[req_id]
        if child in done:
            return True
        done.add(child)
        if req_id not in self.workers_done:
            # A scheduler-side completion (e.g. a watchdog): the workers' gates must
            # count it too, or they would wait for a report that never comes.
            self.ship_forced[req_id] = (*self.ship_forced.get(req_id, ()), child)
        return True

    def surface(self) -> set[str]:
        """Requests to free now: every worker reported them, every owner completed."""
        if not self.workers_done:
            return set()
        ready = {r for r in self.workers_done if self.done[r] >= self.owners[r]}
        for req_id in ready:
            self._forget(req_id)
        return ready

    def _forget(self, req_id: str) -> None:
        self.owners.pop(req_id, None)
        self.done.pop(req_id, None)
        self.workers_done.discard(req_id)

    def size(self) -> int:
        """Entries held (bounded-growth checks)."""
        return (
            len(self.owners)
            + len(self.done)
            + len(self.workers_done)
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
        self._expire()

    def _learn_owners(self, req_id: str, owner_set: tuple[int, ...]) -> None:
        self.loaders.pop(req_id, None)
        if req_id in self.pending or req_id in self.retired:
            return  # already known (a repeated update): nothing new
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
            req_id, step = next(iter(retired.items()))
            if step > horizon:
                break
            retired.popitem(last=False)
        horizon = self.step - EARLY_WINDOW
        early = self.early
        while early:
            req_id, (step, _) = next(iter(early.items()))
            if step > horizon:
                break
            early.popitem(last=False)
            self.expired_reports += 1

    def size(self) -> int:
        """Entries that belong to live requests (retired ids age out on their own)."""
        return len(self.pending) + len(self.early) + len(self.loaders) + len(self.ready)
