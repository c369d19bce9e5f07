"""The error an operator sees when a MoRIIO listener cannot bind (no vLLM imports)."""

from __future__ import annotations


class ListenerBindError(RuntimeError):
    """A MoRIIO handshake/notify listener could not bind its port."""

    def __init__(self, message: str, *, role: str, port: int | None, dp_rank: int, tp_rank: int) -> None:
        super().__init__(message)
        self.role = role
        self.port = port
        self.dp_rank = dp_rank
        self.tp_rank = tp_rank


def bind_error_message(
    role: str, port: int, dp_rank: int, tp_rank: int, setting: str, base: int | None, cause: object
) -> str:
    """Names the port, the rank, the cause and the base setting to change."""
    base_text = f"{setting}={base}" if base is not None else setting
    return (
        f"MoRIIO {role} listener of rank dp{dp_rank}/tp{tp_rank} cannot bind port {port}: "
        f"{cause}. The port is taken on this host (another vLLM instance, another service, "
        f"another rank of this instance, or an outgoing connection that drew it from "
        f"ip_local_port_range). Each rank listens on {setting} plus its rank offset; change "
        f"{base_text} in kv_transfer_config.kv_connector_extra_config so that the whole block is "
        "free on this host (give every instance on the host its own block, and keep it outside "
        "net.ipv4.ip_local_port_range or list it in net.ipv4.ip_local_reserved_ports). The "
        "same base must be used by the peers that dial this instance."
    )
