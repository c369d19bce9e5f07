"""The meta-package installs every fix package at exactly the version in this repository."""

from __future__ import annotations

import re
from importlib.metadata import distribution, entry_points, version

from vllm_fix_core.registry import GROUP, PLUGIN_GROUP, installed_fixes


def runtime_requires() -> list[str]:
    """The meta-package's dependencies, without its optional `test` extra."""
    return [r for r in distribution("vllm-fixes").requires or [] if "extra ==" not in r]


def test_every_pin_is_exact_and_installed() -> None:
    requires = runtime_requires()
    assert len(requires) >= 8, f"vllm-fixes should pin the core and every fix: {requires}"
    for req in requires:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)==([0-9][^;\s]*)", req.strip())
        assert match, f"not an exact pin: {req}"
        name, pinned = match.groups()
        assert version(name) == pinned


def test_every_fix_registers_both_entry_points() -> None:
    fixes = installed_fixes()
    pinned = {r.split("==")[0] for r in runtime_requires()}
    assert {i.fix.distribution for i in fixes} <= pinned
    plugins = {ep.name for ep in entry_points(group=PLUGIN_GROUP)}
    for item in fixes:
        assert item.fix.entry_point in plugins
    assert len({ep.name for ep in entry_points(group=GROUP)}) == len(fixes)
