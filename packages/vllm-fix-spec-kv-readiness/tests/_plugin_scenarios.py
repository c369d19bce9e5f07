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

TRIGGER = "vllm.v1.worker.gpu.model_runner"
KV_CONNECTOR = "vllm.v1.worker.gpu.kv_connector"


def _state() -> dict[str, Any]:
    from vllm_fix_core.patching import layers_of

    if TRIGGER not in sys.modules:
        return {"imported": False, "layers": []}
    cls = sys.modules[KV_CONNECTOR].ActiveKVConnector
    return {"imported": True, "layers": layers_of(cls, "post_forward")}


if __name__ == "__main__":
    run_forked(
        scenarios(
            plugin="vllm_fix_spec_kv_readiness", fix_id="spec-kv-readiness", trigger=TRIGGER, state=_state
        )
    )
