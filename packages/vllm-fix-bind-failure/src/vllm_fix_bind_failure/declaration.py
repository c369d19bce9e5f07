"""The one declaration of this fix: runtime, tests, CLI and docs read it."""

from vllm_fix_core import Fix, Links, ProcessKind, Target, Upstream, UpstreamStatus
from vllm_fix_core.native import NativeEdit, SourceTree

PACKAGE = "vllm.distributed.kv_transfer.kv_connector.v1.moriio"
CONNECTOR = f"{PACKAGE}.moriio_connector"
ENGINE = f"{PACKAGE}.moriio_engine"


def _links() -> Links:
    from vllm_fix_bind_failure import patch, probe

    return Links(probe.probe, patch.recognize, patch.apply)


def _native(tree: SourceTree) -> list[NativeEdit]:
    from vllm_fix_bind_failure import native

    return native.transform(tree)


FIX = Fix(
    id="bind-failure",
    title="MoRIIO handshake/notify listeners: a port that cannot be bound fails start-up clearly",
    distribution="vllm-fix-bind-failure",
    upstream=(
        Upstream(
            52014,
            UpstreamStatus.CLOSED,
            note="part of 'Fix MoRIIO port collisions for deployments using both DP and TP'; "
            "closed unmerged. Carried here on its own, split from vllm-fix-handshake-port.",
        ),
    ),
    why=(
        "MoRIIO starts its handshake and notify listeners in threads. When the port is taken "
        "(two instances on one host with the same bases, a colliding rank, an outgoing "
        "connection that drew the port), the handshake listener thread dies with 'Address "
        "already in use' before it sets its ready event, and register_kv_caches waits on that "
        "event forever: start-up hangs with no error. The notify listener thread dies the same "
        "way after start-up has 'succeeded', and requests then wait for notifications that "
        "never come."
    ),
    how=(
        "The handshake listener's failure before it listens is recorded and its ready event "
        "set, so register_kv_caches wakes up and raises ListenerBindError naming the port, the "
        "rank and the base setting; the notify listener's bind outcome is reported by the "
        "ROUTER socket context it opens and awaited (10 s at most) by async_wait_reqid, which "
        "raises the same error."
    ),
    retire_when=(
        "vLLM surfaces a MoRIIO listener bind failure to the initializing thread (the probe "
        "then reports 'fixed upstream')."
    ),
    targets=(
        Target(CONNECTOR, "MoRIIOConnectorWorker._moriio_handshake_listener", ProcessKind.WORKER),
        Target(CONNECTOR, "MoRIIOConnectorWorker.register_kv_caches", ProcessKind.WORKER),
        Target(ENGINE, "MoRIIOWrapper.async_wait_reqid", ProcessKind.WORKER),
        Target(ENGINE, "zmq_ctx", ProcessKind.WORKER),
    ),
    links=_links,
    native=_native,
    notes=(
        "Independent of the port convention: useful with or without vllm-fix-handshake-port, and "
        "with DP = TP = 1 (two instances on one host with the default ports).",
    ),
)
