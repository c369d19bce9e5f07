"""On real vLLM (0.32.0, 0.33.0 and 0.34.0): probe, apply, idempotence, revert, composition, shape."""

from __future__ import annotations

import ast
import socket
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_fix_core import Answer, PatchSet, UnknownShape, runtime
from vllm_fix_core.patching import layers_of
from vllm_fix_listener_port import patch, probe
from vllm_fix_listener_port.declaration import FIX
from vllm_fix_listener_port.reserve import held_ports
from vllm_fix_listener_port.rule import ListenerPortError
from vllm_fix_testing import STRICT, applied, assert_hostile_wrapper_fails, mori_io, vllm_version
from vllm_fix_testing.mori_io import installed_mori

# Every session release carries the defect.
AFFECTED = {"0.32.0": True, "0.33.0": True, "0.34.0": True}
# The shape each session release is recognized as (README, "Releases"): a fingerprint on 0.32.0
# and 0.33.0; 0.34.0's worker __init__ differs (hybrid payload order, get_current_attn_backends;
# from_vllm_config is 0.33.0's) and is recognized structurally (config, IOEngine, backend built
# in that order).
SHAPE = {"0.32.0": "vllm-0.32.0", "0.33.0": "vllm-0.33.0", "0.34.0": "structural"}
OLD_MORI = "0.0.1.dev20+g0000000"  # a build from before MORI reported auto-bound ports


def _classes() -> tuple[Any, Any]:
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_common, moriio_connector

    return moriio_common.MoRIIOConfig, moriio_connector.MoRIIOConnectorWorker


def _raw() -> tuple[Any, Any]:
    config_cls, worker_cls = _classes()
    return config_cls.__dict__["from_vllm_config"], worker_cls.__dict__["__init__"]


@pytest.fixture
def tp_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stand-in TP group (rank 0 of 1) so the real from_vllm_config can run in this process."""
    from vllm.distributed import parallel_state

    monkeypatch.setattr(parallel_state, "_TP", SimpleNamespace(rank_in_group=0, world_size=1))


def test_probe_matches_spec_unpatched(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_PORT", raising=False)
    report = FIX.run_probe()
    assert report.affected is AFFECTED[str(vllm_version())]
    assert report.names(True) == ["kv-port-released-before-native-bind"]
    assert not report.broken_guards


def test_probe_fixed_after_apply() -> None:
    with applied(FIX) as decision:
        assert decision.answer is Answer.AFFECTED_FIXED
        assert decision.shape is not None and "; port 0:" in decision.shape
        report = FIX.run_probe()
        assert not report.affected, report.summary()
        assert not report.broken_guards
    assert FIX.run_probe().affected


def test_hostile_wrapper_over_both_targets_fails_to_fix() -> None:
    """vLLM's own from_vllm_config / __init__ layered over the fix: the probe must see the bug."""
    before = _raw()
    decision = assert_hostile_wrapper_fails(FIX)
    assert "kv-port-released-before-native-bind" in decision.reason
    assert _raw()[0] is before[0] and _raw()[1] is before[1]


def test_hostile_wrapper_fails_with_an_older_mori_too() -> None:
    with installed_mori(OLD_MORI):
        decision = assert_hostile_wrapper_fails(FIX)
    assert decision.shape is not None and "; held reservation:" in decision.shape
    assert held_ports() == []


