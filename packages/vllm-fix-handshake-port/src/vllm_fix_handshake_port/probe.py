"""Do this vLLM's MoRIIO listeners share ports, and do its senders miss them?

Drives vLLM's own sites as they are installed in this process (every wrapper on them
runs) for the ranks of a DP_local x TP = 2 x 2 engine, and reads the ports they use:

* listener: ``MoRIIOConfig.from_vllm_config`` (the notify port each rank binds; the
  handshake port of ``MoRIIOConnectorWorker.__init__`` uses the same offset and needs a
  MORI engine to run, so it is not driven);
* scheduler sender: ``MoRIIOConnectorScheduler._release_write_prefill_blocks`` (the ports
  a release for DP rank d goes to; its ``_send_transfer_release`` is answered by a
  recorder on the instance, as vLLM's own tests do);
* WRITE notify sender: ``MoRIIOWriter._execute_write_task`` then ``_finalize_if_complete``
  (the port the completion goes to), on a real ``MoRIIOWriter`` with vLLM's own
  ``WriteTask`` / ``RemoteAllocInfo``; the transport (``send_notify``) is a recorder;
* layout: ``from_vllm_config`` with notify_port inside the handshake block (overlap).

``from_vllm_config`` reads the TP group (``get_tensor_model_parallel_rank`` /
``_world_size``) and opens sockets (``get_open_port``); a probe has no TP group and
opens none, so those three names of ``moriio_common`` answer for the probe's rank for
the duration of the probe (under a lock, restored after). Nothing else is set: the TP
size the fix needs is read by the installed code from the same getter vLLM reads.
"""

from __future__ import annotations

import dataclasses
import importlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType, SimpleNamespace
from typing import Any

from vllm_fix_core import Check, ProbeReport

PACKAGE = "vllm.distributed.kv_transfer.kv_connector.v1.moriio"
DP_LOCAL, TP = 2, 2
HANDSHAKE, NOTIFY = 16301, 26005
HOST = "127.0.0.1"

_LOCK = threading.Lock()


def _mods() -> tuple[ModuleType, ModuleType, ModuleType]:
    return (
        importlib.import_module(f"{PACKAGE}.moriio_common"),
        importlib.import_module(f"{PACKAGE}.moriio_connector"),
        importlib.import_module(f"{PACKAGE}.moriio_engine"),
    )


class _Rank:
    """The rank the TP-group getters answer for while the probe runs."""

    tp_rank = 0
    tp_size = TP


@contextmanager
def _tp_group(common: ModuleType, rank: _Rank) -> Iterator[None]:
    names = {
        "get_tensor_model_parallel_rank": lambda: rank.tp_rank,
        "get_tensor_model_parallel_world_size": lambda: rank.tp_size,
        "get_open_port": lambda: 0,
    }
    with _LOCK:
        saved = {name: vars(common)[name] for name in names if name in vars(common)}
        try:
            for name, value in names.items():
                setattr(common, name, value)
            yield
        finally:
            for name in names:
                if name in saved:
                    setattr(common, name, saved[name])
                else:
                    delattr(common, name)


def _vllm_config(dp_rank: int, notify: int = NOTIFY) -> Any:
    from vllm.config import KVTransferConfig

    extra = {
        "handshake_port": str(HANDSHAKE),
        "notify_port": str(notify),
        "http_port": "8000",
        "host_ip": HOST,  # resolve_host_ip reads it: no get_ip() socket
        "proxy_ip": "",
        "proxy_ping_port": "0",  # read unconditionally by releases before 0.28
    }
    return SimpleNamespace(
        kv_transfer_config=KVTransferConfig(
            kv_connector="MoRIIOConnector", kv_role="kv_producer", kv_connector_extra_config=extra
        ),
        parallel_config=SimpleNamespace(
            data_parallel_rank=dp_rank, data_parallel_size_local=DP_LOCAL, data_parallel_size=DP_LOCAL
        ),
    )


def _listener_ports(common: ModuleType, rank: _Rank) -> dict[tuple[int, int], int]:
    ports = {}
    for dp in range(DP_LOCAL):
        config = _vllm_config(dp)
        for tp in range(TP):
            rank.tp_rank = tp
            ports[(dp, tp)] = int(common.MoRIIOConfig.from_vllm_config(config).notify_port)
    return ports


def _layout_accepted(common: ModuleType) -> bool:
    try:
        common.MoRIIOConfig.from_vllm_config(_vllm_config(0, notify=HANDSHAKE + 1))
    except ValueError:
        return False
    return True


def _release_ports(connector: ModuleType, dp: int) -> set[int]:
    sent: list[int] = []
    scheduler = connector.MoRIIOConnectorScheduler.__new__(connector.MoRIIOConnectorScheduler)
    scheduler.tp_size = TP
    scheduler._send_transfer_release = lambda transfer_id, host, port: sent.append(int(port))
    params = {
        "transfer_id": "probe",
        "remote_dp_rank": dp,
        "remote_host": HOST,
        "remote_notify_port": NOTIFY,
        "remote_tp_size": TP,
    }
    scheduler._release_write_prefill_blocks("probe-request", params)
    return set(sent)


