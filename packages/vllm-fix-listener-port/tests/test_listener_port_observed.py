"""Real vLLM: every patched target observed, an oracle of its own, and no new exceptions.

* Each target the fix patches, undone alone (vLLM's original layered over it), with either
  strategy (port 0 for a MORI that reports auto-bound ports or none; a held port for an
  older MORI): the ladder says "failed to fix" (``FixFailed`` strict), restores exactly.
* The rule the patch uses, broken at the reference patch.py holds: the probe (whose answer
  is the port the listener is bound to, and whether a port is held, read from the host, not
  from the patch's code) makes the ladder fail to fix.
* The patched entry points, fed the shapes vLLM's own types allow, raise nothing that vLLM's
  originals do not.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_fix_core import Answer, PatchSet, Settings, evaluate
from vllm_fix_listener_port import patch, probe
from vllm_fix_listener_port.declaration import FIX
from vllm_fix_listener_port.reserve import held_ports
from vllm_fix_testing import applied, mori_io
from vllm_fix_testing.hostile import assert_every_target_observed, patched_targets
from vllm_fix_testing.mori_io import installed_mori


def worker_configs() -> tuple[Any, Any]:
    from vllm.v1.kv_cache_interface import KVCacheConfig

    return probe.worker_config(), KVCacheConfig(num_blocks=1, kv_cache_tensors=[], kv_cache_groups=[])


def close_worker(worker: Any) -> None:
    worker.shutdown()  # vLLM's own


LADDER = Settings(disabled=frozenset(), strict=False)
OLD_MORI = "0.0.1.dev20+g0000000"
MORIS = {"no MORI (port 0)": None, "MORI 1.2.2 (port 0)": "1.2.2", "older MORI (held port)": OLD_MORI}


def _mori(version: str | None) -> AbstractContextManager[Any]:
    return nullcontext() if version is None else installed_mori(version)


@pytest.mark.parametrize("version", list(MORIS.values()), ids=list(MORIS))
def test_every_patched_target_is_observed(version: str | None) -> None:
    """Every release 0.14.1 - 0.33.0 is affected: each target, undone alone, is seen."""
    before = set(threading.enumerate())
    with _mori(version):
        assert FIX.run_probe().affected
        decisions = assert_every_target_observed(FIX)
    assert set(decisions) == set(patched_targets(FIX)) and len(decisions) == 2
    assert all(d.answer is Answer.FAILED_TO_FIX for d in decisions.values())
    assert held_ports() == []
    assert set(threading.enumerate()) <= before


def test_probe_builds_a_worker_through_the_installed_init(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unpatched the worker is on its listener's port (the released one); nothing is left set."""
    from vllm.distributed import parallel_state
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_common, moriio_connector

    names = ("IOEngine", "IOEngineConfig", "BackendType", "get_attn_backend", "MoRIIO_enabled")
    before = {n: moriio_connector.__dict__.get(n, "absent") for n in names}
    groups = (parallel_state._TP, parallel_state._WORLD)
    role = moriio_common.get_role()
    checks = {c.name: c for c in FIX.run_probe().checks}
    assert not checks["worker-kv-port-not-its-listeners"].affected
    after = {n: moriio_connector.__dict__.get(n, "absent") for n in names}
    assert all(after[n] is before[n] for n in names)
    assert moriio_common.get_role() == role
    assert groups == (parallel_state._TP, parallel_state._WORLD)


def _no_adopt(worker: Any) -> None:
    return None


def _no_release(owner: object) -> None:
    return None


def _keep(config: Any) -> Any:
    return config


@pytest.mark.parametrize(
    ("name", "broken", "version"),
    [
        ("adopt_native_port", _no_adopt, None),  # the worker keeps port 0
        ("let_native_engine_choose", _keep, None),  # the config keeps the released probe port
        ("release_for", _no_release, OLD_MORI),  # the hold outlives __init__
    ],
    ids=["adopt_native_port", "let_native_engine_choose", "release_for"],
)
def test_breaking_the_rule_the_patch_uses_fails_verification(
    name: str, broken: Callable[..., Any], version: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(patch, name, broken)  # where patch.py looks it up
    with _mori(version):
        decision = evaluate(FIX, LADDER, apply=True, honour_disable=False)
        assert decision.answer is Answer.FAILED_TO_FIX, decision.reason
        monkeypatch.undo()
        with applied(FIX):  # nothing leaked: the intact fix still fixes
            assert not FIX.run_probe().affected
    assert held_ports() == []


# --------------------------------------------------------------------------- never raises


def _outcome(call: Callable[[], Any]) -> tuple[str | None, Any]:
    try:
        return None, call()
    except Exception as exc:
        return type(exc).__name__, None


@pytest.fixture
def stand_ins(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    from vllm.distributed import parallel_state

    mori_io.install_in_vllm(monkeypatch.setattr)
    monkeypatch.setattr(parallel_state, "_TP", SimpleNamespace(rank_in_group=0, world_size=1))
    yield
    mori_io.IOEngine.close_all()


EXTRA = st.fixed_dictionaries(
    {
        "backend": st.sampled_from(["rdma", "xgmi", "RDMA", "Xgmi", "bogus", None]),
        "host_ip": st.sampled_from(["127.0.0.1", "0.0.0.0"]),
        "handshake_port": st.sampled_from(["6301", 6301, "junk", None]),
        "notify_port": st.sampled_from(["61005", 61005, None]),
    }
)


def _extra(drawn: dict[str, Any]) -> dict[str, Any]:
    extra = dict(probe.EXTRA_CONFIG)
    for key, value in drawn.items():
        if value is None:
            extra.pop(key, None)  # an optional field left out
        else:
            extra[key] = value
    return extra


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(drawn=EXTRA, version=st.sampled_from(list(MORIS.values())))
def test_from_vllm_config_never_raises_where_vllm_does_not(
    stand_ins: None, drawn: dict[str, Any], version: str | None
) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_common

    extra = _extra(drawn)
    config_cls = moriio_common.MoRIIOConfig
    unpatched, _ = _outcome(lambda: config_cls.from_vllm_config(probe.vllm_config(extra)))
    with _mori(version):
        patchset = PatchSet(FIX.id)
        try:
            patch.apply(patchset, patch.recognize())
            patched, config = _outcome(lambda: config_cls.from_vllm_config(probe.vllm_config(extra)))
            del config
        finally:
            patchset.revert()
    assert patched == unpatched
    assert held_ports() == []


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(drawn=EXTRA, version=st.sampled_from(list(MORIS.values())))
def test_worker_init_never_raises_where_vllm_does_not(
    stand_ins: None, drawn: dict[str, Any], version: str | None
) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector

    vllm_config, kv_cache_config = worker_configs()
    vllm_config.kv_transfer_config.kv_connector_extra_config = _extra(drawn)
    worker_cls = moriio_connector.MoRIIOConnectorWorker

    def build() -> Any:
        return worker_cls(vllm_config, "engine-0", kv_cache_config)

    unpatched, worker = _outcome(build)
    if worker is not None:
        close_worker(worker)
    mori_io.IOEngine.close_all()
    with _mori(version):
        patchset = PatchSet(FIX.id)
        try:
            patch.apply(patchset, patch.recognize())
            patched, worker = _outcome(build)
            if worker is not None:
                close_worker(worker)
        finally:
            patchset.revert()
            mori_io.IOEngine.close_all()
    assert patched == unpatched
    assert held_ports() == []
