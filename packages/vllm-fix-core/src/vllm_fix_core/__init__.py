"""vllm-fix-core: the shared runtime of the vllm-fixes packages."""

from vllm_fix_core.__about__ import __version__
from vllm_fix_core.declaration import (
    Check,
    Fix,
    Links,
    NotApplicable,
    ProbeReport,
    ProcessKind,
    Target,
    UnknownShape,
    Upstream,
    UpstreamStatus,
    resolve_qualname,
)
from vllm_fix_core.fingerprint import ast_fingerprint, function_ast, parse_source, unwrap
from vllm_fix_core.ladder import Answer, Decision, FixFailed, FixRefused, GuardAnswer, evaluate, summary_line
from vllm_fix_core.log import get_logger
from vllm_fix_core.patching import PatchConflict, PatchSet, layers_of, original_of
from vllm_fix_core.runtime import apply, decisions, install, revert
from vllm_fix_core.settings import InvalidSetting, Settings

__all__ = [
    "Answer",
    "Check",
    "Decision",
    "Fix",
    "FixFailed",
    "FixRefused",
    "GuardAnswer",
    "InvalidSetting",
    "Links",
    "NotApplicable",
    "PatchConflict",
    "PatchSet",
    "ProbeReport",
    "ProcessKind",
    "Settings",
    "Target",
    "UnknownShape",
    "Upstream",
    "UpstreamStatus",
    "__version__",
    "apply",
    "ast_fingerprint",
    "decisions",
    "evaluate",
    "function_ast",
    "get_logger",
    "install",
    "layers_of",
    "original_of",
    "parse_source",
    "resolve_qualname",
    "revert",
    "summary_line",
    "unwrap",
]
