"""Plugin-loading scenarios, each in a forked child of one process that already imported vLLM.

A package's `tests/_plugin_scenarios.py` builds `scenario(name) -> dict` with `scenarios(...)`
(load the plugins through vLLM's own load_general_plugins(), import the trigger, report the
decision lines) and calls `run_forked(scenario)`; its test reads the results with
`run_scenarios(script, names, timeout)`, one JSON line per scenario.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
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


# A package's own scenarios beyond "lazy" and "disabled": (name, result, load_general_plugins).
Extra = Callable[[str, dict[str, Any], Callable[[], None]], None]


def scenarios(
    *,
    plugin: str,
    fix_id: str,
    trigger: str,
    state: Callable[[], dict[str, Any]],
    extra: dict[str, Extra] | None = None,
) -> Callable[[str], dict[str, Any]]:
    """`scenario(name)` for run_forked, with only `plugin` allowed (VLLM_PLUGINS):

    * "lazy": load the plugins, record `state()` and the lines logged so far, import `trigger`;
    * "disabled": the same with VLLM_FIXES_DISABLE=`fix_id`;
    * any name in `extra`: that function, which loads the plugins itself.

    The result holds `state()` afterwards, the decision lines logged after the plugin load
    (`lines`), every line (`all_lines`) and what raised, if anything did."""

    def scenario(name: str) -> dict[str, Any]:
        capture = Capture()
        log = logging.getLogger("vllm.fixes")
        log.addHandler(capture)
        log.setLevel(logging.DEBUG)
        os.environ["VLLM_PLUGINS"] = plugin
        result: dict[str, Any] = {"scenario": name}
        from vllm.plugins import load_general_plugins

        try:
            if name == "lazy":
                load_general_plugins()
                result["before_import"] = state()
                result["lines_before_import"] = list(capture.lines)
                __import__(trigger)
            elif name == "disabled":
                os.environ["VLLM_FIXES_DISABLE"] = fix_id
                load_general_plugins()
                __import__(trigger)
            elif extra and name in extra:
                extra[name](name, result, load_general_plugins)
            else:
                raise SystemExit(f"unknown scenario {name}")
        except Exception as exc:
            result["raised"] = f"{type(exc).__name__}: {exc}"
        result["state"] = state()
        before = result.get("lines_before_import", [])
        result["lines"] = [line for line in capture.lines if line not in before]
        result["all_lines"] = capture.lines
        return result

    return scenario


def run_scenarios(script: Path, names: list[str], timeout: int) -> dict[str, dict[str, Any]]:
    """Run a package's `_plugin_scenarios.py` for `names` in a fresh interpreter; its results
    by scenario name (every one of them present, the script exiting 0)."""
    proc = subprocess.run(
        [sys.executable, str(script), *names], capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            data = json.loads(line)
            out[data["scenario"]] = data
    assert set(out) == set(names), proc.stdout[-2000:] + proc.stderr[-2000:]
    return out