@pytest.mark.parametrize("tp_before", ["none", "real"])
def test_probe_leaves_the_tp_group_and_no_hold(tp_before: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.distributed import parallel_state

    group = None if tp_before == "none" else SimpleNamespace(rank_in_group=1, world_size=2)
    monkeypatch.setattr(parallel_state, "_TP", group)
    with installed_mori(OLD_MORI), applied(FIX):
        assert not FIX.run_probe().affected
        assert parallel_state._TP is group
        assert held_ports() == []  # the probe's holds ended with its configs


def test_port_zero_with_a_mori_that_cannot_report_it_is_a_broken_guard(tp_group: None) -> None:
    """Forcing port 0 on an older MORI would publish port 0: the probe says so (the ladder reverts)."""
    with installed_mori(OLD_MORI):
        patchset = PatchSet(FIX.id)
        try:
            patch.apply(patchset, "forced; port 0: test")
            report = FIX.run_probe()
        finally:
            patchset.revert()
    assert not report.affected
    assert list(report.broken_guards) == ["kv-port-0-reported-by-mori"]


def test_shape_is_the_expected_one() -> None:
    shape = SHAPE[str(vllm_version())]
    assert patch.recognize().startswith(f"{shape}; port 0: MORI not installed")
    with installed_mori("1.2.2"):
        assert patch.recognize() == f"{shape}; port 0: MORI 1.2.2: reports an auto-bound port"
    with installed_mori(OLD_MORI):
        assert patch.recognize().startswith(f"{shape}; held reservation: MORI {OLD_MORI}")


def test_rdma_only_config_without_backend_field_is_recognized(monkeypatch: pytest.MonkeyPatch) -> None:
    """Older MoRIIO trees have no ``backend`` field (RDMA only): same fix, treated as RDMA."""
    config_cls, _ = _classes()
    fields = {k: v for k, v in config_cls.__dataclass_fields__.items() if k != "backend"}
    monkeypatch.setattr(config_cls, "__dataclass_fields__", fields)
    assert "; port 0:" in patch.recognize()


def test_real_from_vllm_config_negative_and_positive(tp_group: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """VLLM_PORT scanning: two calls (two ranks before any listener) get one number; fixed: 0."""
    config_cls, _ = _classes()
    with socket.socket() as sock:
        sock.bind(("", 0))
        base = sock.getsockname()[1]
    monkeypatch.setenv("VLLM_PORT", str(base))
    first = config_cls.from_vllm_config(probe.vllm_config())
    second = config_cls.from_vllm_config(probe.vllm_config())
    assert first.local_kv_port == second.local_kv_port != 0
    with applied(FIX):
        fixed = config_cls.from_vllm_config(probe.vllm_config())
        xgmi = config_cls.from_vllm_config(probe.vllm_config(dict(probe.EXTRA_CONFIG, backend="xgmi")))
    assert fixed.local_kv_port == 0
    assert xgmi.local_kv_port != 0  # XGMI has no TCP listener: left as vLLM sets it
    # Only local_kv_port changes.
    for name in ("local_ip", "notify_port", "handshake_port", "http_port", "tp_rank", "backend"):
        assert getattr(fixed, name) == getattr(first, name)
    assert fixed.local_ping_port == first.local_ping_port  # documented, untouched


def test_real_from_vllm_config_holds_distinct_ports_with_an_older_mori(
    tp_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    config_cls, _ = _classes()
    with socket.socket() as sock:
        sock.bind(("", 0))
        base = sock.getsockname()[1]
    monkeypatch.setenv("VLLM_PORT", str(base))
    with installed_mori(OLD_MORI), applied(FIX):
        first = config_cls.from_vllm_config(probe.vllm_config())
        second = config_cls.from_vllm_config(probe.vllm_config())
        ports = [first.local_kv_port, second.local_kv_port]
        assert len(set(ports)) == 2 and min(ports) >= base
        assert set(ports) <= probe.ports_held_here()  # held by this process until MORI binds
        assert held_ports() == sorted(ports)
        del first, second
        assert held_ports() == []


def test_bad_config_keeps_vllms_error(tp_group: None) -> None:
    config_cls, _ = _classes()
    bad = probe.vllm_config(dict(probe.EXTRA_CONFIG, backend="bogus"))
    with pytest.raises(ValueError, match="Invalid MoRIIO backend") as unpatched:
        config_cls.from_vllm_config(bad)
    with applied(FIX), pytest.raises(ValueError, match="Invalid MoRIIO backend") as patched:
        config_cls.from_vllm_config(bad)
    assert str(patched.value) == str(unpatched.value)


def test_real_worker_init_unpatched_binds_the_probed_port(real_worker: Any) -> None:
    worker = real_worker()
    engine = worker.moriio_engine
    assert engine.config.port == worker.local_kv_port != 0  # a released probe, bound later
    assert engine.get_engine_desc().port == worker.local_kv_port


def test_real_worker_init_patched_adopts_the_bound_port(real_worker: Any) -> None:
    with installed_mori("1.2.2"), applied(FIX):
        worker = real_worker()
    engine = worker.moriio_engine
    assert engine.config.port == 0  # the native listener chose
    bound = engine.listener.getsockname()[1]
    assert bound != 0
    assert worker.local_kv_port == worker.moriio_config.local_kv_port == bound
    assert engine.get_engine_desc().port == bound  # what vLLM publishes (get_agent_metadata)
    with socket.socket() as other, pytest.raises(OSError):
        other.bind((worker.local_ip, bound))


def test_real_worker_init_with_an_older_mori_binds_the_held_port(real_worker: Any) -> None:
    seen: dict[str, Any] = {}

    def before_bind(engine: Any) -> None:  # right before MORI's bind: the port is still held
        seen["port"] = engine.config.port
        seen["held"] = held_ports()

    with installed_mori(OLD_MORI), applied(FIX):
        mori_io.IOEngine.before_bind = before_bind
        worker = real_worker()
    engine = worker.moriio_engine
    assert seen["port"] != 0 and seen["held"] == [seen["port"]]
    assert engine.listener.getsockname()[1] == seen["port"] == worker.local_kv_port
    assert worker.moriio_config.local_kv_port == engine.get_engine_desc().port == seen["port"]
    assert held_ports() == []  # released once the listener is up


def test_real_worker_init_failure_releases_the_hold(real_worker: Any) -> None:
    def fail(engine: Any) -> None:
        raise OSError(98, "Address already in use")

    with installed_mori(OLD_MORI), applied(FIX):
        mori_io.IOEngine.before_bind = fail
        with pytest.raises(OSError):
            real_worker()
    assert held_ports() == []


def test_real_worker_init_port_zero_unreported_is_a_clear_error(real_worker: Any) -> None:
    """A MORI whose version claims auto-bind but reports 0: a clear error, never a silent port 0."""
    with (
        installed_mori("1.2.2", auto_bind=False),
        applied(FIX),
        pytest.raises(ListenerPortError, match="reports listen port 0"),
    ):
        real_worker()


def test_real_worker_init_xgmi_untouched(real_worker: Any) -> None:
    with applied(FIX):
        worker = real_worker(backend="xgmi")
    assert worker.moriio_engine.listener is None
    assert worker.local_kv_port == worker.moriio_config.local_kv_port != 0


def test_apply_is_idempotent() -> None:
    config_cls, worker_cls = _classes()
    before = _raw()
    shape = patch.recognize()
    patchset = PatchSet(FIX.id)
    try:
        patch.apply(patchset, shape)
        installed = _raw()
        patch.apply(patchset, shape)
        assert _raw() == installed
        assert layers_of(config_cls, "from_vllm_config") == [FIX.id]
        assert layers_of(worker_cls, "__init__") == [FIX.id]
    finally:
        patchset.revert()
    assert _raw()[0] is before[0] and _raw()[1] is before[1]
    with applied(FIX) as decision:  # runtime: applying twice is a no-op
        installed = _raw()
        assert runtime.apply(FIX) is decision
        assert _raw() == installed
        assert layers_of(config_cls, "from_vllm_config") == [FIX.id]


def test_revert_restores_exact_objects() -> None:
    before = _raw()
    with applied(FIX):
        assert _raw()[0] is not before[0]
        assert _raw()[1] is not before[1]
    after = _raw()
    assert after[0] is before[0]
    assert after[1] is before[1]


def _offset_wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A second fix on the same target (like vllm-fix-handshake-port): moves notify_port."""
    config = wrapped(*args, **kwargs)
    config.notify_port += 1000
    return config


@pytest.mark.parametrize("order", ["ours-first", "other-first"])
def test_composes_with_another_wrapper(order: str, tp_group: None) -> None:
    config_cls, _ = _classes()
    before = _raw()
    plain = config_cls.from_vllm_config(probe.vllm_config())
    other = PatchSet("dummy-offset")

    def ours() -> Any:
        decision = runtime.apply(FIX, STRICT)
        assert decision.answer is Answer.AFFECTED_FIXED, decision.message
        return decision

    try:
        if order == "ours-first":
            ours()
            other.wrap(config_cls, "from_vllm_config", _offset_wrapper)
        else:
            other.wrap(config_cls, "from_vllm_config", _offset_wrapper)
            ours()
        both = config_cls.from_vllm_config(probe.vllm_config())
        assert both.local_kv_port == 0
        assert both.notify_port == plain.notify_port + 1000
        assert not FIX.run_probe().affected  # the probe sees our layer among others
        # Revert ours alone: the other layer stays and works.
        runtime.revert(FIX)
        alone = config_cls.from_vllm_config(probe.vllm_config())
        assert alone.local_kv_port != 0
        assert alone.notify_port == plain.notify_port + 1000
        assert FIX.run_probe().affected
    finally:
        runtime.revert(FIX)
        other.revert()
    assert _raw()[0] is before[0]


def test_ast_guard_refuses_other_shapes() -> None:
    def fixed_upstream(cls: Any, vllm_config: Any) -> Any:
        return cls(local_kv_port=0, local_ping_port=0)

    def reserved(cls: Any, vllm_config: Any) -> Any:
        return cls(local_kv_port=reserve_port(), local_ping_port=0)  # type: ignore[name-defined]  # noqa: F821

    def current(cls: Any, vllm_config: Any) -> Any:
        return cls(local_kv_port=get_open_port(), local_ping_port=get_open_port())  # type: ignore[name-defined]  # noqa: F821

    def absent(cls: Any, vllm_config: Any) -> Any:
        return cls(local_ping_port=0)

    assert patch.is_released_probe(patch.kv_port_value(current))
    assert not patch.is_released_probe(patch.kv_port_value(fixed_upstream))
    assert not patch.is_released_probe(patch.kv_port_value(reserved))
    with pytest.raises(UnknownShape):
        patch.kv_port_value(absent)
    assert not patch.is_released_probe(ast.parse("get_open_port(5)").body[0].value)  # type: ignore[attr-defined]


def test_recognize_refuses_a_fixed_upstream_target(monkeypatch: pytest.MonkeyPatch) -> None:
    config_cls, _ = _classes()

    def from_vllm_config(cls: Any, vllm_config: Any) -> Any:
        return cls(local_kv_port=0, local_ping_port=0, backend="rdma")

    monkeypatch.setattr(config_cls, "from_vllm_config", classmethod(from_vllm_config))
    with pytest.raises(UnknownShape, match="local_kv_port=0"):
        patch.recognize()


def test_plugin_entry_point_is_declared() -> None:
    from importlib.metadata import entry_points

    names = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert names.get(FIX.entry_point) == "vllm_fix_listener_port.plugin:register"
    fixes = {ep.name: ep.value for ep in entry_points(group="vllm_fixes")}
    assert fixes.get(FIX.id) == "vllm_fix_listener_port.declaration:FIX"
