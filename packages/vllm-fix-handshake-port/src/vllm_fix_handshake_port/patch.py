"""Apply: one injective port offset at every MoRIIO bind and dial site, and a port-layout check.

Wrappers only (nothing replaced):

* ``get_port_offset`` as every caller reaches it (the module globals of moriio_common,
  moriio_connector and moriio_engine: ``from x import get_port_offset`` keeps its own
  reference, so each is wrapped): :mod:`.offset`. A call that names a TP size keeps vLLM's
  formula (0, vLLM's "unknown", means this engine's TP size, as vLLM's ``_remote_tp_rank``
  assumes). A call without one uses the TP size of the engine that listens on the port:

  - inside a sender (a ``MoRIIOConnectorScheduler`` or ``MoRIIOWriter`` method that calls
    it), the peer's TP size, set by the sender's wrapper (``rule.listening_tp_size``;
    :mod:`.senders`);
  - anywhere else (the listener sites ``MoRIIOConfig.from_vllm_config`` and
    ``MoRIIOConnectorWorker.__init__``), this engine's TP size, read where vLLM's own
    ``from_vllm_config`` reads it (``get_tensor_model_parallel_world_size``; :mod:`.listener`).

  Where that state is missing (no TP group in this process, a worker without
  ``world_size``), the call keeps vLLM's formula: the fix never raises into vLLM.
* ``MoRIIOConfig.from_vllm_config``: rejects handshake/notify bases whose blocks of
  ``DP_local x TP`` ports overlap or run past 65535 (``rule.PortLayoutError``; :mod:`.listener`).

``recognize`` finds the callers of ``get_port_offset`` from the functions' code objects
(names they load), not by parsing modules, and classifies each by where it sits
(:mod:`.sites`); only a caller it cannot classify is parsed (its own source only), and refused
if it omits the TP size. See the README, "Releases".
"""

from __future__ import annotations

import inspect

from vllm_fix_core import PatchSet, UnknownShape, original_of, resolve_qualname
from vllm_fix_core.fingerprint import call_params
from vllm_fix_handshake_port import listener, offset, senders, sites


def recognize() -> str:
    mods = sites.modules()
    common = mods["moriio_common"]
    port_offset = original_of(common, "get_port_offset")
    sig = inspect.signature(port_offset)
    if (
        call_params(port_offset, ["dp_rank", "tp_rank", "tp_size"]) != ["dp_rank", "tp_rank", "tp_size"]
        or sig.parameters["tp_size"].default != 1
    ):
        raise UnknownShape(f"get_port_offset{sig} is not get_port_offset(dp_rank, tp_rank, tp_size=1)")
    if port_offset(1, 0, 2) != 2 or port_offset(3, 1, 4) != 13:
        raise UnknownShape("get_port_offset(dp, tp, tp_size) is no longer dp * tp_size + tp")
    for short, module in mods.items():
        if hasattr(module, "get_port_offset") and original_of(module, "get_port_offset") is not port_offset:
            raise UnknownShape(f"{short}.get_port_offset is not moriio_common.get_port_offset")
    found = sites.callers()
    for site, func in found.items():
        if sites.classify(site, func) == "sender":
            sites.check_sender(site, func)
    if not set(found) >= sites.LISTENER_SITES:
        missing = ", ".join(f"{m}:{q}" for m, q in sorted(sites.LISTENER_SITES - set(found)))
        raise UnknownShape(f"the listener sites moved: {missing} no longer calls get_port_offset")
    for name, known in sites.KNOWN_SITES.items():
        if set(found) == known:
            return name
    return "structural"


def apply(patch: PatchSet, shape: str) -> None:
    mods = sites.modules()
    for module in mods.values():
        if hasattr(module, "get_port_offset"):
            patch.wrap(module, "get_port_offset", offset.offset_wrapper_for(module))
    for site, func in sorted(sites.callers(reuse=True).items()):
        resolver = senders.RESOLVERS.get(sites.classify(site, func))
        if resolver is None:
            continue
        owner, attr = resolve_qualname(mods[site[0]], site[1])
        patch.wrap(owner, attr, senders.context_wrapper(func, resolver))
    patch.wrap(mods["moriio_common"].MoRIIOConfig, "from_vllm_config", listener.check_config_layout)
