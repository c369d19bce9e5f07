"""vllm-fix-read-failure-ownership: hybrid MoRIIO READ failures and timeouts fail closed."""

from vllm_fix_read_failure_ownership.__about__ import __version__
from vllm_fix_read_failure_ownership.declaration import FIX

__all__ = ["FIX", "__version__"]
