"""In one fresh process: vLLM's own load_general_plugins(), then import every fix's trigger module
the way vLLM would. Prints the decisions and the per-fix log lines as JSON."""

from __future__ import annotations

import importlib
import json
import logging

records: list[logging.LogRecord] = []


class Capture(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        records.append(record)


root = logging.getLogger("vllm.fixes")
root.addHandler(Capture(logging.DEBUG))
root.setLevel(logging.DEBUG)

from vllm.plugins import load_general_plugins  # noqa: E402

from vllm_fix_core import runtime  # noqa: E402
from vllm_fix_core.registry import installed_fixes  # noqa: E402

load_general_plugins()
pending = {fid: d.answer.value for fid, d in runtime.decisions().items()}
for item in installed_fixes():
    importlib.import_module(item.fix.trigger_module)
lines: dict[str, list[str]] = {}
for r in records:
    lines.setdefault(r.name.removeprefix("vllm.fixes."), []).append(f"{r.levelname} {r.getMessage()}")
print(
    json.dumps(
        {
            "after_load": pending,
            "decisions": {fid: d.answer.value for fid, d in runtime.decisions().items()},
            "lines": lines,
        }
    )
)
