"""The one declaration of this fix: runtime, tests, CLI and docs read it."""

from vllm_fix_core import Fix, Links, ProcessKind, Target, Upstream, UpstreamStatus
from vllm_fix_core.native import NativeEdit, SourceTree

_PKG = "vllm.distributed.kv_transfer.kv_connector.v1.moriio"
COMMON = f"{_PKG}.moriio_common"
CONNECTOR = f"{_PKG}.moriio_connector"


def _links() -> Links:
    from vllm_fix_listener_port import patch, probe

    return Links(probe.probe, patch.recognize, patch.apply)


def _native(tree: SourceTree) -> list[NativeEdit]:
    from vllm_fix_listener_port import native

    return native.transform(tree)


FIX = Fix(
    id="listener-port",
    title="MoRIIO RDMA listener port chosen by the native engine",
    distribution="vllm-fix-listener-port",
    upstream=(Upstream(60641, UpstreamStatus.PENDING),),
    why=(
        "A MoRIIO worker dies at start-up with MORI's `tcp.cpp:166] syscall failed with Address "
        "already in use` and exit status 255, which Python cannot catch. "
        "MoRIIOConfig.from_vllm_config picks local_kv_port with get_open_port() (bind a probe "
        "socket, close it) and MORI binds that number later, in create_backend; every TP/DP rank "
        "on the host does this at the same time. With VLLM_PORT set every rank gets the same "
        "number (7 of 8 ranks die); without it the released ephemeral port can be handed to "
        "another rank's probe or to an unrelated outgoing connection before MORI binds it."
    ),
    how=(
        "Wrap MoRIIOConfig.from_vllm_config so the RDMA config never carries a released port. "
        "With a MORI that reports the port its listener auto-bound (every tag from v0.1.0, "
        "recognized by MORI's version) the config asks for port 0 and the kernel picks a free "
        "port atomically at MORI's bind. With an older or unversioned MORI the config carries "
        "a port this process holds (a bound, non-listening socket: exclusive bind, then "
        "SO_REUSEADDR so MORI's listener can bind it; scanned from VLLM_PORT when set) until "
        "the worker's __init__ has started MORI's listener. Wrap "
        "MoRIIOConnectorWorker.__init__ to end that hold (also when __init__ raises) and to "
        "store the port the engine descriptor reports in worker.local_kv_port and "
        "moriio_config.local_kv_port; an RDMA backend reporting port 0 is a clear "
        "ListenerPortError. vLLM publishes the kv port only inside that engine descriptor, "
        "after the bind, so nothing on the wire changes. XGMI (no TCP listener) and the "
        "unused local_ping_port are left as vLLM sets them."
    ),
    retire_when=(
        "vLLM's from_vllm_config no longer assigns local_kv_port from get_open_port() and the "
        "worker publishes the port its engine actually bound (the probe then reports 'fixed "
        "upstream' and nothing is patched); drop the package once every supported vLLM release "
        "does."
    ),
    targets=(
        Target(COMMON, "MoRIIOConfig.from_vllm_config", ProcessKind.WORKER),
        Target(CONNECTOR, "MoRIIOConnectorWorker.__init__", ProcessKind.WORKER),
    ),
    links=_links,
    native=_native,
    native_requires=(
        "MORI v0.1.0 or later (ROCm/mori#125): the carried worker binds port 0 and reads back the "
        "port MORI's listener bound; with an older MORI it stops at start-up with an error naming "
        "it (the runtime fix holds the port there instead)",
    ),
    # moriio_connector imports moriio_common itself, and the worker can only call
    # from_vllm_config after moriio_connector is imported.
    trigger=CONNECTOR,
    notes=(
        "Affected and fixed on every vLLM release from 0.14.1 to 0.33.0.",
        "local_ping_port is still filled by vLLM's get_open_port() probe: nothing binds, "
        "publishes or reads it (it only appears in the unused metadata_address), so the fix "
        "neither reserves nor rewrites it.",
    ),
)
