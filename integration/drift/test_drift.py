"""The drift drill: the fixes answer on a release's tree changed the way releases change it as on
the unchanged tree, and a change of the bug's own line is judged by the probe.

Trees: copies of the installed release's `vllm/` package (the session installs the newest
release of the matrix) made by :mod:`vllm_fix_testing.drift`. Each tree is asked with
``vllm-fixes verify --source TREE --json`` in a child process (the probes run against the tree,
the fixes apply there and verify), as a fork maintainer or a new release's first user would.

* benign drifts (a new config attribute read in each patched class's ``__init__``, a renamed
  local, a new keyword argument with a default, a new log line, a reordered method) in every
  patched target of every fix: every fix's answer equals its answer on the unchanged tree
  (focused form: all drifts in one tree; full form: one tree per drift as well, so a difference
  names its drift);
* semantic drifts (the bug's line changed as an upstream fix changes it): the fix answers what
  the probe sees, the drift's expected answer, and never "affected → fixed".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from vllm_fix_core.native import SourceTree
from vllm_fix_core.registry import installed_fixes
from vllm_fix_testing import drift
from vllm_fix_testing.native_trees import installed_tree

FULL = os.environ.get("FIXES_DRIFT") == "full"
FIXED = "affected → fixed"


def verify_source(tree: SourceTree) -> dict[str, dict[str, Any]]:
    """`vllm-fixes verify --source TREE --json`: each fix's row (answer, reason) by fix id."""
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_fix_core.cli", "verify", "--source", str(tree.root), "--json"],
        capture_output=True,
        text=True,
        timeout=1500,
        check=False,
    )
    try:
        data = json.loads(proc.stdout)
    except json.JSONDecodeError as exc:
        raise AssertionError(
            f"verify --source did not complete (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
        ) from exc
    assert Path(data["source"]) == tree.root.resolve() or Path(data["source"]) == tree.root
    return {row["fix"]: row for row in data["fixes"]}


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> SourceTree:
    return installed_tree(tmp_path_factory.mktemp("plain"))


@pytest.fixture(scope="module")
def plain_answers(plain: SourceTree) -> dict[str, dict[str, Any]]:
    answers = verify_source(plain)
    # The drill compares decisions, so the unchanged tree must give one for every fix.
    assert set(answers) == {item.fix.id for item in installed_fixes()}
    undecided = {f: a["answer"] for f, a in answers.items() if a["answer"] == "cannot check"}
    assert not undecided, undecided
    return answers


# Fixes that do not yet survive a benign drift, with the drifts that stop them and why: the drill
# holds them to exactly this list (a fix that starts surviving one fails the drill until it is
# taken off, so the list only shrinks). Every other fix must give the unchanged tree's answers.
KNOWN_GAPS: dict[str, tuple[frozenset[str], str]] = {
    "completion-ownership": (
        frozenset({"renamed-local", "new-keyword-argument", "new-log-line"}),
        "shapes.py recognises the MultiConnector bodies it replaces by exact fingerprints "
        "(update_connector_output, get_transfer_results, ...), the methods it wraps by their exact "
        "parameter lists and a source line (a local's name included): each of these drifts reads "
        "as an unknown shape, so the fix refuses instead of applying",
    ),
}


def _expected_gaps(drifts: tuple[str, ...]) -> set[str]:
    return {fix for fix, (breaking, _) in KNOWN_GAPS.items() if breaking & set(drifts)}


def _differences(plain: dict[str, dict[str, Any]], drifted: dict[str, dict[str, Any]]) -> list[str]:
    return [
        f"{fix}: {plain[fix]['answer']} on the unchanged tree, {drifted.get(fix, {}).get('answer')} "
        f"on the drifted one ({drifted.get(fix, {}).get('reason')})"
        for fix in sorted(plain)
        if drifted.get(fix, {}).get("answer") != plain[fix]["answer"]
    ]


DRIFTS: list[tuple[str, ...]] = [drift.BENIGN]
if FULL:
    DRIFTS += [(name,) for name in drift.BENIGN]


@pytest.mark.parametrize("drifts", DRIFTS, ids=["+".join(d) if len(d) == 1 else "all-benign" for d in DRIFTS])
def test_benign_drift_gives_the_answers_of_the_unchanged_tree(
    drifts: tuple[str, ...],
    plain: SourceTree,
    plain_answers: dict[str, dict[str, Any]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    fixes = [item.fix for item in installed_fixes()]
    tree, changed = drift.drifted_tree(plain, fixes, drifts, tmp_path)
    # Every drift asked for was made somewhere (a drill that changed nothing proves nothing).
    for name in drifts:
        assert any(f": {name} " in line for line in changed), (name, changed)
    drifted = verify_source(tree)
    gaps = _expected_gaps(drifts)
    different = _differences({f: a for f, a in plain_answers.items() if f not in gaps}, drifted)
    assert not different, (different, changed)
    for fix in sorted(gaps):  # a known gap: refused (never a wrong "affected → fixed"), and still a gap
        assert drifted[fix]["answer"] == "refused", (fix, KNOWN_GAPS[fix][1], drifted[fix])
    with capsys.disabled():
        print(
            f"\ndrift drill {'+'.join(drifts)}: {len(changed)} changes; "
            f"{len(plain_answers) - len(gaps)} fixes answer as on the unchanged tree; "
            f"known gaps: {', '.join(sorted(gaps)) or 'none'}"
        )


@pytest.mark.parametrize("change", drift.SEMANTIC, ids=[c.fix_id for c in drift.SEMANTIC])
def test_a_changed_bug_line_is_judged_by_the_probe(
    change: drift.Semantic, plain: SourceTree, plain_answers: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    assert plain_answers[change.fix_id]["answer"] == FIXED  # the bug is there before the change
    answers = verify_source(drift.semantic_tree(plain, change, tmp_path))
    assert answers[change.fix_id]["answer"] == change.expected, (change.why, answers[change.fix_id])
    assert answers[change.fix_id]["answer"] != FIXED
