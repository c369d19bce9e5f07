"""vllm-fix-read-eligibility: MoRIIO READ consumers claim remote KV only for real remote prefills."""

from vllm_fix_read_eligibility.__about__ import __version__
from vllm_fix_read_eligibility.declaration import FIX

__all__ = ["FIX", "__version__"]
