"""The owner-set rule alone (no vLLM): worker gate and scheduler ledger."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_fix_completion_ownership.gate import EARLY_WINDOW, RETIRED_WINDOW, WorkerGate
from vllm_fix_completion_ownership.ledger import SchedulerLedger
from vllm_fix_completion_ownership.rule import WireError, decode_update, encode_update


def update(owners=None, forced=None, loaders=None):
    return encode_update(owners or {}, forced or {}, loaders or {})


def test_report_before_owners_is_buffered_then_applied() -> None:
    gate = WorkerGate()
    gate.report_sending(0, "r")
    assert gate.take_ready() == set()
    gate.apply_update(update(owners={"r": (0, 1)}))
    assert gate.take_ready() == set()
    gate.report_sending(1, "r")
    assert gate.take_ready() == {"r"}
    gate.report_sending(1, "r")  # repeat after retirement: ignored
    gate.report_sending(0, "r")
    assert gate.take_ready() == set()
    assert gate.size() == 0


def test_empty_owner_set_discards_buffered_reports() -> None:
    gate = WorkerGate()
    gate.report_sending(1, "r")
    gate.apply_update(update(owners={"r": ()}))
    assert gate.take_ready() == set()
    gate.report_sending(0, "r")
    assert gate.take_ready() == set()
    assert gate.size() == 0


def test_non_owner_report_is_ignored() -> None:
    gate = WorkerGate()
    gate.apply_update(update(owners={"r": (1,)}))
    gate.report_sending(0, "r")
    assert gate.take_ready() == set()
    gate.report_sending(1, "r")
    assert gate.take_ready() == {"r"}


def test_forced_completion_counts_for_that_child_only() -> None:
    gate = WorkerGate()
    gate.apply_update(update(owners={"r": (0, 1)}))
    gate.apply_update(update(forced={"r": (0,)}))
    assert gate.take_ready() == set()
    gate.report_sending(1, "r")
    assert gate.take_ready() == {"r"}
    gate.apply_update(update(forced={"r": (1,)}))  # moot after the fact
    assert gate.take_ready() == set()


def test_recv_only_from_loader() -> None:
    gate = WorkerGate()
    gate.apply_update(update(loaders={"r": 1}))
    assert not gate.accept_recv(0, "r")
    assert gate.accept_recv(1, "r")
    assert gate.accept_recv(0, "unknown")
    gate.apply_update(update(owners={"r": ()}))
    assert gate.loaders == {}


def test_memory_ages_out() -> None:
    gate = WorkerGate()
    gate.report_sending(0, "stray")  # never gets owners
    gate.apply_update(update(owners={"r": ()}))
    for _ in range(max(EARLY_WINDOW, RETIRED_WINDOW) + 1):
        gate.apply_update(update())
    assert len(gate.retired) == 0 and len(gate.early) == 0
    assert gate.expired_reports == 1


def test_wire_version_is_checked() -> None:
    try:
        decode_update({"v": 99})
    except WireError:
        pass
    else:  # pragma: no cover
        raise AssertionError("unknown wire version accepted")


def test_ledger_surfaces_once_after_every_owner() -> None:
    ledger = SchedulerLedger()
    ledger.accept_partial_tail("r", 2)
    assert ledger.record_finished("r", 0b1) == (0, 2)
    first = ledger.take_update()
    assert first["owners"] == {"r": (0, 2)}
    assert ledger.complete(0, "r")  # e.g. a watchdog, before the workers reported
    assert not ledger.complete(1, "r")  # not an owner
    assert ledger.take_update()["forced"] == {"r": (0,)}
    ledger.note_workers_done({"r", "stray"})
    assert ledger.view(0) is None and ledger.view(2) == {"r"} and ledger.view(1) is None
    assert ledger.surface() == set()  # 2 has not let it go yet
    ledger.complete(2, "r")
    assert ledger.surface() == {"r"}
    assert ledger.surface() == set()
    assert ledger.dropped_reports == 1
    ledger.take_update()
    assert ledger.size() == 0


def test_ledger_release_on_recv_free() -> None:
    ledger = SchedulerLedger()
    ledger.record_finished("r", 0b10)  # e.g. an aborted request whose load is in flight
    ledger.take_update()
    ledger.release("r")  # vLLM frees it through finished_recving
    assert ledger.take_update()["forced"] == {"r": (1,)}
    ledger.note_workers_done({"r"})  # the workers settle it afterwards: dropped
    assert ledger.surface() == set() and ledger.size() == 0


def test_ledger_empty_owner_set_is_not_tracked() -> None:
    ledger = SchedulerLedger()
    ledger.record_finished("r", 0)
    assert ledger.take_update()["owners"] == {"r": ()}
    ledger.note_workers_done({"r"})
    assert ledger.surface() == set()
    assert ledger.size() == 0


def test_ledger_child_holding_back_in_place_keeps_its_id() -> None:
    """A child that removes an id from its view in place and hands the same set back lets
    only the rest go; the id it kept is surfaced when it lets it go later."""
    ledger = SchedulerLedger(2)
    for req_id in ("a", "b"):
        ledger.record_finished(req_id, 0b11)
    ledger.note_workers_done({"a", "b"})
    view = ledger.view(0)
    assert view == {"a", "b"}
    view.discard("b")  # child 0 keeps b for now
    assert ledger.let_go(0, view) is None
    assert ledger.let_go(1, {"a", "b", "stray"}) == ["stray"]
    assert ledger.surface() == {"a"}
    assert ledger.view(0) == {"b"} and ledger.view(1) is None
    ledger.let_go(0, {"b"})
    assert ledger.surface() == {"b"}
    ledger.take_update()
    assert ledger.size() == 0


def test_ledger_reused_id_starts_a_new_lifetime() -> None:
    ledger = SchedulerLedger(2)
    ledger.record_finished("r", 0b11)
    ledger.note_workers_done({"r"})
    ledger.let_go(0, {"r"})
    ledger.record_finished("r", 0b10)  # the id comes back before child 1 let the first one go
    assert ledger.surface() == set() and ledger.view(1) is None
    ledger.note_workers_done({"r"})
    assert ledger.view(0) is None and ledger.view(1) == {"r"}
    ledger.let_go(1, {"r"})
    assert ledger.surface() == {"r"}
    ledger.take_update()
    assert ledger.size() == 0


events = st.lists(
    st.tuples(st.sampled_from(["report", "force", "owners"]), st.integers(0, 3), st.integers(0, 2)),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(
    owner_sets=st.lists(st.frozensets(st.integers(0, 2), max_size=3), min_size=4, max_size=4),
    script=events,
)
def test_gate_reports_each_request_once_and_only_after_its_owners(owner_sets, script) -> None:
    gate = WorkerGate()
    rids = [f"r{i}" for i in range(4)]
    known: set[str] = set()
    completed: dict[str, set[int]] = {r: set() for r in rids}
    reported: list[str] = []
    for kind, ri, child in script:
        rid = rids[ri]
        if kind == "report":
            gate.report_sending(child, rid)
            completed[rid].add(child)
        elif kind == "force":
            if rid in known:  # the scheduler forces only after it shipped the owners
                gate.apply_update(update(forced={rid: (child,)}))
                completed[rid].add(child)
        elif rid not in known:
            known.add(rid)
            gate.apply_update(update(owners={rid: tuple(sorted(owner_sets[ri]))}))
        for r in gate.take_ready():
            assert r in known, "reported before its owners were known"
            assert owner_sets[rids.index(r)], "a request nobody held was reported"
            assert owner_sets[rids.index(r)] <= completed[r], "reported before every owner completed"
            reported.append(r)
    assert len(reported) == len(set(reported)), "reported twice"
    # Liveness: everything known, held and fully completed was reported.
    for i, r in enumerate(rids):
        if r in known and owner_sets[i] and owner_sets[i] <= completed[r]:
            assert r in reported


def test_reused_request_id_gets_a_new_lifetime() -> None:
    gate = WorkerGate()
    gate.apply_update(update(owners={"r": (0,)}))
    gate.report_sending(0, "r")
    assert gate.take_ready() == {"r"}
    gate.apply_update(update(owners={"r": (1,)}))  # the same id finished again later
    gate.report_sending(1, "r")
    assert gate.take_ready() == {"r"}
