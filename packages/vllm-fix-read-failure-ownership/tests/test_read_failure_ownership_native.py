"""The native carry on the installed release's own sources: written, verified, git-apply-able,
failing hybrid READs closed with the runtime fix off, refused for a drifted body, idempotent."""

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

from vllm_fix_core import ast_fingerprint, original_of
from vllm_fix_core.backport import Carried, Result, ask_tree, carry, scratch_copy, write_edits
from vllm_fix_core.native import SourceTree
from vllm_fix_read_failure_ownership import FIX, native, patch
from vllm_fix_read_failure_ownership.declaration import MODULE
from vllm_fix_testing.native_trees import installed_tree

# The probe's scenarios (vLLM's own MoRIIOWrapper and get_finished, frozen MORI statuses), and
# a hybrid poll where one READ fails while another completes, through the tree's own
# _pop_done_transfers in a child process that imports vLLM from the tree, runtime fixes off.
SCENARIO = """
import dataclasses
import json
import time
import vllm
from vllm_fix_read_failure_ownership import probe

mc, me = probe._modules()
outcomes = {
    "failure": probe.run(["failed", "pending"], hybrid=True, age=1.0),
    "timeout": probe.run(["pending"], hybrid=True, age=probe.TIMEOUT * 100),
    "success": probe.run(["done", "done"], hybrid=True, age=1.0),
    "waiting": probe.run(["pending"], hybrid=True, age=1.0),
    "attention-failure": probe.run(["failed", "pending"], hybrid=False, age=1.0),
    "attention-timeout": probe.run(["pending"], hybrid=False, age=probe.TIMEOUT * 100),
}
found = {k: {**dataclasses.asdict(v), "reported": sorted(v.reported)} for k, v in outcomes.items()}

cls = mc.MoRIIOConnectorWorker
worker = cls.__new__(cls)
sent = []
worker.moriio_wrapper = probe._wrapper(me.MoRIIOWrapper, sent)
worker.world_size, worker._has_mamba, worker._invalid_block_ids = 1, True, set()
worker.moriio_config = type("Config", (), {"recv_abort_timeout": probe.TIMEOUT})()
states = {"req-failed": "failed", "req-done": "done"}
worker._recving_transfers = {r: {"attn0": [probe.FrozenStatus(s)]} for r, s in states.items()}
worker._recving_transfers_callback_addr = {
    r: ("127.0.0.1", probe.holder_ports(cls), f"xfer-{r}") for r in states
}
worker._recving_transfers_start = {r: time.monotonic() for r in states}
worker._recving_local_blocks = {r: [7] for r in states}
try:
    worker._pop_done_transfers()
    raised = ""
except Exception as exc:
    raised = f"{type(exc).__name__}: {exc}"
found["mixed"] = {
    "raised": raised,
    "releases": sent.count("release"),
    "tracked": sorted(worker._recving_transfers),
}
print(json.dumps({"vllm": vllm.__file__, "outcomes": found}))
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
    outcomes: dict[str, Any] = found["outcomes"]
    return outcomes


@pytest.fixture(scope="module")
def carried(tmp_path_factory: pytest.TempPathFactory) -> tuple[SourceTree, Result, SourceTree]:
    """(the release's tree, the carry's result, a copy of the tree with the edits written)."""
    tree = installed_tree(tmp_path_factory.mktemp("tree"))
    result = carry(FIX, tree, tmp_path_factory.mktemp("work"))
    changed = scratch_copy(tree, tmp_path_factory.mktemp("changed"))
    write_edits(changed.root, result.edits)
    return tree, result, changed


def replaced(tree: SourceTree, tmp_path: Path, old: str, new: str) -> SourceTree:
    """A copy of `tree` whose connector module has `old` (once) replaced by `new`."""
    copy = scratch_copy(tree, tmp_path)
    path = copy.path_of(MODULE)
    text = path.read_text(encoding="utf-8")
    assert text.count(old) == 1
    path.unlink()  # the copy is hard-linked: replace the file, never write through it
    path.write_text(text.replace(old, new), encoding="utf-8")
    return copy


def test_the_tree_is_recognised_as_the_runtime_recognises_it(
    carried: tuple[SourceTree, Result, SourceTree],
) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector as mc

    tree, _, _ = carried
    installed = ast_fingerprint(original_of(mc.MoRIIOConnectorWorker, native.TARGET))
    assert native.fingerprint(native.c.ast_of(tree.read(MODULE), native.QUALNAME)) == installed
    assert native.recognize(tree) == patch.recognize()


def test_the_plain_tree_has_the_bug(carried: tuple[SourceTree, Result, SourceTree]) -> None:
    tree, _, _ = carried
    assert ask_tree(tree, FIX)["answer"] == "would fix"


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


def test_carry_is_written_and_only_adds_lines_to_the_method(
    carried: tuple[SourceTree, Result, SourceTree],
) -> None:
    tree, result, changed = carried
    assert result.result is Carried.WRITTEN, result.reason
    assert [e.path for e in result.edits] == [tree.relpath(MODULE)]
    (edit,) = result.edits
    assert edit.after.count(native.MARK) == 1
    assert "vllm_fix" not in edit.after
    diff = edit.diff().splitlines()
    assert not [ln for ln in diff if ln.startswith("-") and not ln.startswith("---")]
    # Every added line lies inside _pop_done_transfers.
    method = native.c.ast_of(edit.after, native.QUALNAME)
    assert method.end_lineno is not None
    added = [i + 1 for i, ln in enumerate(edit.after.splitlines()) if ln not in edit.before.splitlines()]
    assert added and all(method.lineno <= n <= method.end_lineno for n in added)
    assert ask_tree(changed, FIX)["answer"] == "fixed upstream"


def test_negative_controls_pass_on_the_changed_tree_and_fail_on_the_plain_one(
    carried: tuple[SourceTree, Result, SourceTree],
) -> None:
    tree, _, changed = carried
    plain, fixed = scenario(tree), scenario(changed)
    holders = 2 if "_send_read_release" in tree.read(MODULE) else 1
    closed = {"raised": "TransferError", "releases": 0, "tracked": True, "forgotten": False, "reported": []}
    # Unchanged tree: a hybrid failure releases the producer and forgets the transfer; a
    # hybrid timeout reports and forgets it (the bug).
    assert plain["failure"]["raised"] == "" and plain["failure"]["forgotten"]
    assert plain["failure"]["releases"] == holders
    assert plain["timeout"]["raised"] == "" and plain["timeout"]["forgotten"]
    assert plain["mixed"]["raised"] == "" and plain["mixed"]["tracked"] == []
    # Changed tree, runtime fix off: both fail closed, touching nothing.
    assert fixed["failure"] == closed and fixed["timeout"] == closed
    # What the fix keeps: success, waiting and attention-only recovery are vLLM's own.
    for kept in ("success", "waiting", "attention-failure", "attention-timeout"):
        assert fixed[kept] == plain[kept], kept
    assert fixed["success"]["releases"] == holders and fixed["success"]["forgotten"]
    assert fixed["attention-failure"]["reported"] == [7, 8]
    # A READ that completed in the same poll is released and dropped; then the step fails.
    assert fixed["mixed"]["raised"].startswith("TransferError: MoRIIO hybrid READ cannot complete")
    assert "req-failed: READ failed: probe: injected failure" in fixed["mixed"]["raised"]
    assert fixed["mixed"]["releases"] == holders and fixed["mixed"]["tracked"] == ["req-failed"]


def test_a_drifted_body_cannot_be_carried(
    carried: tuple[SourceTree, Result, SourceTree], tmp_path: Path
) -> None:
    """The runtime fix changes only an exactly fingerprinted body; so does the native carry
    (here a body that no longer reports the blocks of a timed-out READ: the probe still sees
    the bug)."""
    tree, _, _ = carried
    text = tree.read(MODULE)
    method = native.c.function_code(text, native.QUALNAME)
    old = "                        self._record_failed_recv(req_id)\n                        to_remove"
    assert text.count(old) == 1 and "_record_failed_recv" in method
    drifted = replaced(tree, tmp_path / "drifted", old, "                        to_remove")
    result = carry(FIX, drifted, tmp_path / "work")
    assert result.result is Carried.CANNOT
    assert "normalized-AST fingerprint" in result.reason and "not one of the known shapes" in result.reason
    assert result.edits == ()
    assert drifted.read(MODULE) == text.replace(old, "                        to_remove")


def test_a_tree_without_transfer_error_cannot_be_carried(
    carried: tuple[SourceTree, Result, SourceTree], tmp_path: Path
) -> None:
    tree, _, _ = carried
    drifted = replaced(tree, tmp_path / "no-error", "    TransferError,\n", "")
    with pytest.raises(native.CannotCarry, match="no module-level TransferError"):
        native.transform(drifted)


def test_a_carried_tree_needs_nothing_more(
    carried: tuple[SourceTree, Result, SourceTree], tmp_path: Path
) -> None:
    _, _, changed = carried
    again = carry(FIX, changed, tmp_path)
    assert again.result is Carried.NOT_NEEDED, again.reason
    assert "carries it already" in again.reason
