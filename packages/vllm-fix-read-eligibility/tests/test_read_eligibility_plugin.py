"""The fix as vLLM loads it: through vllm.general_plugins, in fresh processes.

One log line per fix per process, lazily on import of the target module; disabled,
unimportable and unknown-shape processes change nothing; strict mode raises.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from vllm_fix_core import Answer
from vllm_fix_testing.plugin_scenarios import run_scenarios

SCENARIOS = ["lazy", "disabled", "moriio-unimportable", "unknown-shape", "unknown-shape-strict"]


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, Any]]:
    return run_scenarios(Path(__file__).with_name("_plugin_scenarios.py"), SCENARIOS, timeout=300)


def test_applies_lazily_when_vllm_imports_moriio(results: dict[str, dict[str, Any]]) -> None:
    r = results["lazy"]
    assert "crashed" not in r and "raised" not in r
    assert r["before_import"] == {"imported": False, "layers": []}  # plugin load imported nothing
    assert r["lines_before_import"] == []
    assert r["state"]["layers"] == ["read-eligibility"]
    assert len(r["lines"]) == 1
    level, msg = r["lines"][0]
    assert level == "INFO" and f"read-eligibility: {Answer.AFFECTED_FIXED.value}" in msg


def test_disabled_logs_one_debug_line_and_patches_nothing(results: dict[str, dict[str, Any]]) -> None:
    r = results["disabled"]
    assert r["state"] == {"imported": True, "layers": []}
    assert r["all_lines"] == [
        ["DEBUG", "vllm-fix read-eligibility: disabled: disabled by VLLM_FIXES_DISABLE"]
    ]


def test_moriio_unimportable_logs_one_warning_and_changes_nothing(results: dict[str, dict[str, Any]]) -> None:
    r = results["moriio-unimportable"]
    assert "msgpack" in r["import_error"]
    assert r["state"]["imported"] is False
    assert len(r["all_lines"]) == 1
    level, msg = r["all_lines"][0]
    assert level == "WARNING" and f"read-eligibility: {Answer.CANNOT_CHECK.value}" in msg
    assert "failed to import" in msg


def test_unknown_shape_logs_one_warning_and_changes_nothing(results: dict[str, dict[str, Any]]) -> None:
    r = results["unknown-shape"]
    assert "raised" not in r
    assert r["still_drifted"] is True and r["state"]["layers"] == []
    assert len(r["all_lines"]) == 1
    level, msg = r["all_lines"][0]
    assert level == "WARNING" and f"read-eligibility: {Answer.REFUSED.value}" in msg
    assert "this vLLM has the bug" in msg and "no longer decides by" in msg


def test_unknown_shape_strict_raises(results: dict[str, dict[str, Any]]) -> None:
    r = results["unknown-shape-strict"]
    assert r["raised"].startswith("FixRefused")
    assert r["state"]["layers"] == []
