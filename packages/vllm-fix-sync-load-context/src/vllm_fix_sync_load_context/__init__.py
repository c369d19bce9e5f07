"""vllm-fix-sync-load-context: MRV2 FULL cudagraph steps start sync KV loads in the step's context."""

from vllm_fix_sync_load_context.__about__ import __version__
from vllm_fix_sync_load_context.declaration import FIX

__all__ = ["FIX", "__version__"]
