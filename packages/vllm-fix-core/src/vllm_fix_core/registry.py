"""Which fixes are installed: the `vllm_fixes` entry-point group maps id -> declaration."""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, entry_points, version

from vllm_fix_core.declaration import Fix

GROUP = "vllm_fixes"
PLUGIN_GROUP = "vllm.general_plugins"


@dataclass(frozen=True)
class Installed:
    fix: Fix
    version: str


def installed_fixes() -> list[Installed]:
    found: list[Installed] = []
    for ep in sorted(entry_points(group=GROUP), key=lambda e: e.name):
        fix = ep.load()
        if not isinstance(fix, Fix):
            raise TypeError(f"entry point {ep.name} in {GROUP} is not a Fix")
        try:
            ver = version(fix.distribution)
        except PackageNotFoundError:
            ver = "?"
        found.append(Installed(fix, ver))
    return found


def installed_ids() -> list[str]:
    """Ids of the installed fixes, from entry-point names alone (nothing is imported)."""
    return sorted({ep.name for ep in entry_points(group=GROUP)})


def plugin_entry_points() -> dict[str, str]:
    """All `vllm.general_plugins` entry points: name -> value."""
    return {ep.name: ep.value for ep in entry_points(group=PLUGIN_GROUP)}
