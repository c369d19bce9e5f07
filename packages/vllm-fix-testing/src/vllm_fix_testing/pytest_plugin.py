"""The test-support pytest plugin (entry point ``pytest11``): what every test process on a CPU
machine needs before it imports vLLM. Today: vLLM 0.34's triton-cpu check passed for the tests'
configs (:mod:`vllm_fix_testing.triton_cpu`), installed when vLLM imports its CPU platform."""

from __future__ import annotations

import sys

import pytest


def pytest_configure(config: pytest.Config) -> None:
    from vllm_fix_testing import triton_cpu

    module = sys.modules.get("vllm.platforms.cpu")
    if module is not None:
        triton_cpu.install(module)
        return
    import wrapt

    wrapt.register_post_import_hook(triton_cpu.install, "vllm.platforms.cpu")
