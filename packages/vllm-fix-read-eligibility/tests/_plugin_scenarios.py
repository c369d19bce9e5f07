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

MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_connector"


def _state() -> dict[str, Any]:
    from vllm_fix_core.patching import layers_of

    mod = sys.modules.get(MODULE)
    if mod is None:
        return {"imported": False, "layers": []}
    cls = mod.MoRIIOConnectorScheduler
    return {"imported": True, "layers": layers_of(cls, "get_num_new_matched_tokens")}


def scenario(name: str) -> dict[str, Any]:
    capture = Capture()
    log = logging.getLogger("vllm.fixes")
    log.addHandler(capture)
    log.setLevel(logging.DEBUG)
    os.environ["VLLM_PLUGINS"] = "vllm_fix_read_eligibility"
    result: dict[str, Any] = {"scenario": name}
    from vllm.plugins import load_general_plugins

    try:
        if name == "lazy":
            load_general_plugins()
            result["before_import"] = _state()
            result["lines_before_import"] = list(capture.lines)
            __import__(MODULE)
        elif name == "disabled":
            os.environ["VLLM_FIXES_DISABLE"] = "read-eligibility"
            load_general_plugins()
            __import__(MODULE)
        elif name == "moriio-unimportable":
            sys.modules["msgpack"] = None  # type: ignore[assignment]  # MoRIIO's hard dependency
            load_general_plugins()
            try:
                __import__(MODULE)
            except ImportError as exc:
                result["import_error"] = repr(exc)
        elif name in ("unknown-shape", "unknown-shape-strict"):
            if name.endswith("strict"):
                os.environ["VLLM_FIXES_STRICT"] = "1"
            mod = __import__(MODULE, fromlist=["x"])

            def drifted(self: Any, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
                # Callable as vLLM calls it (the probe runs and sees the bug), but it no
                # longer decides by is_producer / mode: recognize() refuses it.
                return max(request.num_prompt_tokens - num_computed_tokens - 1, 0), False

            mod.MoRIIOConnectorScheduler.get_num_new_matched_tokens = drifted
            load_general_plugins()
            result["still_drifted"] = (
                mod.MoRIIOConnectorScheduler.__dict__["get_num_new_matched_tokens"] is drifted
            )
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
