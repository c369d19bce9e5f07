"""How big the stress runs are.

``FIXES_STRESS=full`` (the default, and the ``stress-<target>`` sessions) runs every stress test
at its published size; ``FIXES_STRESS=focused`` (CI's ``stress-focused-<target>`` sessions) runs
the same tests, with the same assertions, at a smaller size. The variable is deliberately not
``VLLM_``-prefixed: vLLM validates every ``VLLM_*`` variable and this one is not vLLM's.
"""

from __future__ import annotations

import os

VARIABLE = "FIXES_STRESS"
SIZES = ("full", "focused")


def size() -> str:
    value = os.environ.get(VARIABLE, "full").strip().lower() or "full"
    if value not in SIZES:
        raise ValueError(f"{VARIABLE}={value!r}: expected one of {', '.join(SIZES)}")
    return value


def scaled(full: int, focused: int) -> int:
    """`full` at the published size, `focused` in CI's focused form."""
    return full if size() == "full" else focused
