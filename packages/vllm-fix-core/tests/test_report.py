"""$VLLM_FIXES_REPORT: one JSON line per decision and process; a path that cannot be written is
one WARNING per process, and nothing is lost once it can be written."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from vllm_fix_core import runtime
from vllm_fix_core.ladder import Answer, Decision
from vllm_fix_core.settings import REPORT_ENV, Settings

Lines = Callable[[str], list[tuple[str, str]]]
OFF = Settings(disabled=frozenset({"all"}), strict=False)


@pytest.fixture
def fresh_process_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process has not warned about the report yet (the flag is per process)."""
    monkeypatch.setattr(runtime, "_warned_report", False)
    yield


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_each_decision_is_one_line(
    demo: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_process_state: None
) -> None:
    report = tmp_path / "report.jsonl"
    monkeypatch.setenv(REPORT_ENV, str(report))
    fixes = [dataclasses.replace(demo.fix, id=f"{demo.fix.id}-{i}") for i in range(3)]
    try:
        for fix in fixes:
            assert runtime.install(fix, OFF).answer is Answer.DISABLED
    finally:
        for fix in fixes:
            runtime.revert(fix)
    lines = records(report)
    assert [(r["fix"], r["answer"]) for r in lines] == [(f.id, "disabled") for f in fixes]
    assert {r["pid"] for r in lines} == {os.getpid()}
    assert all(r["reason"] == "disabled by VLLM_FIXES_DISABLE" and r["process"] for r in lines)


def test_unset_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(REPORT_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    runtime.report(Decision("some-fix", Answer.DISABLED, "r"))
    assert list(tmp_path.iterdir()) == []


def test_unwritable_path_is_one_warning_per_process_and_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fix_lines: Lines, fresh_process_state: None
) -> None:
    folder = tmp_path / "not-yet"
    report = folder / "report.jsonl"
    monkeypatch.setenv(REPORT_ENV, str(report))
    for i in range(3):
        runtime.report(Decision(f"fix-{i}", Answer.FIXED_UPSTREAM, "r"))  # never raises
    warnings = fix_lines("report")
    assert len(warnings) == 1 and warnings[0][0] == "WARNING"
    assert str(report) in warnings[0][1] and REPORT_ENV in warnings[0][1]
    # Once the path can be written, every later decision is there, and no second warning.
    folder.mkdir()
    for i in range(3, 5):
        runtime.report(Decision(f"fix-{i}", Answer.FIXED_UPSTREAM, "r"))
    assert [r["fix"] for r in records(report)] == ["fix-3", "fix-4"]
    assert len(fix_lines("report")) == 1
    # A path that is a folder cannot be written either: still said only once in this process.
    monkeypatch.setenv(REPORT_ENV, str(folder))
    runtime.report(Decision("fix-5", Answer.FIXED_UPSTREAM, "r"))
    assert len(fix_lines("report")) == 1


WRITER = """
import sys
from vllm_fix_core import runtime
from vllm_fix_core.ladder import Decision, Answer
for i in range(int(sys.argv[1])):
    runtime.report(Decision(f"fix-{i}", Answer.REFUSED, "x" * 3000 + f" {i}"))
"""


def test_processes_appending_together_lose_nothing(tmp_path: Path) -> None:
    """Lines of the processes vLLM starts (API server, engine core, workers) never interleave."""
    report = tmp_path / "report.jsonl"
    env = {**os.environ, REPORT_ENV: str(report)}
    writers = [
        subprocess.Popen([sys.executable, "-c", WRITER, "150"], env=env, stderr=subprocess.PIPE)
        for _ in range(4)
    ]
    for writer in writers:
        _, err = writer.communicate(timeout=120)
        assert writer.returncode == 0, err.decode()
    lines = records(report)  # each line parses: none was cut by another process's line
    by_pid: dict[int, list[str]] = {}
    for r in lines:
        by_pid.setdefault(r["pid"], []).append(r["fix"])
    assert sorted(by_pid) == sorted(w.pid for w in writers)
    assert all(fixes == [f"fix-{i}" for i in range(150)] for fixes in by_pid.values())


def test_unwritable_path_in_a_new_process_warns_once(tmp_path: Path) -> None:
    env = {**os.environ, REPORT_ENV: str(tmp_path / "missing" / "report.jsonl")}
    proc = subprocess.run(
        [sys.executable, "-c", WRITER, "5"], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("cannot be written") == 1, proc.stderr
