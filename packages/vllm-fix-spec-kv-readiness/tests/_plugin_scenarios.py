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

TRIGGER = "vllm.v1.worker.gpu.model_runner"
KV_CONNECTOR = "vllm.v1.worker.gpu.kv_connector"


def _state() -> dict[str, Any]:
    from vllm_fix_core.patching import layers_of

    if TRIGGER not in sys.modules:
        return {"imported": False, "layers": []}
    cls = sys.modules[KV_CONNECTOR].ActiveKVConnector
    return {"imported": True, "layers": layers_of(cls, "post_forward")}


def scenario(name: str) -> dict[str, Any]:
    capture = Capture()
    log = logging.getLogger("vllm.fixes")
    log.addHandler(capture)
    log.setLevel(logging.DEBUG)
    os.environ["VLLM_PLUGINS"] = "vllm_fix_spec_kv_readiness"
    result: dict[str, Any] = {"scenario": name}
    from vllm.plugins import load_general_plugins

    try:
        if name == "lazy":
            load_general_plugins()
            result["before_import"] = _state()
            result["lines_before_import"] = list(capture.lines)
            __import__(TRIGGER)
        elif name == "disabled":
            os.environ["VLLM_FIXES_DISABLE"] = "spec-kv-readiness"
            load_general_plugins()
            __import__(TRIGGER)
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
