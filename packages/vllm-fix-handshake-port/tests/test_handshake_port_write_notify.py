"""The WRITE completion notify (prefill writer -> decode notify listeners) on real vLLM.

Decode listeners are real workers (real ``MoRIIOConnectorWorker.__init__``, which binds
at the port ``from_vllm_config`` computed); the writer is vLLM's real ``MoRIIOWriter``
with vLLM's own ``WriteTask`` / ``RemoteAllocInfo`` and, on 0.33.0, vLLM's own TP mapping
(``compute_write_tp_mapping``). Its worker and transport are stand-ins
(``vllm_fix_testing.moriio_worker``): no MORI here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_fix_handshake_port import FIX
from vllm_fix_testing import applied
from vllm_fix_testing.moriio_worker import WriterWorkerStandIn

BASE = 26005


def _task(mods: SimpleNamespace, transfer: str = "tA", **fields: Any) -> Any:
    names = {f.name for f in dataclasses.fields(mods.common.WriteTask)}
    base = {
        "request_id": "req",
        "transfer_id": transfer,
        "dst_engine_id": "decode",
        "local_block_ids": [[1]],
        "remote_block_ids_hint": None,
        "layer_name": "layer0",
        "event": None,
        "remote_notify_port": BASE,
        "remote_ip": "10.0.0.1",
    }
    return mods.common.WriteTask(**{k: v for k, v in {**base, **fields}.items() if k in names})


def _mapping(producer_rank: int, producer_tp: int, consumer_tp: int) -> Any:
    tp_mapping = pytest.importorskip(
        "vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_tp_mapping",
        reason="heterogeneous-TP WRITE (a TP mapping) is part of vLLM 0.33.0 only",
    )
    return tp_mapping.compute_write_tp_mapping(producer_rank, producer_tp, consumer_tp, 1, True, False)


def _decode(make_worker: Callable[..., Any], dp_size: int, tp_size: int) -> dict[tuple[int, int], int]:
    """Notify port each decode rank binds (real worker init)."""
    ports = {}
    for dp in range(dp_size):
        for tp in range(tp_size):
            ports[(dp, tp)] = make_worker(dp, tp, dp_size, tp_size, notify=BASE, producer=False).notify_port
    return ports


def _fanout_ports(mods: SimpleNamespace, producer_rank: int, decode_dp: int, task: Any) -> list[int]:
    writer = mods.engine.MoRIIOWriter(WriterWorkerStandIn(producer_rank, world_size=2))
    return sorted(port for _, port in writer._resolve_notify_endpoints(task, decode_dp))


def test_fanout_targets_share_a_port_with_another_rank_under_vllms_formula(
    mods: SimpleNamespace, make_worker: Callable[..., Any]
) -> None:
    """vLLM's own fan-out test expects base+3 and base+4 for decode (dp1, tp2/tp3) of a TP4
    decode engine. base+3 is also where (dp0, tp3) listens: two ranks, one port."""
    mapping = _mapping(1, 2, 4)  # prefill rank 1 of TP2 writes decode TP4 ranks 2 and 3
    task = _task(mods, remote_tp_size=4, tp_mapping=mapping, remote_dp_size_local=2, remote_dp_size=2)
    unpatched = _decode(make_worker, 2, 4)
    vllm_targets = _fanout_ports(mods, 1, 1, task)
    assert vllm_targets == [BASE + 3, BASE + 4]  # what vLLM's test asserts
    assert unpatched[(0, 3)] == unpatched[(1, 2)] == BASE + 3  # negative control: shared port
    with applied(FIX):
        patched = _decode(make_worker, 2, 4)
        targets = _fanout_ports(mods, 1, 1, task)
    assert len(set(patched.values())) == 8  # every decode rank its own port
    assert targets == [patched[(1, 2)], patched[(1, 3)]] == [BASE + 6, BASE + 7]


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 4), (4, 2)])
def test_heterogeneous_tp_write_notify_reaches_every_target_listener(
    mods: SimpleNamespace, make_worker: Callable[..., Any], prefill_tp: int, decode_tp: int
) -> None:
    """Prefill TP != decode TP, decode DP 2: each prefill rank's completion goes to exactly
    the decode ranks vLLM's mapping writes, at the ports they bind."""
    with applied(FIX):
        decode = _decode(make_worker, 2, decode_tp)
        for dp in range(2):
            for rank in range(prefill_tp):
                mapping = _mapping(rank, prefill_tp, decode_tp)
                task = _task(
                    mods,
                    remote_tp_size=decode_tp,
                    tp_mapping=mapping,
                    remote_dp_size_local=2,
                    remote_dp_size=2,
                )
                writer = mods.engine.MoRIIOWriter(WriterWorkerStandIn(rank, world_size=prefill_tp))
                got = sorted(port for _, port in writer._resolve_notify_endpoints(task, dp))
                assert got == sorted(decode[(dp, t.tp_rank)] for t in mapping.targets), (dp, rank)


