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
from vllm_fix_read_eligibility import FIX, native
from vllm_fix_read_eligibility.declaration import MODULE
from vllm_fix_testing.native_trees import installed_tree

# The negative controls of test_read_eligibility_scenarios.py, asked in a child process that
# imports vLLM from the tree with every runtime fix off.
SCENARIO = """
import json
from vllm_fix_read_eligibility.probe import PLAIN, PROMPT, consumer, malformed, matched, request
from vllm_fix_read_eligibility.probe import row_id, well_formed
from vllm_fix_read_eligibility.releases import block_layout
import vllm
layout = block_layout()
bad = {k: matched(consumer(), p, rid=row_id(k)) for k, p in malformed(layout).items()}
good = matched(consumer(), well_formed(layout))
req = request(malformed(layout)["empty-groups"], rid="req-malformed-7")
first = consumer().get_num_new_matched_tokens(req, 0)
print(json.dumps({"vllm": vllm.__file__, "bad": bad, "good": good, "first": list(first),
                  "flag": req.kv_transfer_params["do_remote_prefill"], "prompt": PROMPT}))
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


def test_carry_is_written_and_touches_only_the_claim(carried: tuple[SourceTree, Result, SourceTree]) -> None:
    tree, result, _ = carried
    assert result.result is Carried.WRITTEN, result.reason
    assert [e.path for e in result.edits] == [tree.relpath(MODULE)]
    (edit,) = result.edits
    assert edit.after.count(native.MARK_GUARD) == 1  # the changed method
    assert edit.after.count(native.MARK_HELPERS) == 1  # the helpers added next to it
    assert "vllm_fix" not in edit.after  # a fork carries no dependency on us
    removed = [ln for ln in edit.diff().splitlines() if ln.startswith("-") and not ln.startswith("---")]
    assert removed == []  # only additions: the guard and the helpers
    assert native.MARK_GUARD in native.c.function_code(edit.after, native.QUALNAME)
    added = native.c.module_names(edit.after) - native.c.module_names(edit.before)
    assert added == {"_read_blocks_needed", "_read_block_ids_refusal", "_read_route_refusal", native.HELPER}


def test_the_diff_applies_to_a_clean_copy(
    carried: tuple[SourceTree, Result, SourceTree], tmp_path: Path
) -> None:
    _, result, _ = carried
    git = shutil.which("git")
    if git is None:
        pytest.skip("git is not installed")
    clean = tmp_path / "clean"
    (clean / Path(result.edits[0].path).parent).mkdir(parents=True)
    for edit in result.edits:
        (clean / edit.path).write_text(edit.before, encoding="utf-8")
    patch_file = tmp_path / "carry.patch"
    patch_file.write_text("".join(e.diff() for e in result.edits), encoding="utf-8")
    subprocess.run([git, "init", "-q", str(clean)], check=True)
    subprocess.run([git, "-C", str(clean), "apply", "--check", str(patch_file)], check=True)
    subprocess.run([git, "-C", str(clean), "apply", str(patch_file)], check=True)
    assert (clean / result.edits[0].path).read_text(encoding="utf-8") == result.edits[0].after


def test_negative_controls_pass_on_the_changed_tree_and_fail_on_the_plain_one(
    carried: tuple[SourceTree, Result, SourceTree],
) -> None:
    tree, _, changed = carried
    plain, fixed = scenario(tree), scenario(changed)
    prompt = plain["prompt"]
    # Unchanged tree: every malformed row claims N-1 (the bug), as the scenarios test asserts.
    assert set(map(tuple, plain["bad"].values())) == {(prompt - 1, False)}
    # Changed tree, runtime fix off: no malformed row claims, a real remote prefill still does,
    # and the refused request's flag is cleared so nothing is queued from it.
    assert {k: tuple(v) for k, v in fixed["bad"].items()} == {k: (0, False) for k in plain["bad"]}
    assert tuple(fixed["good"]) == tuple(plain["good"]) == (prompt - 1, False)
    assert fixed["first"] == [0, False] and fixed["flag"] is False
    assert plain["first"] == [prompt - 1, False] and plain["flag"] is True


def test_a_drifted_body_cannot_be_carried(
    carried: tuple[SourceTree, Result, SourceTree], tmp_path: Path
) -> None:
    """The runtime fix refuses a body that no longer decides by is_producer / mode; so does
    the native carry, and nothing is written."""
    tree, _, _ = carried
    drifted = scratch_copy(tree, tmp_path / "drifted")
    path = drifted.path_of(MODULE)
    text = path.read_text(encoding="utf-8")
    start = text.index("    def get_num_new_matched_tokens(", text.index("class MoRIIOConnectorScheduler"))
    at = text.index("if self.is_producer:", start)
    changed = text[:at] + 'if getattr(self, "is_producer"):' + text[at + len("if self.is_producer:") :]
    assert "self.is_producer" not in native.c.function_code(changed, native.QUALNAME)
    path.unlink()  # the copy is hard-linked: replace the file, never write through it
    path.write_text(changed, encoding="utf-8")
    result = carry(FIX, drifted, tmp_path / "work")
    assert result.result is Carried.CANNOT
    assert "no longer decides by self.is_producer" in result.reason
    assert result.edits == () and path.read_text(encoding="utf-8") == changed


def test_a_carried_tree_needs_nothing_more(
    carried: tuple[SourceTree, Result, SourceTree], tmp_path: Path
) -> None:
    _, _, changed = carried
    again = carry(FIX, changed, tmp_path)
    assert again.result is Carried.NOT_NEEDED, again.reason
    assert "carries it already" in again.reason
