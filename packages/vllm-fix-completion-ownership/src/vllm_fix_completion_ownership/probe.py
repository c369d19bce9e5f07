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

Checks (each affected on every vLLM release 0.14.1-0.33.0, the partial tail on 0.30.0+):

* ``swallowed-completion`` (D1): a request held only by child 1 disappears when child 0
  rewrites the shared output, so it is never freed;
* ``early-completion`` (D2): with the owner information one step late (async scheduling),
  the worker surfaces a request held by both children on child 0's report alone, then
  swallows child 1's;
* ``stray-completion``: a report for a request no child held is surfaced (the scheduler
  already freed it);
* ``stray-recving``: child 1 is the loader of a request (its ``get_num_new_matched_tokens``
  matched tokens, child 0's did not, so the scheduler-side MultiConnector assigned the
  request to child 1); a ``finished_recving`` report for it from child 0 is surfaced by the
  worker, which would tell the scheduler the load is done while child 1 still writes;
* ``partial-tail-owner-ignored`` (D4, vLLM 0.30.0+, where ``register_finished_partial_tail``
  exists): child 1 accepted the request's partial tail through the MultiConnector (its
  ``request_finished`` says False), child 0 holds it too; the worker surfaces the request on
  child 0's report alone, while child 1 still saves the tail.

Guards: a request held by child 1 only is surfaced on child 1's report; the loader's own
``finished_recving`` report is surfaced; the partial-tail request is surfaced once child 1
reports it too.
"""

from __future__ import annotations

import functools
import inspect
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

    def register_finished_partial_tail(self: Any, request: Any, block_ids: Any, offloads: Any) -> bool:
        return request.request_id in self.tail

    def get_finished(self: Any, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sent, self.reports = self.reports, set()
        recv, self.recving = self.recving, set()
        return sent or None, recv or None

    def get_transfer_results(self: Any, finished_req_ids: set[str]) -> Any:
        sent, self.reports = self.reports, set()
        recv, self.recving = self.recving, set()
        return mod.KVConnectorTransferResults(finished_sending=sent, finished_recving=recv)

    body: dict[str, Any] = {name: noop for name in getattr(KVConnectorBase_V1, "__abstractmethods__", ())}
    body.update(
        request_finished=request_finished,
        get_num_new_matched_tokens=get_num_new_matched_tokens,
        build_connector_meta=build_connector_meta,
        update_connector_output=update_connector_output,
        register_finished_partial_tail=register_finished_partial_tail,
        get_finished=get_finished,
        __module__=__name__,
    )
    if hasattr(mod, "KVConnectorTransferResults"):  # vLLM 0.30.0+
        body["get_transfer_results"] = get_transfer_results
    return type("ProbeChild", (KVConnectorBase_V1,), body)


def probe_child(
    holds: set[str],
    rewrites: bool = False,
    *,
    matches: dict[str, int] | None = None,
    tail: frozenset[str] = frozenset(),
) -> Any:
    """A child holding the blocks of `holds` (request_finished says True for them), matching
    `matches` external tokens per request and accepting the partial tails of `tail`."""
    cls: Any = child_class()
    child = cls.__new__(cls)
    child._connector_metadata = None
    child.holds = holds
    child.rewrites = rewrites
    child.reports = set()
    child.recving = set()
    child.matches = matches or {}
    child.tail = tail
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


@functools.lru_cache(maxsize=1)
def _request_extra_arguments() -> tuple[tuple[str, None], ...]:
    """Required Request parameters beyond the four every release takes, read from the
    installed signature (vLLM 0.14.1-0.16.0 also require ``eos_token_id: int | None``): each
    one whose annotation admits None gets None. Any other required parameter is left out, so
    vLLM's own TypeError says what this release needs ("cannot check")."""
    from vllm.v1.request import Request

    extra: list[tuple[str, None]] = []
    for name, param in inspect.signature(Request.__init__).parameters.items():
        if name in _REQUEST_BASE or name == "self" or param.default is not inspect.Parameter.empty:
            continue
        if param.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        if "None" in str(param.annotation) or "Optional" in str(param.annotation):
            extra.append((name, None))
    return tuple(extra)


_REQUEST_BASE = frozenset({"request_id", "prompt_token_ids", "sampling_params", "pooling_params"})


