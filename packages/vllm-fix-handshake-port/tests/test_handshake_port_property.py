"""Patched code never raises where vLLM does not (hypothesis, real vLLM entry points).

Each example runs one of the patched entry points unpatched and then patched, with inputs of
the shapes vLLM's own types allow (``None`` for the optional fields, ``kv_transfer_params``
as ``dict[str, Any] | None`` with fields missing, zero, or of the wrong type, as a router may
send them), in both process states a call can meet: a TP group of some size (a worker) or
none (the engine core; vLLM's getters raise). An exception unpatched may stay; a patched
exception must be one vLLM raised too, and where both return, the patched sender sends as
many notifies to the same hosts (only the ports may differ: that is the fix).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_fix_handshake_port import FIX, probe
from vllm_fix_testing import applied
from vllm_fix_testing.moriio_worker import WriterWorkerStandIn

SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

Outcome = tuple[str, Any]


def _outcome(run: Callable[[], Any]) -> Outcome:
    try:
        return ("returned", run())
    except Exception as exc:  # what vLLM (or the fix) raised, compared below
        return ("raised", type(exc))


def _compare(unpatched: Outcome, patched: Outcome) -> None:
    if patched[0] == "raised":
        assert unpatched == patched, f"patched raised {patched[1]}, unpatched {unpatched}"
    else:
        assert unpatched[0] == "returned", f"unpatched raised {unpatched[1]}, patched returned"


@contextmanager
def _tp_group(mods: SimpleNamespace, size: int | None) -> Iterator[None]:
    """This process's TP group: ``size`` ranks, or none (vLLM's own getters, which raise)."""
    from vllm.distributed import parallel_state

    with pytest.MonkeyPatch.context() as m:
        for module in (mods.common, mods.connector, mods.engine):
            for name in ("get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size"):
                if not hasattr(module, name):
                    continue
                if size is None:
                    m.setattr(module, name, getattr(parallel_state, name))
                else:
                    m.setattr(module, name, (lambda: 0) if name.endswith("_rank") else (lambda s=size: s))
        yield


def _both(mods: SimpleNamespace, tp_group: int | None, run: Callable[[], Any]) -> tuple[Outcome, Outcome]:
    with _tp_group(mods, tp_group):
        unpatched = _outcome(run)
        with applied(FIX):
            patched = _outcome(run)
    return unpatched, patched


ints = st.integers(min_value=-2, max_value=9)
tp_groups = st.one_of(st.none(), st.integers(min_value=1, max_value=4))
# kv_transfer_params fields: absent, None, or a value of an allowed or a wrong shape.
_ABSENT = object()


def _field(values: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(st.just(_ABSENT), st.none(), values)


PARAMS = st.fixed_dictionaries(
    {
        "transfer_id": _field(st.sampled_from(["t1", ""])),
        "remote_dp_rank": _field(st.one_of(st.integers(-1, 5), st.just("1"))),
        "remote_tp_size": _field(st.one_of(st.integers(-1, 5), st.just("junk"))),
        "tp_size": _field(st.integers(0, 4)),
        "remote_dp_size": _field(st.integers(0, 4)),
        "remote_dp_size_local": _field(st.one_of(st.integers(-1, 4), st.just("x"))),
        "remote_host": _field(st.sampled_from(["127.0.0.1", ""])),
        "remote_notify_port": _field(st.one_of(st.integers(0, 30000), st.just("26005"), st.just("junk"))),
        "is_request_leader": _field(st.booleans()),
        "remote_dp_rank_override": _field(st.booleans()),
        "do_remote_prefill": _field(st.booleans()),
        "do_remote_decode": _field(st.booleans()),
    }
).map(lambda d: {k: v for k, v in d.items() if v is not _ABSENT})


@SETTINGS
@given(
    dp=ints,
    tp=ints,
    tp_size=st.one_of(st.none(), ints),
    module=st.sampled_from(["common", "connector", "engine"]),
    tp_group=tp_groups,
)
def test_get_port_offset(
    mods: SimpleNamespace, dp: int, tp: int, tp_size: int | None, module: str, tp_group: int | None
) -> None:
    def run() -> Any:
        offset = getattr(mods, module).get_port_offset
        return offset(dp, tp) if tp_size is None else offset(dp, tp, tp_size)

    _compare(*_both(mods, tp_group, run))


def _scheduler(mods: SimpleNamespace, tp_size: int, write: bool, sent: list[tuple[Any, Any]]) -> Any:
    """vLLM's decode-side scheduler, built by its own __init__ (the probe's builder)."""
    sched = probe._decode_scheduler(mods.connector, mods.common, tp_size)

    def record(*args: Any, **kwargs: Any) -> None:
        sent.append((kwargs.get("host"), "notify"))

    sched.mode = mods.common.MoRIIOMode.WRITE if write else mods.common.MoRIIOMode.READ
    sched.send_notify_block = record
    sched._send_transfer_release = lambda transfer_id, host, port: sent.append((host, "release"))
    return sched


@SETTINGS
@given(
    params=st.one_of(st.none(), PARAMS),
    tp_size=st.integers(1, 4),
    write=st.booleans(),
    num_external_tokens=st.sampled_from([0, 32]),
    tp_group=tp_groups,
)
def test_update_state_after_alloc(
    mods: SimpleNamespace,
    params: dict[str, Any] | None,
    tp_size: int,
    write: bool,
    num_external_tokens: int,
    tp_group: int | None,
) -> None:
    sends: list[list[tuple[Any, Any]]] = []

    def run() -> None:
        sent: list[tuple[Any, Any]] = []
        sends.append(sent)
        sched = _scheduler(mods, tp_size, write, sent)
        request = probe._request("plain-request", None if params is None else dict(params))
        sched.update_state_after_alloc(request, probe._blocks(3, 4), num_external_tokens)

    unpatched, patched = _both(mods, tp_group, run)
    _compare(unpatched, patched)
    if patched[0] == "returned":
        assert sends[0] == sends[1]  # as many notifies, to the same hosts


@SETTINGS
@given(params=PARAMS, tp_size=st.integers(1, 4), tp_group=tp_groups)
def test_release_write_prefill_blocks(
    mods: SimpleNamespace, params: dict[str, Any], tp_size: int, tp_group: int | None
) -> None:
    sends: list[list[tuple[Any, Any]]] = []

    def run() -> None:
        sent: list[tuple[Any, Any]] = []
        sends.append(sent)
        _scheduler(mods, tp_size, True, sent)._release_write_prefill_blocks("plain-request", dict(params))

    unpatched, patched = _both(mods, tp_group, run)
    _compare(unpatched, patched)
    if patched[0] == "returned":
        assert sends[0] == sends[1]


@SETTINGS
@given(
    tp_rank=st.integers(0, 3),
    world_size=st.one_of(st.none(), st.integers(1, 4)),
    remote_tp_size=st.one_of(st.none(), st.integers(0, 4)),
    remote_dp_size_local=st.integers(0, 3),
    remote_dp_size=st.integers(1, 3),
    decode_dp_rank=st.integers(0, 4),
    tp_group=tp_groups,
)
def test_write_notify(
    mods: SimpleNamespace,
    tp_rank: int,
    world_size: int | None,
    remote_tp_size: int | None,
    remote_dp_size_local: int,
    remote_dp_size: int,
    decode_dp_rank: int,
    tp_group: int | None,
) -> None:
    """The WRITE completion sender, driven as the writer runs it: execute, then finalize."""
    sends: list[list[tuple[Any, ...]]] = []

    def run() -> None:
        worker = WriterWorkerStandIn(tp_rank, world_size=world_size)
        sends.append(worker.moriio_wrapper.sent)
        writer = mods.engine.MoRIIOWriter(worker)
        names = {f.name for f in dataclasses.fields(mods.common.WriteTask)}
        fields = {
            "request_id": "req",
            "transfer_id": "tA",
            "dst_engine_id": "decode",
            "local_block_ids": [[1]],
            "remote_block_ids_hint": None,
            "layer_name": "layer0",
            "event": None,
            "remote_notify_port": 26005,
            "remote_ip": "10.0.0.1",
            "remote_tp_size": remote_tp_size,
            "remote_dp_size_local": remote_dp_size_local,
            "remote_dp_size": remote_dp_size,
        }
        task = mods.common.WriteTask(**{k: v for k, v in fields.items() if k in names})
        info = mods.common.RemoteAllocInfo(block_ids=None, decode_dp_rank=decode_dp_rank)
        worker.moriio_wrapper.done_remote_allocate_req_dict["tA"] = info
        writer._execute_write_task(task)
        info.writes_expected = 1
        info.writes_done = 1
        writer._finalize_if_complete("tA", info)

    unpatched, patched = _both(mods, tp_group, run)
    _compare(unpatched, patched)
    if patched[0] == "returned":
        assert [(t, ip, kind) for t, ip, _, kind in sends[0]] == [
            (t, ip, kind) for t, ip, _, kind in sends[1]
        ]
