"""Which MORI is installed, and can its RDMA listener bind port 0 and report the port?

ROCm/mori reports the port an ``IOEngineConfig(host, 0)`` listener bound (the engine
descriptor's ``port``) since the change "Handle IOEngineConfig(port=0) auto-bind and
expose listen port" (ROCm/mori#125, 2025-12-24), which every tag from v0.1.0 on carries.
A build from before it binds a kernel-chosen port but reports 0, so peers cannot reach
the worker. The change adds no Python-visible name, so the only signal is the version
(``mori.__version__``, written by setuptools-scm, or the distribution's metadata); a
build from before the first tag reports a ``0.0.x``/``0.1.devN`` version, below 0.1.0.

Nothing is imported here: vLLM's MoRIIO connector imports ``mori.io`` itself, and a MORI
that vLLM could not import cannot start a MoRIIO worker in any case.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

AUTO_BIND_SINCE = "0.1.0"
DISTRIBUTIONS = ("amd_mori", "amd-mori", "mori")


@dataclass(frozen=True)
class Mori:
    present: bool
    version: str | None
    auto_bind: bool | None  # None: present, version unknown

    def describe(self) -> str:
        if not self.present:
            return "MORI not installed"
        shown = self.version or "unknown version"
        if self.auto_bind is None:
            return f"MORI {shown}: port-0 auto-bind unknown"
        return f"MORI {shown}: {'reports' if self.auto_bind else 'cannot report'} an auto-bound port"


def _version_of(module: object | None) -> str | None:
    found = getattr(module, "__version__", None)
    if isinstance(found, str):
        return found
    found = getattr(sys.modules.get("mori._version"), "__version__", None)
    if isinstance(found, str):
        return found
    for dist in DISTRIBUTIONS:
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def supports_auto_bind(text: str | None) -> bool | None:
    """True from MORI 0.1.0 on (dev builds before it are older); None when unparseable."""
    if text is None:
        return None
    from packaging.version import InvalidVersion, Version

    try:
        return Version(text) >= Version(AUTO_BIND_SINCE)
    except InvalidVersion:
        return None


def installed_mori() -> Mori:
    module = sys.modules.get("mori")
    if module is None:
        try:
            spec = importlib.util.find_spec("mori")
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            return Mori(False, None, None)
    text = _version_of(module)
    return Mori(True, text, supports_auto_bind(text))