def request(req_id: str) -> Any:
    """A real vLLM Request (vLLM's own constructor, with the installed signature)."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(
        request_id=req_id,
        prompt_token_ids=[1, 2, 3],
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        **dict(_request_extra_arguments()),
    )


def scheduler_output() -> Any:
    from vllm.v1.core.sched.output import SchedulerOutput

    return SchedulerOutput.make_empty()


def worker_results(worker: Any) -> set[str]:
    """What vLLM's model runner reads from the worker-side connector this step: the
    finished_sending ids, plus each finished_recving id as ``"recv:<id>"``."""
    if hasattr(worker, "get_transfer_results"):  # vLLM 0.30.0+
        results = worker.get_transfer_results(set())
        sending, recving = results.finished_sending, results.finished_recving
    else:
        sending, recving = worker.get_finished(set())
    return set(sending or ()) | {f"recv:{r}" for r in recving or ()}


def probe() -> ProbeReport:
    mod = _module()
    holds_0 = {"pd", "tail"}
    holds_1 = {"pd", "x"}
    sched = multi_connector(
        [
            probe_child(holds_0, rewrites=True),
            probe_child(holds_1, matches={"load": 16}, tail=frozenset({"tail"})),
        ]
    )
    w0, w1 = probe_child(holds_0), probe_child(holds_1)
    worker = multi_connector([w0, w1])

    # "load" is scheduled with external tokens: child 1 is the one that matched, its loader.
    sched.get_num_new_matched_tokens(request("load"), 0)
    # Metadata of step N+1 is built before request_finished(N) runs (async scheduling).
    late = pickle.loads(pickle.dumps(sched.build_connector_meta(scheduler_output())))
    # vLLM's scheduler registers a finished request's partial tail before request_finished;
    # "tail" is held by child 0 (request_finished) and by child 1 (its partial tail).
    has_tail = hasattr(mod.MultiConnector, "register_finished_partial_tail")  # vLLM 0.30.0+
    tail = request("tail")
    if has_tail:
        sched.register_finished_partial_tail(tail, ([],), [(0, 0, 1)])
    for req in (request("pd"), request("x"), request("none"), tail):
        sched.request_finished(req, [])
    current = pickle.loads(pickle.dumps(sched.build_connector_meta(scheduler_output())))
    following = pickle.loads(pickle.dumps(sched.build_connector_meta(scheduler_output())))

    # Worker, step N+1: child 0's ACK for "pd" lands before the worker knows child 1 holds it;
    # child 0, which does not load "load", reports it received.
    worker.bind_connector_metadata(late)
    w0.reports = {"pd"}
    w0.recving = {"load"}
    step1 = worker_results(worker)
    # Step N+2: owner information arrives; child 1 finishes "pd" and "x" and loads "load";
    # child 0 finishes "tail" (child 1 still saves its partial tail); a stray report.
    worker.bind_connector_metadata(current)
    w1.reports = {"pd", "x"}
    w1.recving = {"load"}
    w0.reports = {"none", "tail"}
    step2 = worker_results(worker)
    # Step N+3: child 1 finishes the partial tail.
    worker.bind_connector_metadata(following)
    w1.reports = {"tail"}
    step3 = worker_results(worker)

    # Scheduler: the workers' "x" (held by child 1 only) must survive child 0's hook.
    out = mod.KVConnectorOutput(finished_sending={"x"})
    sched.update_connector_output(out)
    freed_x = set(out.finished_sending or ())

    early = "pd" in step1 or "pd" not in step2
    seen = f"worker reported {sorted(step1)}, {sorted(step2)}, {sorted(step3)}"
    return ProbeReport(
        (
            Check(
                "swallowed-completion",
                "x" not in freed_x,
                f"scheduler output after the children's hooks: {sorted(freed_x)}",
            ),
            Check("early-completion", early, f"worker reported {sorted(step1)} then {sorted(step2)}"),
            Check("stray-completion", "none" in step1 | step2, seen),
            Check("stray-recving", "recv:load" in step1, seen),
            Check(
                "partial-tail-owner-ignored",
                has_tail and "tail" in step2,
                seen if has_tail else "no register_finished_partial_tail in this vLLM",
            ),
            Check("single-owner-completes", "x" not in step2, seen, guard=True),
            Check("loader-recving-completes", "recv:load" not in step1 | step2, seen, guard=True),
            Check("partial-tail-completes", has_tail and "tail" not in step2 | step3, seen, guard=True),
        )
    )
