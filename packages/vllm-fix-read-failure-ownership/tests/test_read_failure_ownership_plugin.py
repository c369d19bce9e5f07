"""Through vLLM's own plugin loader, in a fresh process (one vLLM import)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points

from vllm_fix_core import Answer
from vllm_fix_read_failure_ownership import FIX

SCRIPT = r"""
import json
from vllm.plugins import load_general_plugins
from vllm_fix_core import runtime

load_general_plugins()
before = runtime.decisions()["read-failure-ownership"].answer.value
from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector as mc
from vllm_fix_read_failure_ownership import patch

decision = runtime.decisions()["read-failure-ownership"]
installed = mc.MoRIIOConnectorWorker.__dict__["_pop_done_transfers"]
print("RESULT" + json.dumps({
    "before": before,
    "answer": decision.answer.value,
    "shape": decision.shape,
    "ours": any(installed is f for f in patch.REPLACEMENTS.values()),
}))
"""


def test_entry_points_declared() -> None:
    plugins = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert plugins[FIX.entry_point] == "vllm_fix_read_failure_ownership.plugin:register"
    fixes = {ep.name: ep.value for ep in entry_points(group="vllm_fixes")}
    assert fixes[FIX.id] == "vllm_fix_read_failure_ownership.declaration:FIX"


def test_vllm_plugin_loader_applies_the_fix_when_moriio_is_imported() -> None:
    env = dict(os.environ, VLLM_PLUGINS=FIX.entry_point, HF_HUB_OFFLINE="1")
    env.pop("VLLM_FIXES_DISABLE", None)
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT") :])
    from vllm_fix_testing import vllm_version

    assert result == {
        "before": "pending",
        "answer": Answer.AFFECTED_FIXED.value,
        "shape": f"vllm-{vllm_version()}",
        "ours": True,
    }
