"""Real vLLM: the patched MultiConnector entry points never raise where vLLM's own do not.

A random script of scheduler and worker calls (the shapes vLLM's own types allow, ``None`` for
the optional fields included) runs on an unpatched scheduler/worker pair, then, with the fix
applied, on a fresh pair. The children answer from the script, so both runs see the same
answers. An exception vLLM raises may stay (the patched run stops there too); the patched run
must not raise at any call before it.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_fix_completion_ownership import FIX
from vllm_fix_completion_ownership.patch import recognize
from vllm_fix_completion_ownership.probe import child_class, multi_connector, probe_child, request
from vllm_fix_completion_ownership.shapes import PER_STEP_KNOWN
from vllm_fix_core import PatchSet

CHILDREN = 2
IDS = st.sampled_from(["a", "b", "c", "d"])
ID_SET = st.sets(IDS, max_size=3)
OPT_SET = st.none() | ID_SET
PARAMS = st.none() | st.dictionaries(st.sampled_from(["k1", "k2", "k3"]), st.integers(0, 3), max_size=2)

# One call each; per-child answers are drawn along with it.
OPS = st.one_of(
    st.tuples(
        st.just("match"),
        IDS,
        st.integers(0, 64),
        st.lists(
            st.tuples(st.none() | st.integers(0, 48), st.booleans()), min_size=CHILDREN, max_size=CHILDREN
        ),
    ),
    st.tuples(st.just("tail"), IDS, st.lists(st.booleans(), min_size=CHILDREN, max_size=CHILDREN)),
    st.tuples(
        st.just("finish"),
        IDS,
        st.lists(st.tuples(st.booleans(), PARAMS), min_size=CHILDREN, max_size=CHILDREN),
    ),
    st.tuples(st.just("meta")),
    st.tuples(
        st.just("plain-meta"),
        st.none() | st.dictionaries(IDS, st.integers(1, 2), max_size=2),
    ),
    st.tuples(
        st.just("worker"),
        st.lists(st.tuples(ID_SET, ID_SET, ID_SET), min_size=CHILDREN, max_size=CHILDREN),
    ),
    st.tuples(
        st.just("output"),
        OPT_SET,
        OPT_SET,
        ID_SET,
        st.booleans(),
        st.lists(st.tuples(st.booleans(), OPT_SET, OPT_SET), min_size=CHILDREN, max_size=CHILDREN),
    ),
)


def scripted_class() -> type:
    class Scripted(child_class()):  # type: ignore[misc]
        """A child that answers what the script says for the current call."""

        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
            return self.answer

        def request_finished(self, request: Any, blocks: Any) -> Any:
            return self.answer

        def register_finished_partial_tail(self, request: Any, block_ids: Any, offloads: Any) -> Any:
            return self.answer

        def update_connector_output(self, output: Any) -> None:
            edit, sending, recving = self.answer
            if edit:  # a child may rewrite the fields it is shown
                output.finished_sending = sending
                output.finished_recving = recving

        def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
            sending, recving, failed = self.answer
            results = super().get_transfer_results(finished_req_ids)
            results.finished_sending, results.finished_recving = set(sending), set(recving)
            results.failed_recving = set(failed)
            return results

        def get_finished(self, finished_req_ids: set[str]) -> Any:
            sending, recving, _ = self.answer
            return set(sending) or None, set(recving) or None

    return Scripted


def pair() -> tuple[Any, Any]:
    cls = scripted_class()

    def child() -> Any:
        c = probe_child(set())
        c.__class__ = cls
        c.answer = None
        return c

    sched = multi_connector([child() for _ in range(CHILDREN)])
    return sched, multi_connector([child() for _ in range(CHILDREN)])


def mod() -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1 import multi_connector as m

    return m


def step(sched: Any, worker: Any, op: tuple[Any, ...]) -> None:
    from vllm.v1.core.sched.output import SchedulerOutput

    m = mod()
    kind = op[0]
    if kind == "match":
        for child, answer in zip(sched._connectors, op[3], strict=True):
            child.answer = answer
        sched.get_num_new_matched_tokens(request(op[1]), op[2])
    elif kind == "tail":
        if not hasattr(m.MultiConnector, "register_finished_partial_tail"):  # vLLM 0.30.0+
            return
        for child, answer in zip(sched._connectors, op[2], strict=True):
            child.answer = answer
        sched.register_finished_partial_tail(request(op[1]), ([1, 2],), [(0, 0, 1)])
    elif kind == "finish":
        for child, answer in zip(sched._connectors, op[2], strict=True):
            child.answer = (answer[0], dict(answer[1]) if answer[1] is not None else None)
        sched.request_finished(request(op[1]), [1, 2])
    elif kind == "meta":
        for child in sched._connectors:
            child.answer = None
        metadata = sched.build_connector_meta(SchedulerOutput.make_empty())
        worker.bind_connector_metadata(pickle.loads(pickle.dumps(metadata)))
    elif kind == "plain-meta":  # what an unpatched scheduler process sends
        children = tuple(m.KVConnectorMetadata() for _ in range(CHILDREN))
        worker.bind_connector_metadata(m.MultiKVConnectorMetadata(metadata=children, extra_async_saves=op[1]))
    elif kind == "worker":
        for child, answer in zip(worker._connectors, op[1], strict=True):
            child.answer = answer
        if hasattr(worker, "get_transfer_results"):
            worker.get_transfer_results(set())
        else:
            worker.get_finished(set())
    else:
        _, sending, recving, failed, with_meta, edits = op
        from vllm.v1.outputs import KVConnectorOutput

        out = KVConnectorOutput(finished_sending=sending, finished_recving=recving)
        if hasattr(out, "failed_recving"):  # vLLM 0.30.0+
            out.failed_recving = set(failed)
        if with_meta and hasattr(m, "MultiKVConnectorWorkerMetadata"):  # vLLM 0.18.1+
            out.kv_connector_worker_meta = m.MultiKVConnectorWorkerMetadata(metadata=(None,) * CHILDREN)
        for child, answer in zip(sched._connectors, edits, strict=True):
            child.answer = answer
        sched.update_connector_output(out)


def run(script: list[tuple[Any, ...]]) -> tuple[int, BaseException | None]:
    """Calls made before the first exception, and that exception (None: the script finished)."""
    sched, worker = pair()
    for index, op in enumerate(script):
        try:
            step(sched, worker, op)
        except Exception as exc:  # compared with the other run
            return index, exc
    return len(script), None


def patched_run(script: list[tuple[Any, ...]], wrapped: bool = False) -> tuple[int, BaseException | None]:
    """`run` with the fix applied; `wrapped`: the per-step methods wrapped instead of
    re-implemented (as where vLLM's body has an unknown fingerprint)."""
    known = dict(PER_STEP_KNOWN)
    if wrapped:
        PER_STEP_KNOWN.update(dict.fromkeys(known, frozenset()))
    patch = PatchSet(FIX.id)
    try:
        FIX.run_apply(patch, recognize())
        return run(script)
    finally:
        patch.revert()
        PER_STEP_KNOWN.update(known)


def _check(script: list[tuple[Any, ...]], runner: Callable[[list[tuple[Any, ...]]], Any]) -> None:
    vllm_stop, vllm_exc = run(script)
    fix_stop, fix_exc = runner(script[: vllm_stop + 1])
    if fix_exc is not None:
        assert fix_stop == vllm_stop and vllm_exc is not None, (
            f"patched call {fix_stop} {script[fix_stop]!r} raised {fix_exc!r}; vLLM "
            + (f"raised only at call {vllm_stop}: {vllm_exc!r}" if vllm_exc else "raised nothing")
        )


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(OPS, min_size=1, max_size=14), st.booleans())
def test_patched_entry_points_never_raise_where_vllm_does_not(
    script: list[tuple[Any, ...]], wrapped: bool
) -> None:
    _check(script, lambda part: patched_run(part, wrapped))


def test_vllm_exception_may_stay() -> None:
    # The comparison itself: a key clash in two children's kv_transfer_params raises in vLLM's
    # own _aggregate_request_finished; the patched body raises the same at the same call.
    script: list[tuple[Any, ...]] = [("finish", "a", [(True, {"k1": 1}), (True, {"k1": 2})])]
    assert isinstance(run(script)[1], RuntimeError)
    assert isinstance(patched_run(script)[1], RuntimeError)
    _check(script, patched_run)


def test_a_new_exception_is_caught() -> None:
    # The comparison fails when the patched side raises where vLLM did not.
    def raising(script: list[tuple[Any, ...]]) -> tuple[int, BaseException | None]:
        return 0, TypeError("new")

    script: list[tuple[Any, ...]] = [("meta",)]
    assert run(script) == (1, None)
    try:
        _check(script, raising)
    except AssertionError:
        return
    raise AssertionError("_check accepted a new exception")
