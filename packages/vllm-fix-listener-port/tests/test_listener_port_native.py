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
from vllm_fix_listener_port import FIX, native
from vllm_fix_listener_port.declaration import COMMON, CONNECTOR
from vllm_fix_testing.native_trees import installed_tree

# The probe's two scenarios (two ranks choosing their kv port; one worker built through
# __init__ with MORI's listener stood in), asked in a child process that imports vLLM from the
# tree with every runtime fix off.
SCENARIO = """
import json
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_common
from vllm_fix_listener_port.probe import _worker_port, ports_held_here, tp_group, vllm_config
with tp_group():
    configs = [moriio_common.MoRIIOConfig.from_vllm_config(vllm_config()) for _ in range(2)]
    worker = _worker_port()
ports = [int(c.local_kv_port) for c in configs]
held = sorted(set(ports) & ports_held_here())
print(json.dumps({"vllm": vllm.__file__, "ports": ports, "held": held, "worker": list(worker)}))
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


def test_carry_is_written_and_touches_only_the_two_functions(
    carried: tuple[SourceTree, Result, SourceTree],
) -> None:
    tree, result, _ = carried
    assert result.result is Carried.WRITTEN, result.reason
    edits = {e.path: e for e in result.edits}
    assert set(edits) == {tree.relpath(COMMON), tree.relpath(CONNECTOR)}
    for module, qualname, mark in (
        (COMMON, native.CONFIG, native.MARK_CONFIG),
        (CONNECTOR, native.WORKER, native.MARK_WORKER),
    ):
        edit = edits[tree.relpath(module)]
        assert edit.after.count(mark) == 1
        assert mark in native.c.function_code(edit.after, qualname)
        assert "vllm_fix" not in edit.after
    removed = [
        ln
        for ln in edits[tree.relpath(COMMON)].diff().splitlines()
        if ln.startswith("-") and not ln.startswith("---")
    ]
    assert [ln[1:].strip() for ln in removed] == ["local_kv_port=get_open_port(),"]  # the one line changed
    assert "\n-" not in edits[tree.relpath(CONNECTOR)].diff().split("+++", 1)[1]  # only additions


def test_negative_controls_pass_on_the_changed_tree_and_fail_on_the_plain_one(
    carried: tuple[SourceTree, Result, SourceTree],
) -> None:
    tree, _, changed = carried
    plain, fixed = scenario(tree), scenario(changed)
    # Unchanged tree: each rank's kv port is a probed number nothing holds until MORI binds it.
    assert all(p != 0 for p in plain["ports"]) and plain["held"] == []
    # Changed tree, runtime fix off: RDMA asks MORI's listener for port 0 (the kernel chooses at
    # the bind), and the worker and its config then carry the port the listener bound.
    assert fixed["ports"] == [0, 0]
    assert fixed["worker"] == [False, ""]


def test_a_drifted_body_cannot_be_carried(
    carried: tuple[SourceTree, Result, SourceTree], tmp_path: Path
) -> None:
    """The runtime fix refuses a worker whose __init__ no longer copies local_kv_port from the
    config; so does the native carry, and nothing is written."""
    tree, _, _ = carried
    drifted = scratch_copy(tree, tmp_path / "drifted")
    path = drifted.path_of(CONNECTOR)
    text = path.read_text(encoding="utf-8")
    old = "self.local_kv_port = self.moriio_config.local_kv_port"
    at = text.index(old, text.index("class MoRIIOConnectorWorker"))
    changed = text[:at] + "self.local_kv_port = int(self.moriio_config.local_kv_port)" + text[at + len(old) :]
    path.unlink()  # the copy is hard-linked: replace the file, never write through it
    path.write_text(changed, encoding="utf-8")
    result = carry(FIX, drifted, tmp_path / "work")
    assert result.result is Carried.CANNOT
    assert "no longer copies local_kv_port from the config" in result.reason
    assert result.edits == () and path.read_text(encoding="utf-8") == changed


def test_a_carried_tree_needs_nothing_more(
    carried: tuple[SourceTree, Result, SourceTree], tmp_path: Path
) -> None:
    _, _, changed = carried
    again = carry(FIX, changed, tmp_path)
    assert again.result is Carried.NOT_NEEDED, again.reason
    assert "carries it already" in again.reason
