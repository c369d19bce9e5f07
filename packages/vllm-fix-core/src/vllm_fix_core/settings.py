"""The switches an operator has: per-fix disable, strict mode, a decision report file."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

DISABLE_ENV = "VLLM_FIXES_DISABLE"
STRICT_ENV = "VLLM_FIXES_STRICT"
REPORT_ENV = "VLLM_FIXES_REPORT"
SWITCHES = (DISABLE_ENV, STRICT_ENV, REPORT_ENV)
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})
ALL = "all"


class InvalidSetting(ValueError):
    """A switch holds a value we cannot read (never silently taken as 'off')."""


def normalize_id(name: str) -> str:
    """'vllm_fix_read_eligibility', 'vllm-fix-read-eligibility', 'read_eligibility' -> 'read-eligibility'."""
    name = name.strip().lower().replace("_", "-")
    for prefix in ("vllm-fix-",):
        if name.startswith(prefix):
            name = name[len(prefix) :]
    return name


def parse_strict(raw: str | None) -> bool:
    value = (raw or "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise InvalidSetting(
        f"{STRICT_ENV}={raw!r} is not a valid value: use 1/true/yes/on or 0/false/no/off (or leave it unset)"
    )


@dataclass(frozen=True)
class Settings:
    disabled: frozenset[str]
    strict: bool

    @classmethod
    def from_env(cls) -> Settings:
        """Read the switches; raises InvalidSetting for a strict value that is neither on nor off."""
        raw = os.environ.get(DISABLE_ENV, "")
        disabled = frozenset(normalize_id(x) for x in raw.split(",") if x.strip())
        return cls(disabled=disabled, strict=parse_strict(os.environ.get(STRICT_ENV)))

    def is_disabled(self, fix_id: str) -> bool:
        return ALL in self.disabled or normalize_id(fix_id) in self.disabled

    def unknown_ids(self, valid: Iterable[str]) -> list[str]:
        """Ids named in the disable switch that are no installed fix (typos, removed fixes)."""
        known = {normalize_id(v) for v in valid} | {ALL}
        return sorted(self.disabled - known)


def unknown_ids_message(unknown: list[str], valid: Iterable[str]) -> str:
    return (
        f"{DISABLE_ENV} names {', '.join(unknown)}, which is no installed fix; those names are "
        f"ignored. Valid ids: {', '.join(sorted(valid))} (or 'all')"
    )


def vllm_plugins_filter() -> list[str] | None:
    """vLLM's own VLLM_PLUGINS allowlist, parsed the way vLLM parses it."""
    raw = os.environ.get("VLLM_PLUGINS")
    if raw is None:
        return None
    return raw.split(",")
