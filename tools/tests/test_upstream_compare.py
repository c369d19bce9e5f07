"""tools/upstream.py compare: what fails the upstream sessions, full and focused."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import upstream

MODULE = "tests.v1.core.test_scheduler"


def junit(path: Path, outcomes: dict[str, str]) -> Path:
    cases = []
    for name, outcome in outcomes.items():
        inner = {"passed": "", "failed": "<failure message='x'/>", "skipped": "<skipped/>"}[outcome]
        cases.append(f'<testcase classname="{MODULE}" name="{name}">{inner}</testcase>')
    path.write_text(f"<testsuites><testsuite>{''.join(cases)}</testsuite></testsuites>")
    return path


def review(path: Path, tests: list[str], runs: str = "") -> Path:
    entries = "".join(
        f'[[difference]]\ntest = "test_scheduler::{t}"\nreleases = ["0.33.0"]\nfix = "f"\n'
        f'reason = "r"\nshown_by = "s"\n{runs}\n'
        for t in tests
    )
    path.write_text(entries)
    return path


def run(
    tmp_path: Path, patched: dict[str, str], unpatched: dict[str, str], listed: list[str], focused: bool
) -> int:
    return upstream.compare(
        "0.33.0",
        junit(tmp_path / "patched.xml", patched),
        junit(tmp_path / "unpatched.xml", unpatched),
        review(tmp_path / "review.toml", listed),
        focused,
    )


@pytest.mark.parametrize("focused", [False, True])
def test_a_reviewed_difference_passes_and_an_unreviewed_one_fails(tmp_path: Path, focused: bool) -> None:
    patched = {"a": "passed", "b": "failed"}
    unpatched = {"b": "passed"} if focused else {"a": "passed", "b": "passed"}
    assert run(tmp_path, patched, unpatched, ["b"], focused) == 0
    assert run(tmp_path, patched, unpatched, [], focused) == 1


def test_a_stale_review_entry_fails(tmp_path: Path) -> None:
    assert run(tmp_path, {"a": "passed"}, {"a": "passed"}, ["a"], False) == 1


def test_focused_fails_when_a_patched_failure_was_not_run_unpatched(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # "b" failed with the fixes but the unpatched run has no result for it: blind, not clean.
    assert run(tmp_path, {"a": "passed", "b": "failed"}, {}, [], True) == 1
    assert "NOT COMPARED" in capsys.readouterr().out


def test_focused_a_test_failing_both_ways_is_no_difference(tmp_path: Path) -> None:
    assert run(tmp_path, {"a": "passed", "b": "failed"}, {"b": "failed"}, [], True) == 0


def test_native_compare_expects_only_the_carried_fixes_entries(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A tree carrying fix "g" only: "f"'s entry is not expected to differ (not stale), while an
    entry of a carried fix is held to the same rule as in the patched run."""
    same = {"a": "passed"}
    review_file = review(tmp_path / "review.toml", ["a"])  # fix "f"
    args = (junit(tmp_path / "n.xml", same), junit(tmp_path / "u.xml", same), review_file)
    assert upstream.compare("0.33.0", *args, label="carried natively", fixes=["g"]) == 0
    assert upstream.compare("0.33.0", *args, label="carried natively", fixes=["f"]) == 1
    out = capsys.readouterr().out
    assert "carried natively 1 passed" in out and "STALE review entry" in out


def test_an_entry_for_the_native_run_only_is_not_expected_of_the_patched_run(tmp_path: Path) -> None:
    """`runs = ["native"]`: the test differs on the native tree only (its process never loads
    the runtime fix); the patched run does not need it (not stale there), the native run does."""
    review_file = review(tmp_path / "review.toml", ["b"], runs='runs = ["native"]\n')
    unpatched = junit(tmp_path / "u.xml", {"a": "passed", "b": "passed"})
    same = junit(tmp_path / "p.xml", {"a": "passed", "b": "passed"})
    differs = junit(tmp_path / "n.xml", {"a": "passed", "b": "failed"})
    assert upstream.compare("0.33.0", same, unpatched, review_file) == 0
    assert upstream.compare("0.33.0", differs, unpatched, review_file, run="native") == 0
    assert upstream.compare("0.33.0", same, unpatched, review_file, run="native") == 1  # stale
    assert upstream.compare("0.33.0", differs, unpatched, review_file) == 1  # unreviewed
