"""Do this vLLM's MoRIIO listeners share ports, and do its senders miss them?

Drives vLLM's own sites as they are installed in this process (every wrapper on them
runs) for the ranks of a DP_local x TP = 2 x 2 engine, and reads the ports they use:

* listener: ``MoRIIOConfig.from_vllm_config`` (the notify port each rank binds; the
  handshake port of ``MoRIIOConnectorWorker.__init__`` uses the same offset and needs a
  MORI engine to run, so it is not driven);
* scheduler senders, on a decode-side scheduler as the engine core has it (no TP group in
  that process): ``MoRIIOConnectorScheduler._release_write_prefill_blocks`` (0.24+: the
  ports a release for DP rank d goes to) and ``update_state_after_alloc`` in WRITE mode
  (every release: the ports its "blocks ready" notify for DP rank d goes to, for vLLM's own
  ``Request`` and ``KVCacheBlocks``); the scheduler is built by the installed ``__init__``
  from vLLM's own config classes (``vllm_fix_core.guest.build``, no ``__post_init__``), so
  every attribute a release sets there is set as that release sets it (its module-wide
  effects, ``set_role`` and 0.14-0.23's ``get_ip``, answered privately: nothing changes);
  ``_send_transfer_release`` / ``send_notify_block`` are answered by recorders on the
  instance, as vLLM's own tests do;
* WRITE notify sender: ``MoRIIOWriter._execute_write_task`` then ``_finalize_if_complete``
  (the port the completion goes to), on a real ``MoRIIOWriter`` with vLLM's own
  ``WriteTask`` / ``RemoteAllocInfo``; the transport (``send_notify``) is a recorder
  (``vllm_fix_core.moriio_probe``, as are the configs the probe builds);
* handshake dialer: ``MoRIIOConnectorWorker._moriio_handshake`` for every prefill rank
  (the port it dials: the base it is given is an ``int`` that records the offset added to
  it and stops the dial there, before any socket is made);
* layout: ``from_vllm_config`` with notify_port inside the handshake block (overlap).

What differs between releases is read from the installed code in one place,
:func:`_installed` (which senders exist, how ``_finalize_if_complete`` is called, what
keys a write allocation); every object is built from the installed signatures (dataclass
fields, parameter names).

``from_vllm_config`` is run as installed (every wrapper on it) through
``vllm_fix_core.moriio_probe.from_vllm_config``: vLLM's function on a private copy of its
module's globals in which ``get_open_port`` is a port the kernel picks (never ``VLLM_PORT``,
which vLLM's ``get_open_port`` binds when it is set). It reads the TP group
(``get_tensor_model_parallel_rank`` / ``_world_size``; ``get_ip`` on 0.14-0.23); a probe
has no TP group, so those names of ``moriio_common`` answer for the probe's rank for the
duration of the probe (under a lock, restored after). Nothing else is set: the TP size the
fix needs is read by the installed code from the same getter vLLM reads.
While the scheduler senders and the dialer run, the TP-group getters of ``moriio_common`` and
``moriio_connector`` answer as vLLM's do in an engine core without a TP group (they
raise), whatever process the probe runs in: a sender that does not size the offset
with the peer's TP size is then seen even where this process has a TP group of the
peer's size.

Every expected port is a port a listener site of the installed vLLM computed
(``from_vllm_config``) or a constant of the spec; no code of the fix computes one.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

from vllm_fix_core import Check, ProbeReport
from vllm_fix_core.moriio_probe import (
    HOST,
    WriterWorkerStandIn,
    build_config,
    extra_config,
    from_vllm_config,
    parallel_config,
    scheduler_without_requests,
    vllm_config,
)

PACKAGE = "vllm.distributed.kv_transfer.kv_connector.v1.moriio"
DP_LOCAL, TP = 2, 2
HANDSHAKE, NOTIFY = 16301, 26005
# The router's request id embeds both peers' MoRIIO addresses (vLLM's moriio_common:
# "___prefill_addr_{zmq}___decode_addr_{zmq}_{32-hex uuid}", zmq "host:IP,handshake:P,notify:P");
# 0.20+ schedulers read the peer's notify base from it. Both peers here publish the same bases.
_PEER_ZMQ = f"host:{HOST},handshake:{HANDSHAKE},notify:{NOTIFY}"


def _router_request_id(name: str) -> str:
    return f"{name}___prefill_addr_{_PEER_ZMQ}___decode_addr_{_PEER_ZMQ}_{'0' * 31}1"


_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True)
class _Installed:
    """What the installed release offers the probe (the one place release shapes are read)."""

    release_sender: bool  # MoRIIOConnectorScheduler._release_write_prefill_blocks (0.24+)
    finalize_takes_task: bool  # _finalize_if_complete(task, info) counting layers (0.14-0.23)
    alloc_key: str  # the WriteTask field done_remote_allocate_req_dict is keyed by


def _installed(common: ModuleType, connector: ModuleType, engine: ModuleType) -> _Installed:
    finalize = inspect.signature(engine.MoRIIOWriter._finalize_if_complete)
    task_fields = {f.name for f in dataclasses.fields(common.WriteTask)}
    return _Installed(
        release_sender=hasattr(connector.MoRIIOConnectorScheduler, "_release_write_prefill_blocks"),
        finalize_takes_task=list(finalize.parameters)[1:2] == ["task"],
        alloc_key="transfer_id" if "transfer_id" in task_fields else "request_id",
    )


def _mods() -> tuple[ModuleType, ModuleType, ModuleType]:
    return (
        importlib.import_module(f"{PACKAGE}.moriio_common"),
        importlib.import_module(f"{PACKAGE}.moriio_connector"),
        importlib.import_module(f"{PACKAGE}.moriio_engine"),
    )


class _Rank:
    """The rank the TP-group getters answer for while the probe runs (``in_group`` False:
    no TP group, as in an engine core; the getters raise as vLLM's do)."""

    tp_rank = 0
    tp_size = TP
    in_group = True

    def rank(self) -> int:
        if not self.in_group:
            raise AssertionError("tensor model parallel group is not initialized")
        return self.tp_rank

    def size(self) -> int:
        if not self.in_group:
            raise AssertionError("tensor model parallel group is not initialized")
        return self.tp_size


@contextmanager
def _tp_group(common: ModuleType, connector: ModuleType, rank: _Rank) -> Iterator[None]:
    getters = {
        "get_tensor_model_parallel_rank": rank.rank,
        "get_tensor_model_parallel_world_size": rank.size,
    }
    sockets: dict[str, Any] = {}
    if "get_ip" in vars(common):  # 0.14-0.23 read the local IP in from_vllm_config
        sockets["get_ip"] = lambda: HOST
    layers: list[tuple[ModuleType, dict[str, Any]]] = [
        (common, {**getters, **sockets}),
        (connector, {name: value for name, value in getters.items() if name in vars(connector)}),
    ]
    with _LOCK:
        saved = [
            (module, {n: vars(module)[n] for n in names if n in vars(module)}) for module, names in layers
        ]
        try:
            for module, names in layers:
                for name, value in names.items():
                    setattr(module, name, value)
            yield
        finally:
            for (module, names), (_, old) in zip(layers, saved, strict=True):
                for name in names:
                    if name in old:
                        setattr(module, name, old[name])
                    else:
                        delattr(module, name)


def _vllm_config(dp_rank: int, notify: int = NOTIFY) -> Any:
    return vllm_config(extra_config(HANDSHAKE, notify), parallel=parallel_config(dp_rank, DP_LOCAL))


def _listener_ports(common: ModuleType, rank: _Rank) -> dict[tuple[int, int], int]:
    ports = {}
    for dp in range(DP_LOCAL):
        config = _vllm_config(dp)
        for tp in range(TP):
            rank.tp_rank = tp
            ports[(dp, tp)] = int(from_vllm_config(common, config).notify_port)
    return ports


def _layout_accepted(common: ModuleType) -> bool:
    try:
        from_vllm_config(common, _vllm_config(0, notify=HANDSHAKE + 1))
    except ValueError:
        return False
    return True


def _decode_scheduler(
    connector: ModuleType, common: ModuleType, tp_size: int = TP, dp_local: int = DP_LOCAL
) -> Any:
    """vLLM's ``MoRIIOConnectorScheduler`` of a decode engine (TP size `tp_size`, DP rank 0 of
    `dp_local`, WRITE mode, one full-attention KV group) built by the installed ``__init__`` from
    vLLM's own config classes (``moriio_probe.build_config``: ``guest.build``, vLLM's defaults, no
    ``__post_init__``), holding no requests (``moriio_probe.scheduler_without_requests``)."""
    from vllm.config import CacheConfig, KVTransferConfig, ParallelConfig, VllmConfig

    extra = extra_config(HANDSHAKE, NOTIFY, read_mode="false")
    config = build_config(
        VllmConfig,
        parallel_config=build_config(
            ParallelConfig,
            tensor_parallel_size=tp_size,
            data_parallel_rank=0,
            data_parallel_size=dp_local,
            data_parallel_size_local=dp_local,
        ),
        cache_config=build_config(CacheConfig, block_size=16),
        kv_transfer_config=build_config(
            KVTransferConfig,
            kv_connector="MoRIIOConnector",
            kv_role="kv_consumer",
            kv_connector_extra_config=extra,
        ),
    )
    scheduler = scheduler_without_requests(connector, config)
    # 0.14-0.22 take the mode from VLLM_MORIIO_CONNECTOR_READ_MODE, not from the config: the
    # senders probed here are WRITE mode's whatever this process runs.
    scheduler.mode = common.MoRIIOMode.WRITE
    return scheduler


def _release_ports(connector: ModuleType, common: ModuleType, dp: int) -> set[int]:
    sent: list[int] = []
    scheduler = _decode_scheduler(connector, common)
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


def _alloc_notify_ports(connector: ModuleType, common: ModuleType, dp: int) -> list[int]:
    """The ports vLLM's WRITE-mode ``update_state_after_alloc`` sends "blocks ready" to, on a
    decode scheduler (TP size TP), for a request whose prefill ran on DP rank ``dp``."""
    sent: list[int] = []

    def send_notify_block(*args: Any, **kwargs: Any) -> None:
        port = kwargs["port"] if "port" in kwargs else args[4]
        sent.append(int(port))

    scheduler = _decode_scheduler(connector, common)
    scheduler.send_notify_block = send_notify_block
    params = {
        "do_remote_prefill": True,
        "transfer_id": f"probe-alloc-{dp}",
        "remote_dp_rank": dp,
        "is_request_leader": True,
        "remote_host": HOST,
        "remote_notify_port": NOTIFY,
        "remote_tp_size": TP,
        "remote_dp_size": DP_LOCAL,
        "remote_dp_size_local": DP_LOCAL,
    }
    request = _request(_router_request_id(f"probe-alloc-{dp}"), params)
    scheduler.update_state_after_alloc(request, _blocks(3, 4), 32)  # 32 tokens to fetch: not a local hit
    return sent


def _request(request_id: str, kv_transfer_params: dict[str, Any]) -> Any:
    """vLLM's ``Request`` (built by its ``__init__``, which reads `kv_transfer_params` from the
    sampling params as the engine hands them over): 32 prompt tokens, one to generate."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    sampling = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": kv_transfer_params})
    values: dict[str, Any] = {
        "request_id": request_id,
        "prompt_token_ids": list(range(32)),
        "sampling_params": sampling,
        "pooling_params": None,
    }
    if "eos_token_id" in inspect.signature(Request.__init__).parameters:  # 0.14-0.16
        values["eos_token_id"] = None
    return Request(**values)


def _blocks(*block_ids: int) -> Any:
    """vLLM's ``KVCacheBlocks`` as the KV cache manager allocates them: one KV cache group."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    return KVCacheBlocks(([KVCacheBlock(block_id) for block_id in block_ids],))


class _Dialed(Exception):
    """Raised by :class:`_DialPort` the moment the dialer adds its offset: the dial stops there."""

    def __init__(self, offset: int | None) -> None:
        super().__init__(offset)
        self.offset = offset


class _DialPort(int):
    """The handshake base as the dialer receives it: ``base + offset`` records the offset and
    stops the dial before any socket is made."""

    def __add__(self, other: Any) -> int:
        raise _Dialed(int(other))

    __radd__ = __add__


class _UnusableHost:
    """A host no socket path can be made of: should a dialer not add to the port first, it
    stops here rather than dial anything."""

    def __format__(self, spec: str) -> str:
        raise _Dialed(None)

    def __str__(self) -> str:
        raise _Dialed(None)


def _dial_offset(connector: ModuleType, dp: int, tp: int) -> int | None:
    """The offset vLLM's ``MoRIIOConnectorWorker._moriio_handshake`` dials for prefill rank
    (dp, tp) of a TP engine, from decode rank tp of a TP engine (homogeneous: it dials its
    own TP index)."""
    worker = connector.MoRIIOConnectorWorker.__new__(connector.MoRIIOConnectorWorker)
    vars(worker).update(tp_rank=tp, world_size=TP)
    try:
        worker._moriio_handshake(_UnusableHost(), _DialPort(HANDSHAKE), TP, "probe-prefill", dp)
    except _Dialed as dialed:
        return dialed.offset
    return None  # returned without dialing: not a dial this probe knows


def _write_notify_port(
    common: ModuleType,
    engine: ModuleType,
    installed: _Installed,
    dp: int,
    tp: int,
    world_size: int | None = TP,
    task_tp_size: int = TP,
) -> int | None:
    """The port a decode rank (dp, tp) is notified on; `world_size` None is a worker without
    one (vLLM's own writer tests), `task_tp_size` 0 a task that does not know the decode TP."""
    # 0.14-0.23 finalize once every layer is written: one layer here
    worker = WriterWorkerStandIn(tp, world_size, remote_dp_size_local=DP_LOCAL, num_layers=1)
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
        "remote_tp_size": task_tp_size,
        "remote_dp_size_local": DP_LOCAL,
        "remote_dp_size": DP_LOCAL,
    }
    task = common.WriteTask(**{k: v for k, v in fields.items() if k in names})
    info = common.RemoteAllocInfo(block_ids=None, decode_dp_rank=dp)
    key = getattr(task, installed.alloc_key)
    worker.moriio_wrapper.done_remote_allocate_req_dict[key] = info
    writer._execute_write_task(task)  # blocks not ready: resolves the completion target, returns
    if installed.finalize_takes_task:
        writer._finalize_if_complete(task, info)  # counts this layer's write: the last one
    else:
        info.writes_expected = 1
        info.writes_done = 1
        writer._finalize_if_complete(key, info)
    ports = worker.moriio_wrapper.ports
    return ports[0] if ports else None


