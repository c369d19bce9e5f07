"""Run plugin-loading scenarios in forked children of one process that imported vLLM.

Usage: python _plugin_scenarios.py SCENARIO [SCENARIO ...]; prints one JSON line per scenario.
Each child loads the plugins through vLLM's own load_general_plugins(), exactly as every
vLLM process does, with only this package's entry point allowed (VLLM_PLUGINS).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import vllm.plugins  # noqa: F401  (vLLM itself, imported before the fork)

from vllm_fix_testing.plugin_scenarios import Capture, run_forked

MODULE = "vllm.v1.worker.gpu.model_runner"  # the trigger: the V2 runner, fully imported
TARGET = "vllm.v1.worker.gpu.kv_connector"


def _state() -> dict[str, Any]:
    from vllm_fix_core.patching import layers_of

    if sys.modules.get(MODULE) is None:
        return {"imported": False, "layers": []}
    cls = sys.modules[TARGET].ActiveKVConnector
    return {"imported": True, "layers": layers_of(cls, "pre_forward")}


def scenario(name: str) -> dict[str, Any]:
    capture = Capture()
    log = logging.getLogger("vllm.fixes")
    log.addHandler(capture)
    log.setLevel(logging.DEBUG)
    os.environ["VLLM_PLUGINS"] = "vllm_fix_sync_load_context"
    result: dict[str, Any] = {"scenario": name}
    from vllm.plugins import load_general_plugins

    try:
        if name == "lazy":
            load_general_plugins()
            result["before_import"] = _state()
            result["lines_before_import"] = list(capture.lines)
            __import__(MODULE)
        elif name == "disabled":
            os.environ["VLLM_FIXES_DISABLE"] = "sync-load-context"
            load_general_plugins()
            __import__(MODULE)
        elif name in ("unknown-shape", "unknown-shape-strict"):
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
        else:
            raise SystemExit(f"unknown scenario {name}")
    except Exception as exc:
        result["raised"] = f"{type(exc).__name__}: {exc}"
    result["state"] = _state()
    result["lines"] = [line for line in capture.lines if line not in result.get("lines_before_import", [])]
    result["all_lines"] = capture.lines
    return result


if __name__ == "__main__":
    run_forked(scenario)
