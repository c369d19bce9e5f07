"""Plugin-loading scenarios, each in a forked child of one process that already imported vLLM.

`python -m vllm_fix_testing.plugin_scenarios NAME ...` runs rows of the one scenario table
(`plugin_scenarios`: every installed fix loaded alone through vLLM's own load_general_plugins(),
its trigger imported; every fix disabled; the fix-specific rows in EXTRA) and prints one JSON line
per row; integration/test_plugin_load.py reads them with `run_plugin_scenarios(names, timeout)`.
`run_forked` / `run_scenarios` serve other scenario scripts the same way.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelname, record.getMessage()))


def run_forked(scenario: Callable[[str], dict[str, Any]]) -> None:
    """Run each scenario named in sys.argv in a forked child; print one JSON line per scenario."""
    for name in sys.argv[1:]:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            try:
                payload = json.dumps(scenario(name))
            except BaseException as exc:  # report, never hang the parent
                payload = json.dumps({"scenario": name, "crashed": repr(exc)})
            with os.fdopen(write, "w") as out:
                out.write(payload)
            os._exit(0)
        os.close(write)
        with os.fdopen(read) as inp:
            data = inp.read()
        os.waitpid(pid, 0)
        print(data, flush=True)


MORIIO = "vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_connector"
MRV2_RUNNER = "vllm.v1.worker.gpu.model_runner"
# Shared by every trigger and none of the fixes' targets: imported once in the parent, so each
# forked scenario pays only for its own trigger (_main checks that no target came along).
PRELOAD = ("vllm.config", "vllm.plugins")


@dataclass(frozen=True)
class Scenario:
    """One process that loads fixes' plugins through vLLM's load_general_plugins() and imports
    their triggers. `setup` runs first (it may load the plugins itself: then `loads` is False),
    `observe` adds what a row asserts beyond the standard state. A setup that replaces a target
    by a drifted one leaves `result["drifted"]`, a check that it is still installed."""

    name: str
    fix_ids: tuple[str, ...]  # the plugins allowed (VLLM_PLUGINS), and the fixes reported
    env: tuple[tuple[str, str], ...] = ()
    setup: Callable[[dict[str, Any]], None] | None = None
    loads: bool = True
    observe: Callable[[dict[str, Any]], None] | None = None


def _fixes() -> dict[str, Any]:
    from vllm_fix_core.registry import installed_fixes

    return {item.fix.id: item.fix for item in installed_fixes()}


def _owner(module: Any, qualname: str) -> Any:
    owner = module
    for part in qualname.split(".")[:-1]:
        owner = getattr(owner, part, None)
    return owner


def fix_state(fix: Any) -> dict[str, Any]:
    """Whether the fix's trigger is imported, the layers on each declared target
    (`module:qualname` -> fix ids, bottom first) and the fix's decision in this process."""
    from vllm_fix_core import runtime
    from vllm_fix_core.patching import layers_of

    layers = {}
    for target in fix.targets:
        module = sys.modules.get(target.module)
        owner = _owner(module, target.qualname) if module is not None else None
        key = f"{target.module}:{target.qualname}"
        layers[key] = layers_of(owner, target.qualname.rsplit(".", 1)[-1]) if owner is not None else []
    decision = runtime.decisions().get(fix.id)
    return {
        "imported": fix.trigger_module in sys.modules,
        "layers": layers,
        "answer": decision.answer.value if decision else None,
        "shape": decision.shape if decision else None,
    }


def _run(scenario: Scenario) -> dict[str, Any]:
    capture = Capture()
    log = logging.getLogger("vllm.fixes")
    log.addHandler(capture)
    log.setLevel(logging.DEBUG)
    fixes = _fixes()
    chosen = [fixes[fid] for fid in scenario.fix_ids]
    os.environ["VLLM_PLUGINS"] = ",".join(fix.entry_point for fix in chosen)
    os.environ.update(dict(scenario.env))
    result: dict[str, Any] = {"scenario": scenario.name}
    from vllm.plugins import load_general_plugins

    try:
        if scenario.setup:
            scenario.setup(result)
        if scenario.loads:
            load_general_plugins()
        result["after_load"] = {fix.id: fix_state(fix) for fix in chosen}
        result["lines_before_import"] = list(capture.lines)
        for fix in chosen:
            try:
                importlib.import_module(fix.trigger_module)
            except ImportError as exc:
                result.setdefault("import_errors", {})[fix.id] = repr(exc)
        if scenario.observe:
            scenario.observe(result)
    except Exception as exc:
        result["raised"] = f"{type(exc).__name__}: {exc}"
    drifted = result.pop("drifted", None)  # set by a setup that replaced a target by a drifted one
    if drifted is not None:
        result["still_drifted"] = drifted()
    result["state"] = {fix.id: fix_state(fix) for fix in chosen}
    before = result.get("lines_before_import", [])
    result["lines"] = [line for line in capture.lines if line not in before]
    result["all_lines"] = capture.lines
    return result