def probe() -> ProbeReport:
    common, connector, engine = _mods()
    installed = _installed(common, connector, engine)
    rank = _Rank()
    with _tp_group(common, connector, rank):
        listen = _listener_ports(common, rank)
        rank.tp_rank = 0
        layout_accepted = _layout_accepted(common)
        rank.in_group = False  # the scheduler senders run in the engine core: no TP group there
        senders = range(DP_LOCAL) if installed.release_sender else range(0)
        releases = {dp: _release_ports(connector, common, dp) for dp in senders}
        allocs = {dp: _alloc_notify_ports(connector, common, dp) for dp in range(DP_LOCAL)}
        dials = {r: _dial_offset(connector, *r) for r in listen}
    owners: dict[int, tuple[int, int]] = {}
    collisions = []
    for r, port in listen.items():
        if port in owners:
            collisions.append(f"ranks {owners[port]} and {r} both bind notify port {port}")
        owners.setdefault(port, r)
    release_misses = []
    alloc_misses = []
    write_misses = []
    for dp in range(DP_LOCAL):
        want = {listen[(dp, tp)] for tp in range(TP)}
        got = releases.get(dp, want)  # no release sender before 0.24: nothing to miss
        if got != want:
            release_misses.append(
                f"a release for DP rank {dp} goes to {sorted(got)}, its ranks listen on {sorted(want)}"
            )
        # One "blocks ready" notify per prefill TP rank of DP rank dp, each at its listener.
        if sorted(allocs[dp]) != sorted(want) or len(allocs[dp]) != TP:
            alloc_misses.append(
                f'WRITE "blocks ready" for DP rank {dp} goes to {sorted(allocs[dp])}, '
                f"its ranks listen on {sorted(want)}"
            )
        for tp in range(TP):
            notify = _write_notify_port(common, engine, installed, dp, tp)
            if notify != listen[(dp, tp)]:
                write_misses.append(
                    f"WRITE completion for {(dp, tp)} goes to {notify}, it listens on {listen[(dp, tp)]}"
                )
    # The handshake listener of rank r binds handshake_port + the offset its notify port has.
    dial_misses = [
        f"the handshake dial for {r} goes to "
        f"{'no port' if dials[r] is None else HANDSHAKE + int(dials[r] or 0)}, "
        f"it listens on {HANDSHAKE + port - NOTIFY}"
        for r, port in listen.items()
        if dials[r] is None or NOTIFY + int(dials[r] or 0) != port
    ]
    # The release sender exists from 0.24 on: checked where it is there.
    release_checks = (
        [Check("release-misses-listener", bool(release_misses), "; ".join(release_misses[:1]), guard=True)]
        if installed.release_sender
        else []
    )
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
            *release_checks,
            Check(
                "alloc-notify-misses-listener", bool(alloc_misses), "; ".join(alloc_misses[:1]), guard=True
            ),
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