def test_unknown_decode_tp_follows_vllms_own_homogeneous_mapping(
    mods: SimpleNamespace, make_worker: Callable[..., Any]
) -> None:
    """No remote TP size on the task (0 = unknown): vLLM maps the write as if decode TP ==
    prefill TP (``_write_tp_mapping(remote_tp_size or world_size)``); the completion goes to
    the listener of the rank that mapping writes."""
    prefill_tp = 2
    with applied(FIX):
        decode = _decode(make_worker, 2, prefill_tp)
        for dp in range(2):
            for rank in range(prefill_tp):
                mapping = _mapping(rank, prefill_tp, prefill_tp)  # remote size unknown -> ours
                task = _task(
                    mods, remote_tp_size=0, tp_mapping=mapping, remote_dp_size_local=2, remote_dp_size=2
                )
                assert _fanout_ports(mods, rank, dp, task) == [decode[(dp, rank)]]


def _alloc(mods: SimpleNamespace, decode_dp: int) -> Any:
    return mods.common.RemoteAllocInfo(block_ids=None, decode_dp_rank=decode_dp)


def test_writer_whose_worker_has_no_world_size_keeps_vllms_port(mods: SimpleNamespace) -> None:
    """vLLM's writer tests build a worker without world_size and a task without a remote TP
    size: the fix has nothing to size the offset with, so it keeps vLLM's port, and raises
    nothing (the deferred path does not drop the entry)."""
    worker = WriterWorkerStandIn(tp_rank=1)  # no world_size
    info = _alloc(mods, 1)
    worker.moriio_wrapper.done_remote_allocate_req_dict["tA"] = info
    task = _task(mods, remote_dp_size_local=2, remote_dp_size=2)
    with applied(FIX):
        writer = mods.engine.MoRIIOWriter(worker)
        writer._deferred_tasks.append(task)
        writer._process_deferred_tasks()
        assert writer._deferred_tasks == []
        assert "tA" in worker.moriio_wrapper.done_remote_allocate_req_dict  # not dropped
        assert not [ack for ack in worker.moriio_wrapper.done_req_ids]  # not failed either
        if hasattr(info, "completion_notify_port"):  # 0.31.0+: resolved at execute time
            assert info.completion_notify_port == BASE + mods.common.get_port_offset(1, 1)
            assert info.completion_notify_port == BASE + 2  # vLLM's formula, dp + tp


def test_writer_with_world_size_uses_the_decode_tp_size(mods: SimpleNamespace) -> None:
    """The production worker has world_size: with no remote TP size on the task (homogeneous
    TP, as vLLM's writer assumes), decode rank (1, 1) of a TP2 engine is at base + 3."""
    worker = WriterWorkerStandIn(tp_rank=1, world_size=2)
    info = _alloc(mods, 1)
    worker.moriio_wrapper.done_remote_allocate_req_dict["tA"] = info
    task = _task(mods, remote_dp_size_local=2, remote_dp_size=2)
    with applied(FIX):
        writer = mods.engine.MoRIIOWriter(worker)
        writer._execute_write_task(task)
        info.writes_expected = 1
        info.writes_done = 1
        writer._finalize_if_complete("tA", info)
    assert [port for _, _, port, _ in worker.moriio_wrapper.sent] == [BASE + 3]
