"""The one declaration of this fix: runtime, tests, CLI and docs read it."""

from vllm_fix_core import Fix, ProcessKind, Target, Upstream, UpstreamStatus

PACKAGE = "vllm.distributed.kv_transfer.kv_connector.v1.moriio"
COMMON = f"{PACKAGE}.moriio_common"
CONNECTOR = f"{PACKAGE}.moriio_connector"
ENGINE = f"{PACKAGE}.moriio_engine"

FIX = Fix(
    id="handshake-port",
    title="MoRIIO handshake/notify ports: one injective offset per rank, no silent hangs",
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
        "module globals) and the functions that call it without a TP size (from_vllm_config, "
        "the worker's side-channel port, the scheduler's notify senders, the WRITE notify "
        "sender) set the listening TP size. A listener that cannot bind wakes the "
        "initializing thread, which raises an error naming the port, the rank and the base "
        "setting to change (the notify listener's bind is awaited, bounded); from_vllm_config "
        "rejects handshake/notify bases whose port blocks overlap or overflow; a handshake "
        "that reaches another rank's listener is refused with a message naming the "
        "convention mismatch. Prefill and decode instances must both run it."
    ),
    retire_when=(
        "vLLM computes one injective per-rank offset (with tp_size) at every MoRIIO bind and "
        "dial site and surfaces listener bind failures (the probe then reports 'fixed "
        "upstream'); drop the package once every supported release, on both the prefill and "
        "the decode side, does."
    ),
    targets=(
        Target(CONNECTOR, "get_port_offset", ProcessKind.WORKER),
        Target(COMMON, "get_port_offset", ProcessKind.WORKER),
        Target(ENGINE, "get_port_offset", ProcessKind.WORKER),
        Target(COMMON, "MoRIIOConfig.from_vllm_config", ProcessKind.WORKER),
        Target(CONNECTOR, "MoRIIOConnectorWorker.__init__", ProcessKind.WORKER),
        Target(CONNECTOR, "MoRIIOConnectorWorker._moriio_handshake_listener", ProcessKind.WORKER),
        Target(CONNECTOR, "MoRIIOConnectorWorker.register_kv_caches", ProcessKind.WORKER),
        Target(CONNECTOR, "MoRIIOConnectorWorker._moriio_handshake", ProcessKind.WORKER),
        Target(ENGINE, "MoRIIOWrapper.async_wait_reqid", ProcessKind.WORKER),
        Target(ENGINE, "MoRIIOWrapper.register_remote_engine", ProcessKind.WORKER),
        Target(ENGINE, "zmq_ctx", ProcessKind.WORKER),
        Target(ENGINE, "MoRIIOWriter", ProcessKind.WORKER),
        Target(CONNECTOR, "MoRIIOConnectorScheduler._release_write_prefill_blocks", ProcessKind.ENGINE_CORE),
        Target(CONNECTOR, "MoRIIOConnectorScheduler.update_state_after_alloc", ProcessKind.ENGINE_CORE),
    ),
    probe="vllm_fix_handshake_port.probe:probe",
    recognize="vllm_fix_handshake_port.patch:recognize",
    apply="vllm_fix_handshake_port.patch:apply",
    notes=(
        "Both sides must run it: peers derive each other's per-rank ports from the published "
        "bases, so a patched and an unpatched instance disagree wherever one of them has "
        "DP_local > 1 and TP > 1 (elsewhere both formulas give the same ports).",
        "Choose handshake_port/notify_port blocks outside net.ipv4.ip_local_port_range or list "
        "them in net.ipv4.ip_local_reserved_ports.",
    ),
)
