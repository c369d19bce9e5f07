"""Plugin-loading scenarios, each in a forked child of one process that already imported vLLM.

A package's `tests/_plugin_scenarios.py` defines `scenario(name) -> dict` (load the plugins
through vLLM's own load_general_plugins(), import the target, report the decision lines) and
calls `run_forked(scenario)`; its test runs that script and reads one JSON line per scenario.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
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
