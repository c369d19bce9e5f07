"""The switches an operator has: per-fix disable and strict mode."""

from __future__ import annotations

import os
from dataclasses import dataclass

DISABLE_ENV = "VLLM_FIXES_DISABLE"
STRICT_ENV = "VLLM_FIXES_STRICT"
_TRUE = {"1", "true", "yes", "on"}


def normalize_id(name: str) -> str:
    """'vllm_fix_read_eligibility', 'vllm-fix-read-eligibility', 'read_eligibility' -> 'read-eligibility'."""
    name = name.strip().lower().replace("_", "-")
    for prefix in ("vllm-fix-",):
        if name.startswith(prefix):
            name = name[len(prefix) :]
    return name


@dataclass(frozen=True)
class Settings:
    disabled: frozenset[str]
    strict: bool

    @classmethod
    def from_env(cls) -> Settings:
        raw = os.environ.get(DISABLE_ENV, "")
        disabled = frozenset(normalize_id(x) for x in raw.split(",") if x.strip())
        strict = os.environ.get(STRICT_ENV, "").strip().lower() in _TRUE
        return cls(disabled=disabled, strict=strict)

    def is_disabled(self, fix_id: str) -> bool:
        return "all" in self.disabled or normalize_id(fix_id) in self.disabled


def vllm_plugins_filter() -> list[str] | None:
    """vLLM's own VLLM_PLUGINS allowlist, parsed the way vLLM parses it."""
    raw = os.environ.get("VLLM_PLUGINS")
    if raw is None:
        return None
    return raw.split(",")
