"""vllm-fix-completion-ownership: MultiConnector frees each request once, after every owner."""

from vllm_fix_completion_ownership.__about__ import __version__
from vllm_fix_completion_ownership.declaration import FIX

__all__ = ["FIX", "__version__"]
