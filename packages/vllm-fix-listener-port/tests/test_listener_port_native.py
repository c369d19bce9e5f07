"""The native carry on the installed release's own sources: written, verified, git-apply-able,
behaving as the rule says with the runtime fix off, refused for a drifted body, idempotent."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("libcst")

from vllm_fix_core.backport import Carried
from vllm_fix_listener_port import FIX, native
from vllm_fix_listener_port.declaration import COMMON, CONNECTOR
from vllm_fix_testing import native_trees as nt

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
print(json.dumps({"ports": ports, "held": held, "worker": list(worker)}))
"""


@pytest.fixture(scope="module")
def carried(tmp_path_factory: pytest.TempPathFactory) -> nt.Carry:
    """(the release's tree, the carry's result, a copy of the tree with the edits written)."""
    return nt.carried_trees(FIX, tmp_path_factory.mktemp)


def test_the_diff_applies_to_a_clean_copy(carried: nt.Carry, tmp_path: Path) -> None:
    _, result, _ = carried
    nt.assert_git_applies(result.edits, tmp_path)


def test_carry_is_written_and_touches_only_the_two_functions(
    carried: nt.Carry,
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


@pytest.mark.native_control
def test_negative_controls_pass_on_the_changed_tree_and_fail_on_the_plain_one(
    carried: nt.Carry,
) -> None:
    tree, _, changed = carried
    plain, fixed = nt.run_in_tree(tree, SCENARIO), nt.run_in_tree(changed, SCENARIO)
    # Unchanged tree: each rank's kv port is a probed number nothing holds until MORI binds it.
    assert all(p != 0 for p in plain["ports"]) and plain["held"] == []
    # Changed tree, runtime fix off: RDMA asks MORI's listener for port 0 (the kernel chooses at
    # the bind), and the worker and its config then carry the port the listener bound.
    assert fixed["ports"] == [0, 0]
    assert fixed["worker"] == [False, ""]


def test_a_drifted_body_cannot_be_carried(carried: nt.Carry, tmp_path: Path) -> None:
    """The runtime fix refuses a worker whose __init__ no longer copies local_kv_port from the
    config; so does the native carry, and nothing is written."""
    tree, _, _ = carried

    def drift(text: str) -> str:
        old = "self.local_kv_port = self.moriio_config.local_kv_port"
        new = "self.local_kv_port = int(self.moriio_config.local_kv_port)"
        at = text.index(old, text.index("class MoRIIOConnectorWorker"))
        return text[:at] + new + text[at + len(old) :]

    drifted = nt.rewritten(tree, tmp_path / "drifted", CONNECTOR, drift)
    reason = "no longer copies local_kv_port from the config"
    nt.assert_cannot_carry(FIX, drifted, CONNECTOR, tmp_path / "work", reason)


def test_a_carried_tree_needs_nothing_more(carried: nt.Carry, tmp_path: Path) -> None:
    _, _, changed = carried
    nt.assert_needs_nothing_more(FIX, changed, tmp_path)
