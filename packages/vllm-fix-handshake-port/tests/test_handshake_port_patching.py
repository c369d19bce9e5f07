"""Config guard, idempotence, exact revert, composition, shape guards (real vLLM)."""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_fix_core import Answer, PatchSet, UnknownShape, runtime
from vllm_fix_core.ladder import evaluate
from vllm_fix_core.patching import layers_of
from vllm_fix_core.settings import Settings
from vllm_fix_handshake_port import FIX, sites
from vllm_fix_handshake_port.patch import recognize
from vllm_fix_handshake_port.rule import PortLayoutError
from vllm_fix_handshake_port.sites import classify
from vllm_fix_testing import STRICT, applied


def _targets(mods: SimpleNamespace) -> list[tuple[Any, str]]:
    sched, writer = mods.connector.MoRIIOConnectorScheduler, mods.engine.MoRIIOWriter
    writer_attr = next(q.split(".")[1] for m, q in sites.callers() if q.startswith("MoRIIOWriter."))
    return [
        (mods.common, "get_port_offset"),
        (mods.connector, "get_port_offset"),
        (mods.engine, "get_port_offset"),
        (mods.common.MoRIIOConfig, "from_vllm_config"),
        (sched, "_release_write_prefill_blocks"),
        (sched, "update_state_after_alloc"),
        (writer, writer_attr),
    ]


def test_declared_targets_are_exactly_the_patched_ones(mods: SimpleNamespace) -> None:
    declared = set()
    for target in FIX.targets:
        try:
            owner, attr, _ = target.resolve()
        except AttributeError:
            assert target.optional
            continue
        declared.add((id(owner), attr))
    with applied(FIX) as decision:
        assert decision.patch is not None
        touched = {(id(owner), attr) for owner, attr in decision.patch._touched}
    assert touched <= declared
    assert touched == {(id(owner), attr) for owner, attr in _targets(mods)}


def test_overlapping_bases_are_rejected(mods: SimpleNamespace, ranks: Callable[[int, int], None]) -> None:
    from_vllm_config = mods.common.MoRIIOConfig.from_vllm_config

    ranks(0, 8)
    cfg = _config(dp_local=4, tp_size=8, handshake=6301, notify=6320)
    assert from_vllm_config(cfg).notify_port == 6320  # unpatched: accepted, ranks collide later
    with applied(FIX):
        with pytest.raises(PortLayoutError, match="overlap"):
            mods.common.MoRIIOConfig.from_vllm_config(cfg)
        ok = mods.common.MoRIIOConfig.from_vllm_config(
            _config(dp_local=4, tp_size=8, handshake=6301, notify=6333)
        )
        assert ok.notify_port == 6333


def _config(dp_local: int, tp_size: int, handshake: int, notify: int, dp: int = 0) -> Any:
    extra = {
        "handshake_port": str(handshake),
        "notify_port": str(notify),
        "http_port": "8000",
        "host_ip": "127.0.0.1",
    }
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra),
        parallel_config=SimpleNamespace(
            data_parallel_rank=dp, data_parallel_size_local=dp_local, data_parallel_size=dp_local
        ),
    )


# --------------------------------------------------------------------------- patch hygiene


def test_apply_twice_is_a_noop_and_revert_is_exact(mods: SimpleNamespace) -> None:
    targets = _targets(mods)
    before = [owner.__dict__[attr] for owner, attr in targets]
    with applied(FIX) as decision:
        assert decision.shape == recognize()
        installed = [owner.__dict__[attr] for owner, attr in targets]
        assert all(a is not b for a, b in zip(installed, before, strict=True))
        assert all(layers_of(owner, attr) == [FIX.id] for owner, attr in targets)
        assert runtime.apply(FIX, STRICT) is decision  # runtime: no second application
        again = PatchSet(FIX.id)
        FIX.run_apply(again, decision.shape or "")  # PatchSet: one layer per fix per target
        assert [owner.__dict__[attr] for owner, attr in targets] == installed
        assert all(layers_of(owner, attr) == [FIX.id] for owner, attr in targets)
        again.revert()  # it installed nothing, so it removes nothing
        assert [owner.__dict__[attr] for owner, attr in targets] == installed
    after = [owner.__dict__[attr] for owner, attr in targets]
    assert all(a is b for a, b in zip(after, before, strict=True))


