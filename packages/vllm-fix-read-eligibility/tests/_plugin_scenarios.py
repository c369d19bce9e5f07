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

MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_connector"


def _state() -> dict[str, Any]:
    from vllm_fix_core.patching import layers_of

    mod = sys.modules.get(MODULE)
    if mod is None:
        return {"imported": False, "layers": []}
    cls = mod.MoRIIOConnectorScheduler
    return {"imported": True, "layers": layers_of(cls, "get_num_new_matched_tokens")}


def moriio_unimportable(name: str, result: dict[str, Any], load_general_plugins: Callable[[], None]) -> None:
    sys.modules["msgpack"] = None  # type: ignore[assignment]  # MoRIIO's hard dependency
    load_general_plugins()
    try:
        __import__(MODULE)
    except ImportError as exc:
        result["import_error"] = repr(exc)


def unknown_shape(name: str, result: dict[str, Any], load_general_plugins: Callable[[], None]) -> None:
    if name.endswith("strict"):
        os.environ["VLLM_FIXES_STRICT"] = "1"
    mod = __import__(MODULE, fromlist=["x"])

    def drifted(self: Any, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        # Callable as vLLM calls it (the probe runs and sees the bug), but it no
        # longer decides by is_producer / mode: recognize() refuses it.
        return max(request.num_prompt_tokens - num_computed_tokens - 1, 0), False

    mod.MoRIIOConnectorScheduler.get_num_new_matched_tokens = drifted
    load_general_plugins()
    result["still_drifted"] = mod.MoRIIOConnectorScheduler.__dict__["get_num_new_matched_tokens"] is drifted


if __name__ == "__main__":
    run_forked(
        scenarios(
            plugin="vllm_fix_read_eligibility",
            fix_id="read-eligibility",
            trigger=MODULE,
            state=_state,
            extra={
                "moriio-unimportable": moriio_unimportable,
                "unknown-shape": unknown_shape,
                "unknown-shape-strict": unknown_shape,
            },
        )
    )
