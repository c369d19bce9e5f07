"""pytest plugin for runs of vLLM's own tests: load vLLM's general plugins (every installed fix)
at session start, as a vLLM process does. The unpatched run loads them too, with
VLLM_FIXES_DISABLE=all, so the two runs differ only in our switch (VLLM_PLUGINS stays unset:
some of vLLM's tests load their own plugins)."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    from vllm.plugins import load_general_plugins

    load_general_plugins()
