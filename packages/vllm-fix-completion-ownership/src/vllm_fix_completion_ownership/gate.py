"""The worker half of the owner-set rule (every worker process; see ``rule.py``),
importable without vLLM."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from vllm_fix_completion_ownership.rule import WIRE_VERSION, decode_update

# Worker-side memory, in steps (bind_connector_metadata calls).
RETIRED_WINDOW = 1024  # how long a finished request's id is remembered (late/duplicate reports)
EARLY_WINDOW = 1024  # how long a report for a request with unknown owners is kept


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
