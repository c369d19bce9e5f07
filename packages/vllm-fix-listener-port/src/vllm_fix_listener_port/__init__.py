"""vllm-fix-listener-port: the native MoRIIO engine chooses its RDMA listener port (no bind race)."""

from vllm_fix_listener_port.__about__ import __version__
from vllm_fix_listener_port.declaration import FIX

__all__ = ["FIX", "__version__"]
