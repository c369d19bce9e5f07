"""The fix as vLLM loads it: through vllm.general_plugins, in fresh processes.

One log line per fix per process, when vLLM imports its V2 model runner; disabled and
unknown-shape processes change nothing; strict mode raises."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from vllm_fix_testing.plugin_scenarios import run_scenarios

SCENARIOS = ["lazy", "disabled", "unknown-shape", "unknown-shape-strict"]


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, Any]]:
    return run_scenarios(Path(__file__).with_name("_plugin_scenarios.py"), SCENARIOS, timeout=600)


def test_applies_when_vllm_imports_its_v2_model_runner(results: dict[str, dict[str, Any]]) -> None:
    r = results["lazy"]
    assert "crashed" not in r and "raised" not in r
    assert r["before_import"] == {"imported": False, "layers": []}  # plugin load imported nothing
    assert r["lines_before_import"] == []
    assert r["state"]["layers"] == ["sync-load-context"]
    assert len(r["lines"]) == 1
    level, msg = r["lines"][0]
    assert level == "INFO" and "sync-load-context: affected → fixed" in msg


def test_disabled_logs_one_debug_line_and_patches_nothing(results: dict[str, dict[str, Any]]) -> None:
    r = results["disabled"]
    assert r["state"] == {"imported": True, "layers": []}
    assert r["all_lines"] == [
        ["DEBUG", "vllm-fix sync-load-context: disabled: disabled by VLLM_FIXES_DISABLE"]
    ]


def test_unknown_shape_logs_one_warning_and_changes_nothing(results: dict[str, dict[str, Any]]) -> None:
    r = results["unknown-shape"]
    assert "raised" not in r
    assert r["still_drifted"] is True and r["state"]["layers"] == []
    assert len(r["all_lines"]) == 1
    level, msg = r["all_lines"][0]
    assert level == "WARNING" and "refused" in msg and "carries no input batch" in msg


def test_unknown_shape_strict_raises(results: dict[str, dict[str, Any]]) -> None:
    r = results["unknown-shape-strict"]
    assert r["raised"].startswith("FixRefused")
    assert r["state"]["layers"] == []
