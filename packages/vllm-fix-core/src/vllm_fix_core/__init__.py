"""vllm-fix-core: the shared runtime of the vllm-fixes packages."""

from vllm_fix_core.__about__ import __version__
from vllm_fix_core.declaration import (
    Check,
    Fix,
    ProbeReport,
    ProcessKind,
    Target,
    UnknownShape,
    Upstream,
    UpstreamStatus,
)
from vllm_fix_core.fingerprint import ast_fingerprint
from vllm_fix_core.ladder import Decision, FixFailed, FixRefused, Rung
from vllm_fix_core.patching import PatchConflict, PatchSet
from vllm_fix_core.runtime import apply, decisions, install, revert
from vllm_fix_core.settings import Settings

__all__ = [
    "Check",
    "Decision",
    "Fix",
    "FixFailed",
    "FixRefused",
    "PatchConflict",
    "PatchSet",
    "ProbeReport",
    "ProcessKind",
    "Rung",
    "Settings",
    "Target",
    "UnknownShape",
    "Upstream",
    "UpstreamStatus",
    "__version__",
    "apply",
    "ast_fingerprint",
    "decisions",
    "install",
    "revert",
]
