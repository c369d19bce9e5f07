"""vllm-fixes: every vLLM fix of this project, pinned exactly. See `vllm-fixes list`."""

from vllm_fixes.__about__ import __version__

__all__ = ["__version__"]
