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

from vllm_fix_core.backport import Carried, Result, carry, scratch_copy, write_edits
from vllm_fix_core.native import SourceTree
from vllm_fix_k3_eof_flush import FIX, native
from vllm_fix_k3_eof_flush.patch import K3_MODULE
from vllm_fix_testing.native_trees import installed_tree

# The README's failing scenarios (what test_k3_eof_flush_vllm.py streams unpatched), through
# the real KimiK3Parser in a child process that imports vLLM from the tree, runtime fixes off.
SCENARIO = """
import json
import vllm
from vllm_fix_k3_eof_flush.probe import MARKERS, REASONING, SEQUENCE, streamed
print(json.dumps({
    "vllm": vllm.__file__,
    "plain": streamed(SEQUENCE),
    "tools": streamed(SEQUENCE, with_tools=True),
    "think": streamed(REASONING),
    "markers": streamed(MARKERS),
    "held": streamed(SEQUENCE, finished=False),
}))
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
def carried(tmp_path_factory: pytest.TempPathFactory) -> tuple[SourceTree, Result, SourceTree]:
    """(the release's tree, the carry's result, a copy of the tree with the edits written)."""
    tree = installed_tree(tmp_path_factory.mktemp("tree"))
    result = carry(FIX, tree, tmp_path_factory.mktemp("work"))
    changed = scratch_copy(tree, tmp_path_factory.mktemp("changed"))
    write_edits(changed.root, result.edits)
    return tree, result, changed


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


def test_carry_is_written_and_touches_only_parse_delta(
    carried: tuple[SourceTree, Result, SourceTree],
) -> None:
    tree, result, _ = carried
    assert result.result is Carried.WRITTEN, result.reason
    assert [e.path for e in result.edits] == [tree.relpath(K3_MODULE)]
    (edit,) = result.edits
    assert edit.after.count(native.MARK_METHOD) == 1
    assert edit.after.count(native.MARK_HELPERS) == 1
    assert "vllm_fix" not in edit.after
    # vLLM's body is kept, byte for byte, under the private name; the rest only gains lines.
    removed = [ln[1:] for ln in edit.diff().splitlines() if ln.startswith("-") and not ln.startswith("---")]
    assert [ln.strip() for ln in removed] == ["from typing import TYPE_CHECKING", "def parse_delta("]
    assert native.HOLDING in native.c.module_names(edit.after) or f"def {native.HOLDING}(" in edit.after
    added = native.c.module_names(edit.after) - native.c.module_names(edit.before)
    assert added == {"_k3_held_tail", "_release_held_tail", "Any"}


def test_negative_controls_pass_on_the_changed_tree_and_fail_on_the_plain_one(
    carried: tuple[SourceTree, Result, SourceTree],
) -> None:
    tree, _, changed = carried
    plain, fixed = scenario(tree), scenario(changed)
    # Unchanged tree: the held-back "<" is lost at the end of the stream (the bug).
    assert plain["plain"] == ["Plan.", "List"] and plain["tools"][1] == "List"
    assert plain["think"][0] == "Compare x "
    # Changed tree, runtime fix off: released once, in its channel; no marker leaks, and
    # nothing is released before the end.
    assert fixed["plain"] == ["Plan.", "List<"]
    assert fixed["tools"][1] == "List<"
    assert fixed["think"][0] == "Compare x <"
    assert fixed["markers"] == plain["markers"] == ["Plan.", "Hi"]
    assert fixed["held"] == plain["held"] == ["Plan.", "List"]


def test_a_drifted_body_cannot_be_carried(
    carried: tuple[SourceTree, Result, SourceTree], tmp_path: Path
) -> None:
    """The runtime fix refuses a parse_delta whose `finished` is no longer keyword-only (the
    probe, passing it by keyword, still runs and sees the bug); so does the native carry."""
    tree, _, _ = carried
    drifted = scratch_copy(tree, tmp_path / "drifted")
    path = drifted.path_of(K3_MODULE)
    text = path.read_text(encoding="utf-8")
    old = "        prompt_token_ids: list[int] | None = None,\n        *,\n        finished: bool,\n"
    assert text.count(old) == 1
    changed = text.replace(
        old, "        prompt_token_ids: list[int] | None = None,\n        finished: bool = False,\n"
    )
    path.unlink()  # the copy is hard-linked: replace the file, never write through it
    path.write_text(changed, encoding="utf-8")
    result = carry(FIX, drifted, tmp_path / "work")
    assert result.result is Carried.CANNOT
    assert "unexpected signature KimiK3Parser.parse_delta" in result.reason
    assert result.edits == () and path.read_text(encoding="utf-8") == changed


def test_a_carried_tree_needs_nothing_more(
    carried: tuple[SourceTree, Result, SourceTree], tmp_path: Path
) -> None:
    _, _, changed = carried
    again = carry(FIX, changed, tmp_path)
    assert again.result is Carried.NOT_NEEDED, again.reason
    assert "carries it already" in again.reason