class _Transport:
    """Answers what the writer asks of MoRIIOWrapper; records the notify it sends."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done_req_ids: list[Any] = []
        self.done_remote_allocate_req_dict: dict[str, Any] = {}
        self.sent: list[int] = []

    def send_notify(self, transfer_id: Any, remote_ip: Any, remote_port: Any, *a: Any, **k: Any) -> None:
        self.sent.append(int(remote_port))

    def waiting_for_transfer_complete(self, statuses: Any, *a: Any, **k: Any) -> None:
        return None

    def _mark_transfer_terminal_locked(self, transfer_id: Any) -> None:
        return None

    def _is_transfer_terminal_locked(self, transfer_id: Any) -> bool:
        return False


class _Worker:
    """The worker fields the writer reads on this path (a weak reference must be possible)."""

    def __init__(self, tp_rank: int) -> None:
        self.tp_rank = tp_rank
        self.world_size = TP
        self.moriio_wrapper = _Transport()
        self.moriio_config = SimpleNamespace(defer_timeout=60.0)
        self.remote_dp_size_local = DP_LOCAL


def _write_notify_port(common: ModuleType, engine: ModuleType, dp: int, tp: int) -> int | None:
    worker = _Worker(tp)
    writer = engine.MoRIIOWriter(worker)
    names = {f.name for f in dataclasses.fields(common.WriteTask)}
    fields = {
        "request_id": "probe-request",
        "transfer_id": "probe",
        "dst_engine_id": "probe-decode",
        "local_block_ids": [[0]],
        "remote_block_ids_hint": None,
        "layer_name": "probe-layer",
        "event": None,
        "remote_notify_port": NOTIFY,
        "remote_ip": HOST,
        "remote_tp_size": TP,
        "remote_dp_size_local": DP_LOCAL,
        "remote_dp_size": DP_LOCAL,
    }
    task = common.WriteTask(**{k: v for k, v in fields.items() if k in names})
    info = common.RemoteAllocInfo(block_ids=None, decode_dp_rank=dp)
    worker.moriio_wrapper.done_remote_allocate_req_dict["probe"] = info
    writer._execute_write_task(task)  # blocks not ready: resolves the completion target, returns
    info.writes_expected = 1
    info.writes_done = 1
    writer._finalize_if_complete("probe", info)
    return worker.moriio_wrapper.sent[0] if worker.moriio_wrapper.sent else None


def probe() -> ProbeReport:
    common, connector, engine = _mods()
    rank = _Rank()
    with _tp_group(common, rank):
        listen = _listener_ports(common, rank)
        rank.tp_rank = 0
        layout_accepted = _layout_accepted(common)
    owners: dict[int, tuple[int, int]] = {}
    collisions = []
    for r, port in listen.items():
        if port in owners:
            collisions.append(f"ranks {owners[port]} and {r} both bind notify port {port}")
        owners.setdefault(port, r)
    release_misses = []
    write_misses = []
    for dp in range(DP_LOCAL):
        want = {listen[(dp, tp)] for tp in range(TP)}
        got = _release_ports(connector, dp)
        if got != want:
            release_misses.append(
                f"a release for DP rank {dp} goes to {sorted(got)}, its ranks listen on {sorted(want)}"
            )
        for tp in range(TP):
            notify = _write_notify_port(common, engine, dp, tp)
            if notify != listen[(dp, tp)]:
                write_misses.append(
                    f"WRITE completion for {(dp, tp)} goes to {notify}, it listens on {listen[(dp, tp)]}"
                )
    # The handshake dialer (_moriio_handshake) names the listener's TP size.
    dial_misses = [
        f"the handshake dial for {r} goes to {HANDSHAKE + dial}, it listens on {HANDSHAKE + port - NOTIFY}"
        for r, port in listen.items()
        for dial in [int(connector.get_port_offset(r[0], r[1], TP))]
        if NOTIFY + dial != port
    ]
    explicit = common.get_port_offset(3, 1, 4)
    return ProbeReport(
        (
            Check("listener-ports-collide", bool(collisions), "; ".join(collisions)),
            Check("handshake-dial-misses-listener", bool(dial_misses), "; ".join(dial_misses[:1])),
            Check(
                "overlapping-port-blocks-accepted",
                layout_accepted,
                f"handshake_port={HANDSHAKE} and notify_port={HANDSHAKE + 1} accepted for "
                f"{DP_LOCAL}x{TP} ranks"
                if layout_accepted
                else "",
            ),
            # Guards: the senders must reach the ranks' listeners, whatever the convention.
            Check("release-misses-listener", bool(release_misses), "; ".join(release_misses[:1]), guard=True),
            Check(
                "write-notify-misses-listener", bool(write_misses), "; ".join(write_misses[:1]), guard=True
            ),
            Check(
                "explicit-tp-size-offset",
                explicit != 13,
                f"get_port_offset(3, 1, 4) = {explicit}" if explicit != 13 else "",
                guard=True,
            ),
        )
    )
