"""The fix as vLLM loads it: through vllm.general_plugins, in fresh processes.

Nothing happens at plugin load; one log line when vLLM imports the MRV2 model runner (the
probe runs vLLM's sample_tokens, so it waits for the module that defines it); disabled changes
nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from vllm_fix_testing.plugin_scenarios import run_scenarios

SCENARIOS = ["lazy", "disabled"]


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, Any]]:
    return run_scenarios(Path(__file__).with_name("_plugin_scenarios.py"), SCENARIOS, timeout=600)


def test_applies_lazily_when_vllm_imports_the_model_runner(results: dict[str, dict[str, Any]]) -> None:
    r = results["lazy"]
    assert "crashed" not in r and "raised" not in r, r
    assert r["before_import"] == {"imported": False, "layers": []}  # plugin load imported nothing
    assert r["lines_before_import"] == []
    assert r["state"]["layers"] == ["spec-kv-readiness"]
    assert len(r["lines"]) == 1
    level, msg = r["lines"][0]
    assert level == "INFO" and "spec-kv-readiness: affected → fixed" in msg


def test_disabled_logs_one_debug_line_and_patches_nothing(results: dict[str, dict[str, Any]]) -> None:
    r = results["disabled"]
    assert r["state"] == {"imported": True, "layers": []}
    assert r["all_lines"] == [
        ["DEBUG", "vllm-fix spec-kv-readiness: disabled: disabled by VLLM_FIXES_DISABLE"]
    ]