def _hide_msgpack(result: dict[str, Any]) -> None:
    sys.modules["msgpack"] = None  # type: ignore[assignment]  # MoRIIO's hard dependency


def _drift_read_eligibility(result: dict[str, Any]) -> None:
    mod = importlib.import_module(MORIIO)

    def drifted(self: Any, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        # Callable as vLLM calls it (the probe runs and sees the bug), but it no
        # longer decides by is_producer / mode: recognize() refuses it.
        return max(request.num_prompt_tokens - num_computed_tokens - 1, 0), False

    mod.MoRIIOConnectorScheduler.get_num_new_matched_tokens = drifted
    result["drifted"] = lambda: mod.MoRIIOConnectorScheduler.__dict__["get_num_new_matched_tokens"] is drifted


def _drift_sync_load_context(result: dict[str, Any]) -> None:
    target = importlib.import_module("vllm.v1.worker.gpu.kv_connector")

    # A release whose pre_forward no longer names the input batch.
    def drifted(self: Any, scheduler_output: Any, *rest: Any, **kwargs: Any) -> None:
        return None

    target.ActiveKVConnector.pre_forward = drifted
    result["drifted"] = lambda: target.ActiveKVConnector.__dict__["pre_forward"] is drifted


def _read_failure_ownership_is_ours(result: dict[str, Any]) -> None:
    patch = importlib.import_module("vllm_fix_read_failure_ownership.patch")  # the fix's replacements
    mc = sys.modules[MORIIO]
    installed = mc.MoRIIOConnectorWorker.__dict__["_pop_done_transfers"]
    result["ours"] = any(installed is f for f in patch.REPLACEMENTS.values())


STRICT = (("VLLM_FIXES_STRICT", "1"),)
# Rows beyond "<id>:lazy" (every fix): what a fix's own plugin test asserted, by scenario name.
EXTRA: tuple[Scenario, ...] = (
    Scenario("read-eligibility:moriio-unimportable", ("read-eligibility",), setup=_hide_msgpack),
    Scenario(
        "read-eligibility:unknown-shape",
        ("read-eligibility",),
        setup=_drift_read_eligibility,
    ),
    Scenario(
        "read-eligibility:unknown-shape-strict",
        ("read-eligibility",),
        env=STRICT,
        setup=_drift_read_eligibility,
    ),
    Scenario(
        "sync-load-context:unknown-shape",
        ("sync-load-context",),
        setup=_drift_sync_load_context,
    ),
    Scenario(
        "sync-load-context:unknown-shape-strict",
        ("sync-load-context",),
        env=STRICT,
        setup=_drift_sync_load_context,
    ),
    Scenario(
        "unknown-id",
        ("read-eligibility",),
        env=(("VLLM_FIXES_DISABLE", "read-eligibility-typo"),),
    ),
)
OBSERVE = {"read-failure-ownership": _read_failure_ownership_is_ours}


def plugin_scenarios(fix_ids: list[str]) -> dict[str, Scenario]:
    """Every row: `<id>:lazy` for each fix (its plugin alone), "disabled" (every plugin, every fix
    disabled), then EXTRA."""
    rows = [Scenario(f"{fid}:lazy", (fid,), observe=OBSERVE.get(fid)) for fid in fix_ids]
    rows.append(Scenario("disabled", tuple(fix_ids), env=(("VLLM_FIXES_DISABLE", ",".join(fix_ids)),)))
    rows += [row for row in EXTRA if set(row.fix_ids) <= set(fix_ids)]
    return {row.name: row for row in rows}


def run_plugin_scenarios(names: list[str], timeout: int) -> dict[str, dict[str, Any]]:
    """Run the named rows, each in a forked child of one fresh interpreter that imported PRELOAD;
    results by name."""
    return run_scenarios(Path(__file__), names, timeout, module=__name__)


def _main() -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    fixes = _fixes()
    early = sorted(
        {t.module for fix in fixes.values() for t in fix.targets} | {f.trigger_module for f in fixes.values()}
    )
    early = [m for m in early if m in sys.modules]
    if early:
        raise SystemExit(
            f"preloading {PRELOAD} imported fix targets {early}: the scenarios would not be lazy"
        )
    table = plugin_scenarios(sorted(fixes))
    run_forked(lambda name: _run(table[name]))


def run_scenarios(
    script: Path, names: list[str], timeout: int, module: str | None = None
) -> dict[str, dict[str, Any]]:
    """Run a scenario script (or `python -m module`) for `names` in a fresh interpreter; its
    results by scenario name (every one of them present, the script exiting 0)."""
    command = ["-m", module] if module else [str(script)]
    proc = subprocess.run(
        [sys.executable, *command, *names], capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            data = json.loads(line)
            out[data["scenario"]] = data
    assert set(out) == set(names), proc.stdout[-2000:] + proc.stderr[-2000:]
    return out


if __name__ == "__main__":
    _main()
