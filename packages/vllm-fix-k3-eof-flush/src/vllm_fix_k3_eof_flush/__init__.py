"""vllm-fix-k3-eof-flush: streaming Kimi K3 releases its held-back text at end of stream."""

from vllm_fix_k3_eof_flush.__about__ import __version__
from vllm_fix_k3_eof_flush.declaration import FIX

__all__ = ["FIX", "__version__"]
