"""The fix as vLLM loads it: through vllm.general_plugins, in fresh processes.

Nothing happens at plugin load; one log line when vLLM imports the MRV2 model runner (the
probe runs vLLM's sample_tokens, so it waits for the module that defines it); disabled changes
nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SCENARIOS = ["lazy", "disabled"]


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, Any]]:
    script = Path(__file__).with_name("_plugin_scenarios.py")
    proc = subprocess.run(
        [sys.executable, str(script), *SCENARIOS], capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            data = json.loads(line)
            out[data["scenario"]] = data
    assert set(out) == set(SCENARIOS), proc.stdout[-2000:] + proc.stderr[-2000:]
    return out


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
