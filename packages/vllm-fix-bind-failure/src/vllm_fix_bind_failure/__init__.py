"""vllm-fix-bind-failure: a MoRIIO handshake/notify listener that cannot bind fails start-up clearly."""

from vllm_fix_bind_failure.__about__ import __version__
from vllm_fix_bind_failure.declaration import FIX

__all__ = ["FIX", "__version__"]
