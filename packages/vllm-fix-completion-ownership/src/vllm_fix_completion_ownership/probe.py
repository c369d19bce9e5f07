"""Does this vLLM's MultiConnector free a request before / without all of its owners?

Runs the real, installed MultiConnector (scheduler-side and worker-side instances,
built with ``__new__`` plus the attributes its methods read, so no VllmConfig is
needed) over two small fake children and one pickled metadata hop:

* child 0 behaves like MoRIIO's producer hook: it rewrites ``finished_sending`` to
  the ids it holds itself;
* child 1 is an async saver.

Checks (each affected on vLLM 0.32.0 and 0.33.0):

* ``swallowed-completion`` (D1): a request held only by child 1 disappears when child
  0 rewrites the shared output, so it is never freed;
* ``early-completion`` (D2): with the owner information one step late (async
  scheduling), the worker surfaces a request held by both children on child 0's
  report alone, then swallows child 1's;
* ``stray-completion``: a report for a request no child held is surfaced (the
  scheduler already freed it).

Guard: a request held by child 1 only is surfaced on child 1's report.
"""

from __future__ import annotations

import pickle
from types import SimpleNamespace
from typing import Any

from vllm_fix_core import Check, ProbeReport


def _module() -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1 import multi_connector

    return multi_connector


class ProbeChild:
    """A child connector reduced to the completion calls MultiConnector makes."""

    def __init__(self, holds: set[str], rewrites: bool = False) -> None:
        self.holds = holds
        self.rewrites = rewrites
        self.reports: set[str] = set()

    # scheduler side
    def request_finished(self, request: Any, blocks: Any) -> tuple[bool, None]:
        return request.request_id in self.holds, None

    def register_finished_partial_tail(self, request: Any, block_ids: Any, tails: Any) -> bool:
        return False

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        return _module().KVConnectorMetadata()

    def update_connector_output(self, output: Any) -> None:
        if self.rewrites:  # like MoRIIO's producer: keep only what it holds itself
            output.finished_sending = {r for r in output.finished_sending or () if r in self.holds} or None

    # worker side
    def bind_connector_metadata(self, metadata: Any) -> None:
        return None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        sent, self.reports = self.reports, set()
        return _module().KVConnectorTransferResults(finished_sending=sent)


def multi_connector(children: list[Any]) -> Any:
    """A real MultiConnector over `children`, without a VllmConfig."""
    mod = _module()
    mc = mod.MultiConnector.__new__(mod.MultiConnector)
    mc._connectors = list(children)
    mc._requests_to_connector = {}
    mc._extra_async_saves = {}
    mc._all_support_hma = False
    mc._connector_metadata = None
    return mc


def _sent(results: Any) -> set[str]:
    return set(results.finished_sending or ())


def probe() -> ProbeReport:
    mod = _module()
    holds_0 = {"pd"}
    holds_1 = {"pd", "x"}
    sched = multi_connector([ProbeChild(holds_0, rewrites=True), ProbeChild(holds_1)])
    w0, w1 = ProbeChild(holds_0), ProbeChild(holds_1)
    worker = multi_connector([w0, w1])

    # Metadata of step N+1 is built before request_finished(N) runs (async scheduling).
    late = pickle.loads(pickle.dumps(sched.build_connector_meta(SimpleNamespace())))
    for rid in ("pd", "x", "none"):
        sched.request_finished(SimpleNamespace(request_id=rid), [])
    current = pickle.loads(pickle.dumps(sched.build_connector_meta(SimpleNamespace())))

    # Worker, step N+1: child 0's ACK for "pd" lands before the worker knows child 1 holds it.
    worker.bind_connector_metadata(late)
    w0.reports = {"pd"}
    step1 = _sent(worker.get_transfer_results(set()))
    # Step N+2: owner information arrives; child 1 finishes "pd" and "x"; a stray report.
    worker.bind_connector_metadata(current)
    w1.reports = {"pd", "x"}
    w0.reports = {"none"}
    step2 = _sent(worker.get_transfer_results(set()))

    # Scheduler: the workers' "x" (held by child 1 only) must survive child 0's hook.
    out = mod.KVConnectorOutput(finished_sending={"x"})
    sched.update_connector_output(out)
    freed_x = set(out.finished_sending or ())

    early = "pd" in step1 or "pd" not in step2
    return ProbeReport(
        (
            Check(
                "swallowed-completion",
                "x" not in freed_x,
                f"scheduler output after the children's hooks: {sorted(freed_x)}",
            ),
            Check("early-completion", early, f"worker reported {sorted(step1)} then {sorted(step2)}"),
            Check("stray-completion", "none" in step1 | step2, f"worker reported {sorted(step1 | step2)}"),
            Check("single-owner-completes", "x" not in step2, f"worker reported {sorted(step2)}", guard=True),
        )
    )
