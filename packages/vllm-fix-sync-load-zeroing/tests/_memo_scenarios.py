"""Decisions as a multi-process engine core makes them, each in a forked child of one process that
imported what an engine core has imported when vLLM imports MoRIIO (``vllm.v1.engine.core``)
and the MoRIIO module, but not ``vllm.v1.worker.utils`` (the parent checks). Each result also
says which ``vllm`` modules the decision imported, whether ``vllm._aiter_ops`` is loaded after
it and which ``AITER_*`` variables ``os.environ`` holds.

Usage: python _memo_scenarios.py SCENARIO [SCENARIO ...]; prints one JSON line per scenario,
run one after the other in the order given, all on the coverage memo under $VLLM_CACHE_ROOT.

* ``*-decide``: the ladder (``evaluate(FIX, apply=True)``), as the plugin runs it;
* ``*-probe``: the probe alone (what the decision reads before anything is applied);
* ``corrupt-memo``: the memo file overwritten with bytes that are not JSON, then decide;
* ``other-vllm-version``: the memo rewritten as if another vLLM version had written it (and with
  facts that would mislead: no zeroer), then decide;
* ``unwritable``: VLLM_CACHE_ROOT under a regular file (no directory can be made), then decide.

Scenarios named ``worker-*`` and ``engine-after-worker-*`` use their own memo, under
``$VLLM_CACHE_ROOT/workers`` (empty until the first of them), as an engine core and its workers
share one: a ``worker-*`` child first imports ``vllm.v1.worker.utils``, as vLLM's GPU model
runner does in a worker before the worker imports MoRIIO (``init_device``), then decides there;
an ``engine-after-worker-*`` child is an engine core deciding after its workers started:

* ``worker-decide``: decide in a worker;
* ``engine-after-worker-probe`` / ``-decide``: the probe alone / the ladder, in an engine core;
* ``worker-valid-memo``: decide in a worker where the memo is valid;
* ``worker-other-facts``: the memo's facts edited by hand (one layout's coverage flipped, the
  stamp and recorded files left valid), then decide in a worker.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import vllm.v1.engine.core  # noqa: F401  (what the engine-core process has imported)

from vllm_fix_testing.plugin_scenarios import Capture, run_forked

MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_connector"
WORKER_UTILS = "vllm.v1.worker.utils"


def _digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def _mtime_ns(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


def _memo_facts(path: Path) -> Any:
    try:
        return json.loads(path.read_bytes())["facts"]
    except (OSError, ValueError, KeyError):
        return None


def scenario(name: str) -> dict[str, Any]:
    from vllm_fix_core import Settings, evaluate
    from vllm_fix_sync_load_zeroing import FIX, memo_key
    from vllm_fix_sync_load_zeroing.facts import CoverageFacts
    from vllm_fix_sync_load_zeroing.probe import probe

    capture = Capture()
    log = logging.getLogger("vllm.fixes")
    log.addHandler(capture)
    log.setLevel(logging.DEBUG)
    result: dict[str, Any] = {"scenario": name, "worker_utils_before": WORKER_UTILS in sys.modules}
    if name == "unwritable":
        blocker = Path(os.environ["VLLM_CACHE_ROOT"]) / "not-a-directory"
        blocker.write_text("a file where the cache root would be\n")
        os.environ["VLLM_CACHE_ROOT"] = str(blocker / "cache")
    if name.startswith(("worker-", "engine-after-worker-")):
        os.environ["VLLM_CACHE_ROOT"] = str(Path(os.environ["VLLM_CACHE_ROOT"]) / "workers")
    if name.startswith("worker-"):
        importlib.import_module(WORKER_UTILS)  # what a worker has loaded when it imports MoRIIO
    result["worker_utils_at_decision"] = WORKER_UTILS in sys.modules
    path = memo_key.memo_path()
    result["memo_path"] = str(path)
    if name == "corrupt-memo":
        path.write_bytes(b'{"stamp": {"schema": 1, trunc')
    elif name == "other-vllm-version":
        data = json.loads(path.read_bytes())
        data["stamp"]["vllm_version"] = "0.0.1"
        data["facts"] = CoverageFacts(zeroer=False).to_json()
        path.write_text(json.dumps(data))
    elif name == "worker-other-facts":
        data = json.loads(path.read_bytes())
        layout = sorted(data["facts"]["covered"])[0]
        data["facts"]["covered"][layout] = not data["facts"]["covered"][layout]
        path.write_text(json.dumps(data))
        result["edited_facts"] = data["facts"]
    result["memo_before"] = _digest(path)
    result["memo_mtime_before"] = _mtime_ns(path)
    loaded = set(sys.modules)
    result["aiter_env_before"] = sorted(name for name in os.environ if name.startswith("AITER"))
    if name.endswith("-probe"):
        report = probe()
        result["checks"] = [[c.name, c.affected, c.guard] for c in report.checks]
    else:
        decision = evaluate(FIX, Settings(disabled=frozenset(), strict=False), apply=True)
        result["answer"] = decision.answer.value
        result["message"] = decision.message
    result["worker_utils_after"] = WORKER_UTILS in sys.modules
    result["new_vllm_modules"] = sorted(
        name for name in set(sys.modules) - loaded if name == "vllm" or name.startswith("vllm.")
    )
    result["aiter_ops_loaded"] = "vllm._aiter_ops" in sys.modules
    result["aiter_env"] = sorted(name for name in os.environ if name.startswith("AITER"))
    result["memo_after"] = _digest(path)
    result["memo_mtime_after"] = _mtime_ns(path)
    result["memo_facts"] = _memo_facts(path)
    result["lines"] = capture.lines
    return result


if __name__ == "__main__":
    __import__(MODULE)
    if WORKER_UTILS in sys.modules:  # the scenarios would prove nothing
        raise SystemExit(f"{WORKER_UTILS} is imported by the engine core here")
    run_forked(scenario)
