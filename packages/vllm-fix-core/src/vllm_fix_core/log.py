"""One logger per fix, through vLLM's logger when vLLM is importable.

While a probe runs (`probing()`), records from the fixes' own loggers on that
thread are dropped: a probe feeds deliberately bad input to the patched target
and must not make the fix warn about requests that do not exist.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

LOGGER_PREFIX = "vllm.fixes"
_state = threading.local()


@contextmanager
def probing() -> Iterator[None]:
    depth = getattr(_state, "depth", 0)
    _state.depth = depth + 1
    try:
        yield
    finally:
        _state.depth = depth


def is_probing() -> bool:
    return getattr(_state, "depth", 0) > 0


class _ProbeFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not is_probing()


_FILTER = _ProbeFilter()


def get_logger(fix_id: str) -> logging.Logger:
    name = f"{LOGGER_PREFIX}.{fix_id}"
    try:
        from vllm.logger import init_logger
    except Exception:  # no vLLM (unit tests, the CLI outside a vLLM venv)
        logger = logging.getLogger(name)
    else:
        logger = init_logger(name)
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
    return logger
