"""The probe is a guest (real vLLM): it never binds VLLM_PORT, and a real TP group that another
thread installs while it runs is not taken away afterwards."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_fix_core import Answer, moriio_probe
from vllm_fix_listener_port.declaration import FIX
from vllm_fix_testing import applied, ports


@pytest.fixture
def binds(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    return ports.trace_binds(monkeypatch)


def kernel_chosen_only(binds: list[tuple[int, int]]) -> bool:
    """Every port bound was asked for as 0, or is one the kernel chose for an earlier bind of
    port 0 (MORI's stand-in listening on the local_kv_port vLLM's get_open_port drew)."""
    chosen: set[int] = set()
    for asked, got in binds:
        if asked == 0:
            chosen.add(got)
        elif asked not in chosen:
            return False
    return True


@pytest.fixture(params=ports.VLLM_PORT_KINDS)
def vllm_port(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    with ports.vllm_port(request.param, monkeypatch) as port:
        yield port


def test_vllm_port_is_never_bound_and_the_decisions_hold(
    vllm_port: int, binds: list[tuple[int, int]]
) -> None:
    unpatched = FIX.run_probe()
    assert unpatched.names(True) == ["kv-port-released-before-native-bind"], unpatched.summary()
    with applied(FIX) as decision:
        assert decision.answer is Answer.AFFECTED_FIXED
        after = FIX.run_probe()
        assert not after.affected, after.summary()
        assert not after.broken_guards
    assert binds, "the probe bound nothing: the trace is not seeing its sockets"
    assert vllm_port not in {port for bind in binds for port in bind}
    assert kernel_chosen_only(binds), binds


def test_vllm_port_still_scanned_by_vllm_itself(vllm_port: int) -> None:
    """The control: outside the probe, vLLM's own from_vllm_config takes VLLM_PORT upward
    (so the probe's ports above are not simply what vLLM does anyway)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_common

    from vllm_fix_listener_port import probe

    with moriio_probe.process_groups():
        config = moriio_common.MoRIIOConfig.from_vllm_config(probe.vllm_config())
    assert vllm_port <= int(config.local_kv_port) < vllm_port + 16


def test_a_real_tp_group_installed_while_the_probe_runs_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another thread installs the process's TP group while the probe's rank-0-of-1 stand-in
    is in place: after the probe, the real group is there (the stand-in is put back only
    where it is still the probe's)."""
    from vllm.distributed import parallel_state

    monkeypatch.setattr(parallel_state, "_TP", None)
    monkeypatch.setattr(parallel_state, "_WORLD", None)
    real = SimpleNamespace(rank_in_group=0, world_size=1, rank=0, local_rank=0)
    seen: list[Any] = []
    original = moriio_probe.from_vllm_config

    def from_vllm_config(common: Any, config: Any) -> Any:
        if not seen:
            seen.append(parallel_state._TP)  # the probe's stand-in
            other = threading.Thread(target=setattr, args=(parallel_state, "_TP", real))
            other.start()
            other.join()
        return original(common, config)

    monkeypatch.setattr(moriio_probe, "from_vllm_config", from_vllm_config)
    report = FIX.run_probe()
    assert report.names(True) == ["kv-port-released-before-native-bind"], report.summary()
    assert seen and seen[0] is not None and seen[0] is not real
    assert parallel_state._TP is real
    assert parallel_state._WORLD is None  # the world stand-in, still the probe's, is gone


def test_process_groups_put_back_only_their_own_stand_ins(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.distributed import parallel_state

    monkeypatch.setattr(parallel_state, "_TP", None)
    monkeypatch.setattr(parallel_state, "_WORLD", None)
    with moriio_probe.process_groups():
        assert parallel_state._TP is not None and parallel_state._WORLD is not None
    assert parallel_state._TP is None and parallel_state._WORLD is None
    real = SimpleNamespace(rank=0, local_rank=0, world_size=1)
    with moriio_probe.process_groups():
        parallel_state._WORLD = real
    assert parallel_state._WORLD is real
    assert parallel_state._TP is None
