"""The native carry on the installed release's own sources: written, verified by the probe in a
child with the runtime fixes off, git-apply-able, behaving as the rule says, refused for a caller
it cannot place, and not needed a second time."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("libcst")

from vllm_fix_core.backport import Carried
from vllm_fix_handshake_port import FIX, native
from vllm_fix_handshake_port.declaration import COMMON, CONNECTOR
from vllm_fix_testing import native_trees as nt

# The notify port each rank of a DP_local x TP = 2 x 2 engine binds (vLLM's own from_vllm_config,
# the TP group answered per rank as the probe does), and whether overlapping bases are accepted.
LISTENERS = """
import json
from vllm_fix_handshake_port import probe
common, connector, engine = probe._mods()
rank = probe._Rank()
with probe._tp_group(common, connector, rank):
    ports = probe._listener_ports(common, rank)
    rank.tp_rank = 0
    accepted = probe._layout_accepted(common)
print(json.dumps({"ports": [ports[r] for r in sorted(ports)], "accepted": accepted, "base": probe.NOTIFY}))
"""

# The WRITE notify port of decode rank (dp 1, tp 0) from a writer whose worker has no world_size
# and whose task does not know the decode TP size (vLLM's own writer tests build such workers).
WRITER_WITHOUT_WORLD_SIZE = """
import json
from vllm_fix_handshake_port import probe
common, connector, engine = probe._mods()
installed = probe._installed(common, connector, engine)
port = probe._write_notify_port(common, engine, installed, 1, 0, world_size=None, task_tp_size=0)
print(json.dumps({"port": port, "base": probe.NOTIFY}))
"""


@pytest.fixture(scope="module")
def carried(tmp_path_factory: pytest.TempPathFactory) -> nt.Carry:
    """(the release's tree, the carry's result, a copy of the tree with the edits written)."""
    return nt.carried_trees(FIX, tmp_path_factory.mktemp)


def test_carry_is_written_and_only_adds_the_tp_size_and_the_layout_check(
    carried: nt.Carry,
) -> None:
    tree, result, _ = carried
    assert result.result is Carried.WRITTEN, result.reason
    edits = {e.path: e for e in result.edits}
    assert tree.relpath(COMMON) in edits and tree.relpath(CONNECTOR) in edits
    common = edits[tree.relpath(COMMON)]
    assert common.after.count(native.MARK_LAYOUT) == 1
    assert native.MARK_LAYOUT in native.c.function_code(common.after, native.CONFIG)
    for edit in edits.values():
        assert "vllm_fix" not in edit.after
        before = [c for c in native._offset_calls(native.ast.parse(edit.before)) if native._omits_tp(c)]
        assert before, edit.path  # each file changed has a call without a TP size
        assert edit.after.count(native.MARK_OFFSET) >= 1
    # Every get_port_offset call of the changed tree passes a TP size.
    for edit in edits.values():
        assert all(
            not native._omits_tp(call) for call in native._offset_calls(native.ast.parse(edit.after))
        ), edit.path


def test_the_diff_applies_to_a_clean_copy(carried: nt.Carry, tmp_path: Path) -> None:
    _, result, _ = carried
    nt.assert_git_applies(result.edits, tmp_path)


def test_the_probe_sees_the_bug_on_the_plain_tree_and_not_on_the_changed_one(
    carried: nt.Carry,
) -> None:
    tree, _, changed = carried
    checks = ("listener-ports-collide", "overlapping-port-blocks-accepted")
    nt.assert_probe_tells(FIX, tree, changed, *checks)  # negative control: the plain tree


@pytest.mark.native_control
def test_each_rank_binds_its_own_port_and_overlapping_blocks_are_refused(
    carried: nt.Carry,
) -> None:
    tree, _, changed = carried
    plain = nt.run_in_tree(tree, LISTENERS)
    assert len(set(plain["ports"])) < len(plain["ports"]) and plain["accepted"]  # the bug
    fixed = nt.run_in_tree(changed, LISTENERS)
    base = fixed["base"]
    # (dp, tp) in order (0,0) (0,1) (1,0) (1,1): base + dp * TP + tp, the spec's offsets.
    assert fixed["ports"] == [base, base + 1, base + 2, base + 3]
    assert fixed["accepted"] is False


def test_a_writer_whose_worker_has_no_world_size_keeps_vllms_offset(carried: nt.Carry) -> None:
    """Where neither the task nor the worker says the decode TP size, the changed writer keeps
    vLLM's offset (dp + tp), as the runtime fix does, instead of failing the notify."""
    tree, _, changed = carried
    for found in (
        nt.run_in_tree(tree, WRITER_WITHOUT_WORLD_SIZE),
        nt.run_in_tree(changed, WRITER_WITHOUT_WORLD_SIZE),
    ):
        assert found["port"] == found["base"] + 1, found


def test_a_caller_it_cannot_place_is_not_carried(carried: nt.Carry, tmp_path: Path) -> None:
    """The runtime fix refuses a tree where a function it cannot place calls get_port_offset
    without a TP size; so does the native carry, and nothing is written."""
    tree, _, _ = carried
    caller = (
        "\n\ndef fork_notify_port(base: int, dp_rank: int, tp_rank: int) -> int:\n"
        "    return base + get_port_offset(dp_rank, tp_rank)\n"
    )
    drifted = nt.rewritten(tree, tmp_path / "drifted", CONNECTOR, lambda text: text + caller)
    reason = "fork_notify_port calls get_port_offset without a TP size"
    nt.assert_cannot_carry(FIX, drifted, CONNECTOR, tmp_path / "work", reason)


def test_a_carried_tree_needs_nothing_more(carried: nt.Carry, tmp_path: Path) -> None:
    _, _, changed = carried
    nt.assert_needs_nothing_more(FIX, changed, tmp_path)
