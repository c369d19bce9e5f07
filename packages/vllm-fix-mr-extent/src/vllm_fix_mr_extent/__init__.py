"""vllm-fix-mr-extent: MoRIIO's shared KV memory region covers exactly what it must, inside its storage."""

from vllm_fix_mr_extent.__about__ import __version__
from vllm_fix_mr_extent.declaration import FIX

__all__ = ["FIX", "__version__"]
