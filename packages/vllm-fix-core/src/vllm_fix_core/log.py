"""One logger per fix, through vLLM's logger when vLLM is importable.

While a probe runs (`probing()`), records from the fixes' own loggers on that
thread are dropped: a probe feeds deliberately bad input to the patched target
and must not make the fix warn about requests that do not exist.
"""

from __future__ import annotations

import logging
import sys
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
    """`vllm.fixes.<id>`: a child of vLLM's "vllm" logger, so its lines go through vLLM's
    handler, format and VLLM_LOGGING_LEVEL. vLLM's own init_logger is used when vLLM's logger
    module is already loaded (always, in a vLLM process); it is never imported just for this."""
    name = f"{LOGGER_PREFIX}.{fix_id}"
    vllm_logger = sys.modules.get("vllm.logger")
    init_logger = getattr(vllm_logger, "init_logger", None)
    logger = init_logger(name) if callable(init_logger) else logging.getLogger(name)
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
    return logger
