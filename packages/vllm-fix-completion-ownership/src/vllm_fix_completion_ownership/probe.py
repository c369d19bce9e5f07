"""Does this vLLM's MultiConnector free a request before / without all of its owners?

Runs the installed MultiConnector, as it is in the process (whatever wraps or replaces its
methods), with one scheduler-side and one worker-side instance over two small children and
one pickled metadata hop, the way vLLM's engine core and a worker use it:

* child 0 behaves like MoRIIO's producer hook: it rewrites ``finished_sending`` to the ids
  it holds itself;
* child 1 is an async saver.

The children are subclasses of vLLM's own ``KVConnectorBase_V1`` (every method the probe
does not need keeps vLLM's default), the requests are real ``Request`` objects and the
scheduler output is vLLM's ``SchedulerOutput.make_empty()``. The MultiConnector itself is
made with ``__new__`` plus the three attributes its completion methods read
(``_connectors``, ``_requests_to_connector``, ``_extra_async_saves``): its constructor
needs a whole ``VllmConfig`` and instantiates the configured connectors.

Checks (each affected on every vLLM release 0.24.0-0.33.0):

* ``swallowed-completion`` (D1): a request held only by child 1 disappears when child 0
  rewrites the shared output, so it is never freed;
* ``early-completion`` (D2): with the owner information one step late (async scheduling),
  the worker surfaces a request held by both children on child 0's report alone, then
  swallows child 1's;
* ``stray-completion``: a report for a request no child held is surfaced (the scheduler
  already freed it).

Guard: a request held by child 1 only is surfaced on child 1's report.
"""

from __future__ import annotations

import functools
import pickle
from typing import Any

from vllm_fix_core import Check, ProbeReport

MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.multi_connector"


def _module() -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1 import multi_connector

    return multi_connector


@functools.lru_cache(maxsize=1)
def child_class() -> type:
    """A KVConnectorBase_V1 child reduced to the completion calls MultiConnector makes."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    mod = _module()

    def noop(self: Any, *args: Any, **kwargs: Any) -> None:
        return None

    def request_finished(self: Any, request: Any, blocks: Any) -> tuple[bool, None]:
        return request.request_id in self.holds, None

    def get_num_new_matched_tokens(self: Any, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return self.matches.get(request.request_id, 0), False

    def build_connector_meta(self: Any, scheduler_output: Any) -> Any:
        return mod.KVConnectorMetadata()

    def update_connector_output(self: Any, output: Any) -> None:
        if self.rewrites:  # like MoRIIO's producer: keep only what it holds itself
            output.finished_sending = {r for r in output.finished_sending or () if r in self.holds} or None

    def get_finished(self: Any, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sent, self.reports = self.reports, set()
        return sent or None, None

    def get_transfer_results(self: Any, finished_req_ids: set[str]) -> Any:
        sent, self.reports = self.reports, set()
        return mod.KVConnectorTransferResults(finished_sending=sent)

    body: dict[str, Any] = {name: noop for name in getattr(KVConnectorBase_V1, "__abstractmethods__", ())}
    body.update(
        request_finished=request_finished,
        get_num_new_matched_tokens=get_num_new_matched_tokens,
        build_connector_meta=build_connector_meta,
        update_connector_output=update_connector_output,
        get_finished=get_finished,
        __module__=__name__,
    )
    if hasattr(mod, "KVConnectorTransferResults"):  # vLLM 0.30.0+
        body["get_transfer_results"] = get_transfer_results
    return type("ProbeChild", (KVConnectorBase_V1,), body)


def probe_child(holds: set[str], rewrites: bool = False) -> Any:
    """A child holding the blocks of `holds` (request_finished says True for them)."""
    cls: Any = child_class()
    child = cls.__new__(cls)
    child._connector_metadata = None
    child.holds = holds
    child.rewrites = rewrites
    child.reports = set()
    child.matches = {}
    return child


def multi_connector(children: list[Any]) -> Any:
    """vLLM's MultiConnector over `children` (no VllmConfig: the attributes its completion
    methods read are set as its constructor sets them)."""
    mod = _module()
    mc = mod.MultiConnector.__new__(mod.MultiConnector)
    mc._connector_metadata = None
    mc._connectors = list(children)
    mc._requests_to_connector = {}
    mc._extra_async_saves = {}
    return mc


def request(req_id: str) -> Any:
    """A real vLLM Request (vLLM's own constructor)."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(
        request_id=req_id,
        prompt_token_ids=[1, 2, 3],
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
    )


def scheduler_output() -> Any:
    from vllm.v1.core.sched.output import SchedulerOutput

    return SchedulerOutput.make_empty()


def worker_results(worker: Any) -> set[str]:
    """What vLLM's model runner reads from the worker-side connector this step."""
    if hasattr(worker, "get_transfer_results"):  # vLLM 0.30.0+
        return set(worker.get_transfer_results(set()).finished_sending or ())
    sending, _ = worker.get_finished(set())
    return set(sending or ())


def probe() -> ProbeReport:
    mod = _module()
    holds_0 = {"pd"}
    holds_1 = {"pd", "x"}
    sched = multi_connector([probe_child(holds_0, rewrites=True), probe_child(holds_1)])
    w0, w1 = probe_child(holds_0), probe_child(holds_1)
    worker = multi_connector([w0, w1])

    # Metadata of step N+1 is built before request_finished(N) runs (async scheduling).
    late = pickle.loads(pickle.dumps(sched.build_connector_meta(scheduler_output())))
    for rid in ("pd", "x", "none"):
        sched.request_finished(request(rid), [])
    current = pickle.loads(pickle.dumps(sched.build_connector_meta(scheduler_output())))

    # Worker, step N+1: child 0's ACK for "pd" lands before the worker knows child 1 holds it.
    worker.bind_connector_metadata(late)
    w0.reports = {"pd"}
    step1 = worker_results(worker)
    # Step N+2: owner information arrives; child 1 finishes "pd" and "x"; a stray report.
    worker.bind_connector_metadata(current)
    w1.reports = {"pd", "x"}
    w0.reports = {"none"}
    step2 = worker_results(worker)

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
