"""The native carry on the installed release's own sources: written, verified, git-apply-able,
behaving as the rule says with the runtime fix off, refused for a drifted body, idempotent."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("libcst")

from vllm_fix_completion_ownership import FIX, native
from vllm_fix_completion_ownership.declaration import MODULE
from vllm_fix_core.backport import Carried, Result, ask_tree, carry, scratch_copy, write_edits
from vllm_fix_core.native import SourceTree
from vllm_fix_testing.native_trees import installed_tree

# The probe's checks (each symptom and guard), asked in a child process that imports vLLM from
# the tree with every runtime fix off.
SCENARIO = """
import json
import vllm
from vllm_fix_completion_ownership.probe import probe
report = probe()
print(json.dumps({"vllm": vllm.__file__, "checks": {c.name: c.affected for c in report.checks}}))
"""


def scenario(tree: SourceTree) -> dict[str, Any]:
    env = {**os.environ, "VLLM_FIXES_DISABLE": "all"}
    env["PYTHONPATH"] = os.pathsep.join([str(tree.root), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", SCENARIO], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(found["vllm"]).resolve().is_relative_to(tree.root.resolve())
    return found


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> SourceTree:
    return installed_tree(tmp_path_factory.mktemp("tree"))


@pytest.fixture(scope="module")
def carried(
    tree: SourceTree, tmp_path_factory: pytest.TempPathFactory
) -> tuple[SourceTree, Result, SourceTree]:
    """(the release's tree, the carry's result, a copy of the tree with the edits written)."""
    result = carry(FIX, tree, tmp_path_factory.mktemp("work"))
    changed = scratch_copy(tree, tmp_path_factory.mktemp("changed"))
    write_edits(changed.root, result.edits)
    return tree, result, changed


def test_carry_is_written_and_changes_only_the_multiconnector(
    carried: tuple[SourceTree, Result, SourceTree],
) -> None:
    tree, result, _ = carried
    assert result.result is Carried.WRITTEN, result.reason
    assert [e.path for e in result.edits] == [tree.relpath(MODULE)]
    (edit,) = result.edits
    assert "vllm_fix" not in edit.after  # a fork carries no dependency on us
    assert edit.after.count(native.MARK_CODE) == 1
    # Each changed method carries the one comment; the other methods are as they were.
    changed = {name for name, _ in native.recognize(tree).changes()}
    for name in changed:
        assert native.MARK_METHOD in native.c.function_code(edit.after, f"{native.CLASS}.{name}"), name
    before = native.c.module_names(edit.before)
    added = native.c.module_names(edit.after) - before
    assert {"_CompletionLedger", "_CompletionGate", "_completion_ledger", "OrderedDict"} <= added
    assert all(
        name.startswith(("_completion", "_Completion", "_COMPLETION")) for name in added - {"OrderedDict"}
    )
    untouched = ("request_finished", "get_finished", "update_state_after_alloc", "wait_for_save")
    for name in (n for n in untouched if n not in changed):
        qualname = f"{native.CLASS}.{name}"
        assert native.c.function_code(edit.after, qualname) == native.c.function_code(edit.before, qualname)


def test_the_diff_applies_to_a_clean_copy(
    carried: tuple[SourceTree, Result, SourceTree], tmp_path: Path
) -> None:
    _, result, _ = carried
    git = shutil.which("git")
    if git is None:
        pytest.skip("git is not installed")
    clean = tmp_path / "clean"
    for edit in result.edits:
        (clean / edit.path).parent.mkdir(parents=True, exist_ok=True)
        (clean / edit.path).write_text(edit.before, encoding="utf-8")
    patch_file = tmp_path / "carry.patch"
    patch_file.write_text("".join(e.diff() for e in result.edits), encoding="utf-8")
    subprocess.run([git, "init", "-q", str(clean)], check=True)
    subprocess.run([git, "-C", str(clean), "apply", "--check", str(patch_file)], check=True)
    subprocess.run([git, "-C", str(clean), "apply", str(patch_file)], check=True)
    for edit in result.edits:
        assert (clean / edit.path).read_text(encoding="utf-8") == edit.after


def test_probe_sees_the_bug_on_the_plain_tree_and_not_on_the_changed_one(
    carried: tuple[SourceTree, Result, SourceTree],
) -> None:
    tree, _, changed = carried
    assert ask_tree(tree, FIX)["answer"] == "would fix"  # negative control, runtime fix off
    assert ask_tree(changed, FIX)["answer"] == "fixed upstream"
    plain, fixed = scenario(tree)["checks"], scenario(changed)["checks"]
    symptoms = ["swallowed-completion", "early-completion", "stray-completion", "stray-recving"]
    if "def register_finished_partial_tail(" in tree.read(MODULE):  # vLLM 0.30.0+
        symptoms.append("partial-tail-owner-ignored")
    # Unchanged tree: every symptom of the bug (D1, D2, stray reports, D4) is seen.
    assert {name: plain[name] for name in symptoms} == dict.fromkeys(symptoms, True)
    # Changed tree, runtime fix off: none is, and every guard holds.
    assert not any(fixed.values()), fixed


def test_a_drifted_body_cannot_be_carried(
    carried: tuple[SourceTree, Result, SourceTree], tmp_path: Path
) -> None:
    """update_connector_output's body is rewritten, so the runtime fix accepts only its known
    fingerprint; a changed body is refused by the native carry too, and nothing is written."""
    tree, _, _ = carried
    drifted = scratch_copy(tree, tmp_path / "drifted")
    path = drifted.path_of(MODULE)
    text = path.read_text(encoding="utf-8")
    start = text.index("    def update_connector_output(", text.index("class MultiConnector("))
    needle = "c.update_connector_output(connector_output)"
    at = text.index(needle, start)
    changed = text[:at] + needle + " or None" + text[at + len(needle) :]
    assert changed != text
    path.unlink()  # the copy is hard-linked: replace the file, never write through it
    path.write_text(changed, encoding="utf-8")
    with pytest.raises(native.CannotCarry, match="update_connector_output changed"):
        native.transform(drifted)
    result = carry(FIX, drifted, tmp_path / "work")
    assert result.result is Carried.CANNOT and result.reason
    assert result.edits == () and path.read_text(encoding="utf-8") == changed


def test_a_carried_tree_needs_nothing_more(
    carried: tuple[SourceTree, Result, SourceTree], tmp_path: Path
) -> None:
    _, _, changed = carried
    again = carry(FIX, changed, tmp_path)
    assert again.result is Carried.NOT_NEEDED, again.reason
    assert "carries it already" in again.reason
