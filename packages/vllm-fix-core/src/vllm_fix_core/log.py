"""One logger per fix, through vLLM's logger when vLLM is importable."""

from __future__ import annotations

import logging

LOGGER_PREFIX = "vllm.fixes"


def get_logger(fix_id: str) -> logging.Logger:
    name = f"{LOGGER_PREFIX}.{fix_id}"
    try:
        from vllm.logger import init_logger
    except Exception:  # no vLLM (unit tests, the CLI outside a vLLM venv)
        return logging.getLogger(name)
    return init_logger(name)
