"""The fix as vLLM loads it: through vllm.general_plugins, in fresh processes. Nothing is imported
at plugin load; the one decision line comes when vLLM imports MoRIIO: "affected → fixed" on
0.31.0, "fixed upstream" on 0.32.0 / 0.33.0; disabled patches nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from packaging.version import Version

from vllm_fix_testing import vllm_version
from vllm_fix_testing.plugin_scenarios import run_scenarios

SCENARIOS = ["lazy", "disabled"]
AFFECTED = vllm_version() < Version("0.32.0")


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, Any]]:
    return run_scenarios(Path(__file__).with_name("_plugin_scenarios.py"), SCENARIOS, timeout=300)


def test_decides_lazily_when_vllm_imports_moriio(results: dict[str, dict[str, Any]]) -> None:
    r = results["lazy"]
    assert "crashed" not in r and "raised" not in r
    assert r["before_import"] == {"imported": False, "layers": []}
    assert r["lines_before_import"] == []
    assert len(r["lines"]) == 1
    level, msg = r["lines"][0]
    if AFFECTED:
        assert r["state"]["layers"] == ["sync-load-zeroing"]
        assert level == "INFO" and "sync-load-zeroing: affected → fixed" in msg
    else:
        assert r["state"]["layers"] == []
        assert level == "INFO" and "sync-load-zeroing: fixed upstream" in msg


def test_disabled_logs_one_debug_line_and_patches_nothing(results: dict[str, dict[str, Any]]) -> None:
    r = results["disabled"]
    assert r["state"] == {"imported": True, "layers": []}
    assert r["all_lines"] == [
        ["DEBUG", "vllm-fix sync-load-zeroing: disabled: disabled by VLLM_FIXES_DISABLE"]
    ]
