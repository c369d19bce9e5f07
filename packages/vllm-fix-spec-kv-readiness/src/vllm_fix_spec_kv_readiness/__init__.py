"""vllm-fix-spec-kv-readiness: a speculative step's KV output covers the whole step, and READ
producers publish blocks only once the step's draft KV is on the device."""

from vllm_fix_spec_kv_readiness.__about__ import __version__
from vllm_fix_spec_kv_readiness.declaration import FIX

__all__ = ["FIX", "__version__"]
