"""Run plugin-loading scenarios in forked children of one process that imported vLLM.

Usage: python _plugin_scenarios.py SCENARIO [SCENARIO ...]; prints one JSON line per scenario.
Each child loads the plugins through vLLM's own load_general_plugins(), exactly as every
vLLM process does, with only this package's entry point allowed (VLLM_PLUGINS).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import vllm.plugins  # noqa: F401  (vLLM itself, imported before the fork)

from vllm_fix_testing.plugin_scenarios import run_forked, scenarios

MODULE = "vllm.v1.worker.gpu.model_runner"  # the trigger: the V2 runner, fully imported
TARGET = "vllm.v1.worker.gpu.kv_connector"


def _state() -> dict[str, Any]:
    from vllm_fix_core.patching import layers_of

    if sys.modules.get(MODULE) is None:
        return {"imported": False, "layers": []}
    cls = sys.modules[TARGET].ActiveKVConnector
    return {"imported": True, "layers": layers_of(cls, "pre_forward")}


def unknown_shape(name: str, result: dict[str, Any], load_general_plugins: Callable[[], None]) -> None:
    if name.endswith("strict"):
        os.environ["VLLM_FIXES_STRICT"] = "1"
    target = __import__(TARGET, fromlist=["x"])

    # A release whose pre_forward no longer names the input batch.
    def drifted(self: Any, scheduler_output: Any, *rest: Any, **kwargs: Any) -> None:
        return None

    target.ActiveKVConnector.pre_forward = drifted
    load_general_plugins()
    __import__(MODULE)
    result["still_drifted"] = target.ActiveKVConnector.__dict__["pre_forward"] is drifted


if __name__ == "__main__":
    run_forked(
        scenarios(
            plugin="vllm_fix_sync_load_context",
            fix_id="sync-load-context",
            trigger=MODULE,
            state=_state,
            extra={"unknown-shape": unknown_shape, "unknown-shape-strict": unknown_shape},
        )
    )
