"""Synthetic targets for the core's own machinery tests (the fixes test real vLLM)."""

from __future__ import annotations

import importlib
import sys
import textwrap
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from vllm_fix_core.declaration import Fix, Links, ProcessKind, Target, Upstream, UpstreamStatus

TARGET_SRC = """
class Widget:
    def compute(self, x):
        return x + 1   # the "bug": should return x + 2
"""

FIX_SRC = """
from vllm_fix_core import Check, NotApplicable, ProbeReport, UnknownShape, ast_fingerprint
import importlib

MODULE = "{module}"
MODE = {{"mode": "good"}}


def _widget():
    return importlib.import_module(MODULE).Widget


def probe():
    if MODE["mode"] == "probe-raises":
        raise RuntimeError("probe exploded")
    if MODE["mode"] == "feature-absent":
        raise NotApplicable("no widgets here")
    value = _widget()().compute(1)
    negative = _widget()().compute(-1000)
    guard_broken = negative >= 0 or MODE["mode"] == "guard-broken"
    return ProbeReport((
        Check("off-by-one", value != 3, f"compute(1)={{value}}"),
        Check("negatives-stay-negative", guard_broken, f"compute(-1000)={{negative}}", guard=True),
    ))


def recognize():
    if MODE["mode"] == "unknown-shape":
        raise UnknownShape("compute() is not a shape this fix knows")
    return "demo-1"


def apply(patch, shape):
    def wrapper(wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        if MODE["mode"] == "breaks-guard":
            return abs(result) + 1
        return result if MODE["mode"] == "ineffective" else result + 1

    patch.wrap(_widget(), "compute", wrapper)
"""


class Demo:
    def __init__(self, root: Path) -> None:
        tag = uuid.uuid4().hex[:8]
        self.module = f"demo_target_{tag}"
        self.fix_module = f"demo_fix_{tag}"
        (root / f"{self.module}.py").write_text(textwrap.dedent(TARGET_SRC))
        (root / f"{self.fix_module}.py").write_text(FIX_SRC.format(module=self.module))
        self.fix = Fix(
            id=f"demo-{tag}",
            title="demo",
            distribution="vllm-fix-demo",
            upstream=(Upstream(1, UpstreamStatus.PENDING),),
            why="w",
            how="h",
            retire_when="r",
            targets=(Target(self.module, "Widget.compute", ProcessKind.WORKER),),
            links=self.links,
        )

    def links(self) -> Links:
        module = importlib.import_module(self.fix_module)
        return Links(module.probe, module.recognize, module.apply)

    def set_mode(self, mode: str) -> None:
        importlib.import_module(self.fix_module).MODE["mode"] = mode

    def widget(self) -> Any:
        return importlib.import_module(self.module).Widget

    def raw(self) -> Any:
        return self.widget().__dict__["compute"]


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[Demo]:
    sys.path.insert(0, str(tmp_path))
    d = Demo(tmp_path)
    yield d
    sys.path.remove(str(tmp_path))
    for name in (d.module, d.fix_module):
        sys.modules.pop(name, None)
    from vllm_fix_core import runtime

    runtime.revert(d.fix)


@pytest.fixture
def fix_lines() -> Iterator[Callable[[str], list[tuple[str, str]]]]:
    import logging

    records: list[logging.LogRecord] = []

    class H(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = H(logging.DEBUG)
    root = logging.getLogger("vllm.fixes")
    root.addHandler(handler)
    old = root.level
    root.setLevel(logging.DEBUG)

    def lines(fix_id: str) -> list[tuple[str, str]]:
        return [(r.levelname, r.getMessage()) for r in records if r.name == f"vllm.fixes.{fix_id}"]

    yield lines
    root.removeHandler(handler)
    root.setLevel(old)
