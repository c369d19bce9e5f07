"""vllm-fix-handshake-port: one injective MoRIIO handshake/notify port per rank."""

from vllm_fix_handshake_port.__about__ import __version__
from vllm_fix_handshake_port.declaration import FIX

__all__ = ["FIX", "__version__"]