def _listener_port_like(patch: PatchSet, mods: SimpleNamespace) -> None:
    """A second fix on the same targets, like vllm-fix-listener-port (local_kv_port = 0)."""

    def config_wrapper(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        config = wrapped(*args, **kwargs)
        config.local_kv_port = 0
        return config

    def init_wrapper(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        wrapped(*args, **kwargs)
        instance.other_fix_ran = True

    patch.wrap(mods.common.MoRIIOConfig, "from_vllm_config", config_wrapper)
    patch.wrap(mods.connector.MoRIIOConnectorWorker, "__init__", init_wrapper)


@pytest.fixture
def other_fix(mods: SimpleNamespace) -> Iterator[PatchSet]:
    patch = PatchSet("listener-port-like")
    yield patch
    patch.revert()


@pytest.mark.parametrize("ours_first", [True, False])
def test_composes_with_another_wrapper_in_either_order(
    mods: SimpleNamespace, make_worker: Callable[..., Any], other_fix: PatchSet, ours_first: bool
) -> None:
    original_config = mods.common.MoRIIOConfig.__dict__["from_vllm_config"]
    original_init = mods.connector.MoRIIOConnectorWorker.__dict__["__init__"]
    try:
        if ours_first:
            runtime.apply(FIX, STRICT)
            _listener_port_like(other_fix, mods)
        else:
            _listener_port_like(other_fix, mods)
            assert runtime.apply(FIX, STRICT).answer is Answer.AFFECTED_FIXED
        both = make_worker(1, 0, 2, 2, handshake=16301, notify=26005)
        assert (both.side_channel_port, both.notify_port) == (16303, 26007)  # ours
        assert both.moriio_config.local_kv_port == 0 and both.other_fix_ran  # theirs
        runtime.revert(FIX)
        theirs = make_worker(1, 0, 2, 2, handshake=16301, notify=26005)
        assert (theirs.side_channel_port, theirs.notify_port) == (16302, 26006)  # ours gone
        assert theirs.moriio_config.local_kv_port == 0 and theirs.other_fix_ran  # theirs kept
        runtime.apply(FIX, STRICT)
        other_fix.revert()
        ours = make_worker(1, 0, 2, 2, handshake=16301, notify=26005)
        assert ours.side_channel_port == 16303 and ours.moriio_config.local_kv_port != 0
        assert not hasattr(ours, "other_fix_ran")
    finally:
        runtime.revert(FIX)
        other_fix.revert()
    assert mods.common.MoRIIOConfig.__dict__["from_vllm_config"] is original_config
    assert mods.connector.MoRIIOConnectorWorker.__dict__["__init__"] is original_init


# --------------------------------------------------------------------------- shape guards


def test_refuses_a_changed_offset_function(mods: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    def get_port_offset(dp_rank: int, tp_rank: int, tp_size: int = 1) -> int:
        return dp_rank + tp_rank  # ignores tp_size everywhere: not the function the fix wraps

    monkeypatch.setattr(mods.common, "get_port_offset", get_port_offset)
    with pytest.raises(UnknownShape, match="get_port_offset"):
        recognize()
    decision = evaluate(FIX, Settings(disabled=frozenset(), strict=False), apply=True)
    assert decision.answer is Answer.REFUSED and decision.patch is None


def test_refuses_a_cached_reference_to_another_function(
    mods: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = mods.engine.get_port_offset
    copy = types.FunctionType(
        original.__code__, original.__globals__, original.__name__, original.__defaults__
    )
    monkeypatch.setattr(mods.engine, "get_port_offset", copy)
    with pytest.raises(UnknownShape, match=r"moriio_engine\.get_port_offset is not"):
        recognize()


def test_unknown_callers_are_placed_by_structure() -> None:
    """Older releases and forks: a caller is placed by where it sits, not by a list of names."""

    def sender_like(self: Any, request_id: str, params: dict[str, Any]) -> int:
        return 0

    def dials_with_size(self: Any, dp: int, tp: int, size: int) -> int:
        from vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_common import get_port_offset

        return get_port_offset(dp, tp, size)

    def dials_without_size(self: Any, dp: int, tp: int) -> int:
        from vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_common import get_port_offset

        return get_port_offset(dp, tp)

    assert classify(("moriio_connector", "MoRIIOConnectorScheduler._new_sender"), sender_like) == "sender"
    assert classify(("moriio_engine", "MoRIIOWriter._new_notify"), sender_like) == "writer"
    assert classify(("moriio_connector", "MoRIIOConnectorWorker._new_dial"), dials_with_size) == "explicit"
    with pytest.raises(UnknownShape, match=r"MoRIIOConnectorWorker\._new_dial calls get_port_offset without"):
        classify(("moriio_connector", "MoRIIOConnectorWorker._new_dial"), dials_without_size)


def test_refuses_an_unknown_caller_without_tp_size(
    mods: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = "def _dial_peer(self, dp, tp):\n    return get_port_offset(dp, tp)\n"
    scope: dict[str, Any] = {}
    exec(compile(source, mods.connector.__file__, "exec"), mods.connector.__dict__, scope)
    func = scope["_dial_peer"]
    func.__module__ = mods.connector.__name__
    monkeypatch.setattr(mods.connector.MoRIIOConnectorWorker, "_dial_peer", func, raising=False)
    monkeypatch.setattr(sites, "names_tp_size_everywhere", lambda f: False)  # its source is not on disk
    with pytest.raises(UnknownShape, match="_dial_peer"):
        recognize()
    decision = evaluate(FIX, Settings(disabled=frozenset(), strict=False), apply=True)
    assert decision.answer is Answer.REFUSED and "this vLLM has the bug" in decision.reason


def test_a_new_scheduler_sender_is_wrapped(mods: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fork's extra scheduler sender gets the peer's TP size like vLLM's own senders."""
    source = (
        "def _fork_release(self, request_id, params):\n"
        "    return [get_port_offset(params['remote_dp_rank'], t) for t in range(self.tp_size)]\n"
    )
    scope: dict[str, Any] = {}
    exec(compile(source, mods.connector.__file__, "exec"), mods.connector.__dict__, scope)
    func = scope["_fork_release"]
    func.__module__ = mods.connector.__name__
    monkeypatch.setattr(mods.connector.MoRIIOConnectorScheduler, "_fork_release", func, raising=False)
    assert recognize() == "structural"
    sched = mods.connector.MoRIIOConnectorScheduler.__new__(mods.connector.MoRIIOConnectorScheduler)
    sched.tp_size = 2
    params = {"remote_dp_rank": 1, "remote_tp_size": 2}
    assert sched._fork_release("r", params) == [1, 2]  # unpatched: dp + tp
    with applied(FIX) as decision:
        assert decision.shape == "structural"
        assert sched._fork_release("r", params) == [2, 3]  # dp * peer TP size + tp


def test_plugin_entry_points_are_declared() -> None:
    from importlib.metadata import entry_points

    plugins = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert plugins.get(FIX.entry_point) == "vllm_fix_handshake_port.plugin:register"
    fixes = {ep.name: ep.load() for ep in entry_points(group="vllm_fixes") if ep.name == FIX.id}
    assert fixes[FIX.id] is FIX
