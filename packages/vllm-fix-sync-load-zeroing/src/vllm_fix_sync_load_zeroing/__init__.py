"""vllm-fix-sync-load-zeroing: KV-cache zeroing never races a synchronous MoRIIO READ."""

from vllm_fix_sync_load_zeroing.__about__ import __version__
from vllm_fix_sync_load_zeroing.declaration import FIX

__all__ = ["FIX", "__version__"]
