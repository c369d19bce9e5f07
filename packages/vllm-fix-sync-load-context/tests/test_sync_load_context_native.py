"""The native carry on the installed release's own sources: written, verified, git-apply-able,
behaving as the rule says with the runtime fix off, refused for a drifted runner, idempotent."""

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

from vllm_fix_core.backport import Carried, Result, ask_tree, carry, scratch_copy, write_edits
from vllm_fix_core.native import SourceTree
from vllm_fix_sync_load_context import FIX, native
from vllm_fix_testing.native_trees import installed_tree

# One real FULL-replay step and one on the other branch (the probe's steps), asked in a child
# process that imports vLLM from the tree with every runtime fix off: what start_load_kv saw.
SCENARIO = """
import json
import vllm
from vllm_fix_sync_load_context.probe import _dispatches_modes, probe_config, run_step
from vllm_fix_sync_load_context.stand_ins import RecordingLoader, Seen
out = {"vllm": vllm.__file__}
for mode in ("FULL", "PIECEWISE" if _dispatches_modes() else "NONE"):
    seen = Seen()
    batch, attn = run_step(mode, RecordingLoader(seen), seen, probe_config())
    load = seen.loads[0]
    desc = load["batch_descriptor"]
    out[mode if mode == "FULL" else "other"] = {
        "mode": load["mode"].name,
        "step_attn": load["attn_metadata"] is attn,
        "desc": None if desc is None else [desc.num_tokens, desc.num_reqs],
        "events": seen.events,
        "context_at_run": seen.context_at_run,
    }
print(json.dumps(out))
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


def test_carry_is_written_and_changes_only_the_full_branch(
    carried: tuple[SourceTree, Result, SourceTree],
) -> None:
    tree, result, _ = carried
    assert result.result is Carried.WRITTEN, result.reason
    assert [e.path for e in result.edits] == [tree.relpath(native.RUNNER)]
    (edit,) = result.edits
    assert edit.after.count(native.MARK) == 1
    assert "vllm_fix" not in edit.after  # a fork carries no dependency on us
    # Only execute_model changed, and in it only the FULL branch's connector call moved into
    # a context: every removed line is that call.
    assert native.MARK in native.c.function_code(edit.after, native.EXECUTE)
    original = native.c.find_function(native.c.parse(edit.before), native.EXECUTE)
    assert native.c.change_function(edit.after, native.EXECUTE, lambda _: original) == edit.before
    removed = [
        ln[1:].strip() for ln in edit.diff().splitlines() if ln.startswith("-") and not ln.startswith("---")
    ]
    assert removed and "self.kv_connector.pre_forward(" in removed[0]
    assert "cudagraph_runtime_mode=CUDAGraphMode.FULL," in edit.after
    assert "num_reqs=input_batch.num_reqs_after_padding," in edit.after


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


def test_the_full_step_loads_in_its_own_context_on_the_changed_tree(
    carried: tuple[SourceTree, Result, SourceTree],
) -> None:
    tree, _, changed = carried
    plain, fixed = scenario(tree), scenario(changed)
    # Unchanged tree: the FULL step's load sees vLLM's fallback context (the bug).
    assert plain["FULL"]["mode"] == "NONE" and not plain["FULL"]["step_attn"]
    # Changed tree, runtime fix off: FULL, the step's metadata, the replayed graph's size; the
    # load runs before the replay and no context is open at the replay.
    full = fixed["FULL"]
    assert full["mode"] == "FULL" and full["step_attn"]
    assert full["desc"] == [4, 4]
    assert full["events"][:2] == ["start_load_kv", "replay"] and not any(full["context_at_run"])
    # The other branch is as it was.
    assert fixed["other"] == plain["other"] and fixed["other"]["step_attn"]


def test_a_drifted_runner_cannot_be_carried(
    carried: tuple[SourceTree, Result, SourceTree], tmp_path: Path
) -> None:
    """A runner whose other branch no longer opens set_forward_context around pre_forward is
    refused by the runtime fix; the native carry refuses it too, and nothing is written."""
    tree, _, _ = carried
    drifted = scratch_copy(tree, tmp_path / "drifted")
    path = drifted.path_of(native.RUNNER)
    text = path.read_text(encoding="utf-8")
    at = text.index("with set_forward_context(", text.index("    def execute_model("))
    assert native.c.function_code(text, native.EXECUTE).count("with set_forward_context(") == 1
    changed = text[:at] + "with open_step_context(" + text[at + len("with set_forward_context(") :]
    path.unlink()  # the copy is hard-linked: replace the file, never write through it
    path.write_text(changed, encoding="utf-8")
    with pytest.raises(native.CannotCarry, match="no longer calls pre_forward inside set_forward_context"):
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
