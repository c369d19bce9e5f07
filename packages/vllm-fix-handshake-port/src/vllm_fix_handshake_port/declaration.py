"""The one declaration of this fix: runtime, tests, CLI and docs read it."""

from vllm_fix_core import Fix, Links, ProcessKind, Target, Upstream, UpstreamStatus
from vllm_fix_core.native import NativeEdit, SourceTree

PACKAGE = "vllm.distributed.kv_transfer.kv_connector.v1.moriio"
COMMON = f"{PACKAGE}.moriio_common"
CONNECTOR = f"{PACKAGE}.moriio_connector"
ENGINE = f"{PACKAGE}.moriio_engine"


def _links() -> Links:
    from vllm_fix_handshake_port import patch, probe

    return Links(probe.probe, patch.recognize, patch.apply)


def _native(tree: SourceTree) -> list[NativeEdit]:
    from vllm_fix_handshake_port import native

    return native.transform(tree)


FIX = Fix(
    id="handshake-port",
    title="MoRIIO handshake/notify ports: one injective offset per rank",
    distribution="vllm-fix-handshake-port",
    upstream=(
        Upstream(
            52014,
            UpstreamStatus.CLOSED,
            note="'Fix MoRIIO port collisions for deployments using both DP and TP'; closed "
            "unmerged, not in vLLM 0.32.0 or 0.33.0. Changes the per-rank port convention: "
            "prefill and decode instances must both run it.",
        ),
    ),
    why=(
        "With DP > 1 and TP > 1 on one host, MoRIIO listeners bind base + dp_local + tp "
        "(get_port_offset is called without tp_size) while the handshake dialer uses "
        "base + dp * tp_size + tp: ranks (dp0, tp1) and (dp1, tp0) both bind handshake_port+1 "
        "and notify_port+1, and dialers reach the wrong rank. The losing handshake listener "
        "thread dies with 'Address already in use', the worker waits on its ready event "
        "forever and start-up hangs with no error; a notify collision kills its thread "
        "silently and requests on that rank wait for notifications that never come."
    ),
    how=(
        "Every bind and dial site uses dp_local * tp_size + tp_rank with the listening "
        "engine's TP size: get_port_offset is wrapped where each caller reaches it (three "
        "module globals); a call without a TP size uses this engine's TP size (read where "
        "vLLM's from_vllm_config reads it) at the listener sites, and the peer's TP size inside "
        "the scheduler's notify senders and the WRITE notify sender (set by their wrappers). "
        "from_vllm_config also rejects handshake/notify bases whose port blocks overlap or "
        "overflow. Prefill and decode instances must both run it."
    ),
    retire_when=(
        "vLLM computes one injective per-rank offset (with tp_size) at every MoRIIO bind and "
        "dial site and rejects overlapping port blocks (the probe then reports 'fixed "
        "upstream'); drop the package once every supported release, on both the prefill and "
        "the decode side, does."
    ),
    targets=(
        Target(CONNECTOR, "get_port_offset", ProcessKind.WORKER),
        Target(COMMON, "get_port_offset", ProcessKind.WORKER),
        Target(ENGINE, "get_port_offset", ProcessKind.WORKER),
        Target(COMMON, "MoRIIOConfig.from_vllm_config", ProcessKind.WORKER),
        # Releases 0.14-0.26 dial the handshake listener without a TP size: wrapped there only.
        Target(CONNECTOR, "MoRIIOConnectorWorker._moriio_handshake", ProcessKind.WORKER, optional=True),
        # The WRITE-mode "blocks ready" notify (every release since MoRIIO entered, 0.14).
        Target(CONNECTOR, "MoRIIOConnectorScheduler.update_state_after_alloc", ProcessKind.ENGINE_CORE),
        # The WRITE prefill-block release sender exists from 0.24 on: it refines the fix there.
        Target(
            CONNECTOR,
            "MoRIIOConnectorScheduler._release_write_prefill_blocks",
            ProcessKind.ENGINE_CORE,
            optional=True,
        ),
        # The WRITE completion port is computed in one of these, depending on the release
        # (0.14-0.30: _finalize_if_complete, 0.31-0.32: _execute_write_task, 0.33:
        # _resolve_notify_endpoint); the one that calls get_port_offset is wrapped.
        Target(ENGINE, "MoRIIOWriter._finalize_if_complete", ProcessKind.WORKER, optional=True),
        Target(ENGINE, "MoRIIOWriter._execute_write_task", ProcessKind.WORKER, optional=True),
        Target(ENGINE, "MoRIIOWriter._resolve_notify_endpoint", ProcessKind.WORKER, optional=True),
    ),
    links=_links,
    native=_native,
    notes=(
        "Both sides must run it: peers derive each other's per-rank ports from the published "
        "bases, so a patched and an unpatched instance disagree wherever one of them has "
        "DP_local > 1 and TP > 1 (elsewhere both formulas give the same ports).",
        "Choose handshake_port/notify_port blocks outside net.ipv4.ip_local_port_range or list "
        "them in net.ipv4.ip_local_reserved_ports.",
    ),
)
