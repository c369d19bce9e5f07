"""Run plugin-loading scenarios in forked children of one process that imported vLLM.

Usage: python _plugin_scenarios.py SCENARIO [SCENARIO ...]; prints one JSON line per scenario.
Each child loads the plugins through vLLM's own load_general_plugins(), exactly as every
vLLM process does, with only this package's entry point allowed (VLLM_PLUGINS).
"""

from __future__ import annotations

import sys
from typing import Any

import vllm.plugins  # noqa: F401  (vLLM itself, imported before the fork)

from vllm_fix_testing.plugin_scenarios import run_forked, scenarios

MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_connector"


def _state() -> dict[str, Any]:
    from vllm_fix_core.patching import layers_of

    mod = sys.modules.get(MODULE)
    if mod is None:
        return {"imported": False, "layers": []}
    return {"imported": True, "layers": layers_of(mod.MoRIIOConnectorScheduler, "build_connector_meta")}


if __name__ == "__main__":
    run_forked(
        scenarios(
            plugin="vllm_fix_sync_load_zeroing", fix_id="sync-load-zeroing", trigger=MODULE, state=_state
        )
    )
