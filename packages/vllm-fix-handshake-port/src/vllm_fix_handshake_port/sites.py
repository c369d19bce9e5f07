"""Where vLLM's MoRIIO code calls ``get_port_offset``, and which side of a port each caller is on.

The callers are found from the functions' code objects (the names they load, through
``vllm_fix_core.callsites``), not by parsing modules, and each is placed by where it sits:

* listener: it binds a port of this engine (``MoRIIOConfig.from_vllm_config``,
  ``MoRIIOConnectorWorker.__init__``);
* sender: a ``MoRIIOConnectorScheduler`` method, sending to the peer engine's notify listeners;
* writer: a ``MoRIIOWriter`` method, sending the WRITE completion to the decode engine's listeners;
* explicit: every call passes a TP size (vLLM's formula is kept);
* dialer: a ``MoRIIOConnectorWorker`` method dialing a peer's listener with a ``remote_tp_size``.

Only a caller that is none of these is parsed (its calls only), and refused if it omits the TP
size. The inventories seen in releases name the shape; any other is "structural".
"""

from __future__ import annotations

import importlib
import inspect
import types
from types import ModuleType

from vllm_fix_core import UnknownShape
from vllm_fix_core.callsites import Callers, Site, every_call_passes

PACKAGE = "vllm.distributed.kv_transfer.kv_connector.v1.moriio"
COMMON = f"{PACKAGE}.moriio_common"
CONNECTOR = f"{PACKAGE}.moriio_connector"
ENGINE = f"{PACKAGE}.moriio_engine"
MODULES = {"moriio_common": COMMON, "moriio_connector": CONNECTOR, "moriio_engine": ENGINE}

SENDER_CLASS = "MoRIIOConnectorScheduler"  # sends to the peer engine's notify listeners
WRITER_CLASS = "MoRIIOWriter"  # sends WRITE completion to the decode engine's listeners
WORKER_CLASS = "MoRIIOConnectorWorker"
# Callers that bind a port of this engine (the TP size is this engine's).
LISTENER_SITES = frozenset(
    {
        ("moriio_common", "MoRIIOConfig.from_vllm_config"),
        ("moriio_connector", "MoRIIOConnectorWorker.__init__"),
    }
)

# The caller inventories seen in releases (pinned by test_recognized_shape_is_this_release on
# the session releases; 0.14.1-0.23.0 checked by the release matrix).
# Every release since MoRIIO entered vLLM (0.14) has these callers.
_FIRST_SITES: frozenset[Site] = frozenset(
    {
        ("moriio_common", "MoRIIOConfig.from_vllm_config"),
        ("moriio_connector", "MoRIIOConnectorScheduler.update_state_after_alloc"),
        ("moriio_connector", "MoRIIOConnectorWorker.__init__"),
        ("moriio_connector", "MoRIIOConnectorWorker._moriio_handshake"),
    }
)
# 0.24 added the WRITE prefill-block release sender.
_RELEASE = ("moriio_connector", "MoRIIOConnectorScheduler._release_write_prefill_blocks")
_SHARED_SITES = _FIRST_SITES | {_RELEASE}
_READ = ("moriio_connector", "MoRIIOConnectorWorker._read_blocks")
_FINALIZE = ("moriio_engine", "MoRIIOWriter._finalize_if_complete")
KNOWN_SITES: dict[str, frozenset[Site]] = {
    # no release sender; the handshake dial omits the TP size; no READ release; WRITE port in
    # finalize (finalize takes the task up to 0.23, the transfer id from 0.24)
    "vllm-0.14-0.23": _FIRST_SITES | {_FINALIZE},
    # the handshake dial omits the TP size; no READ release; WRITE port in finalize
    "vllm-0.24-0.26": _SHARED_SITES | {_FINALIZE},
    "vllm-0.27-0.30": _SHARED_SITES | {_READ, _FINALIZE},
    "vllm-0.31-0.32": _SHARED_SITES | {_READ, ("moriio_engine", "MoRIIOWriter._execute_write_task")},
    "vllm-0.33": _SHARED_SITES | {_READ, ("moriio_engine", "MoRIIOWriter._resolve_notify_endpoint")},
}


def modules() -> dict[str, ModuleType]:
    """vLLM's three MoRIIO modules by short name."""
    return {short: importlib.import_module(name) for short, name in MODULES.items()}


# The last inventory a scan found, reused by apply() while every function is unchanged.
_CALLERS = Callers("get_port_offset", modules)


def callers(*, reuse: bool = False) -> dict[Site, types.FunctionType]:
    """Every function of the three MoRIIO modules that calls get_port_offset (from code objects).

    ``reuse``: take the inventory the last scan found, once, if its functions are unchanged
    (apply right after recognize, in one decision).
    """
    return _CALLERS.scan(reuse=reuse)


def names_tp_size_everywhere(func: types.FunctionType) -> bool:
    """Does every get_port_offset call in `func` pass a TP size? (Parses its calls only.)"""
    return every_call_passes(func, "get_port_offset", 2, "tp_size")


def classify(site: Site, func: types.FunctionType) -> str:
    """'listener', 'sender', 'writer', 'dialer' or 'explicit'; UnknownShape for a caller it
    cannot place."""
    _, qualname = site
    owner = qualname.rpartition(".")[0]
    if site in LISTENER_SITES:
        return "listener"
    if owner == SENDER_CLASS:
        return "sender"
    if owner == WRITER_CLASS:
        return "writer"
    if names_tp_size_everywhere(func):
        return "explicit"
    if owner == WORKER_CLASS and (
        "remote_tp_size" in inspect.signature(func).parameters or qualname.endswith("._moriio_handshake")
    ):
        return "dialer"  # dials a peer's listener; the peer's TP size is its remote_tp_size
    raise UnknownShape(
        f"{site[0]}:{qualname} calls get_port_offset without a TP size, and it is neither a "
        "listener site, a scheduler sender, the WRITE notify sender nor a worker dial with a "
        "remote_tp_size: the listening engine's TP size there is unknown"
    )


def check_sender(site: Site, func: types.FunctionType) -> None:
    """A scheduler sender must show where the peer's TP size comes from."""
    params = set(inspect.signature(func).parameters)
    connector = importlib.import_module(CONNECTOR)
    if hasattr(connector, "get_moriio_peer_tp_size") and not params & {"params", "request"}:
        raise UnknownShape(
            f"{site[0]}:{site[1]} sends to a peer without 'params' or 'request': its peer TP size is unknown"
        )
