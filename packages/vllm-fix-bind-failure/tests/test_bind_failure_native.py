"""The native carry on the installed release's own sources: written, verified by the probe in a
child with the runtime fixes off, git-apply-able, behaving as the rule says, refused for a
drifted listener, and not needed a second time."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("libcst")

from vllm_fix_bind_failure import FIX, native
from vllm_fix_bind_failure.declaration import CONNECTOR, ENGINE
from vllm_fix_core.backport import Carried
from vllm_fix_testing import native_trees as nt

# The notify listener of a MoRIIOWrapper on a port another listener holds.
NOTIFY_ON_A_TAKEN_PORT = """
import json, socket
from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_engine as engine
held = socket.socket()
held.bind(("0.0.0.0", 0))
held.listen(1)
port = held.getsockname()[1]
wrapper = engine.MoRIIOWrapper.__new__(engine.MoRIIOWrapper)
wrapper.notify_port = port
wrapper.notify_thread = None
try:
    wrapper.async_wait_reqid()
    error = ""
except RuntimeError as exc:
    error = str(exc)
if wrapper.notify_thread is not None:
    wrapper.notify_thread.join(5)
print(json.dumps({"port": port, "error": error, "alive": wrapper.notify_thread.is_alive()}))
"""


@pytest.fixture(scope="module")
def carried(tmp_path_factory: pytest.TempPathFactory) -> nt.Carry:
    """(the release's tree, the carry's result, a copy of the tree with the edits written)."""
    return nt.carried_trees(FIX, tmp_path_factory.mktemp)


def test_carry_is_written_and_touches_only_the_bug_s_functions(
    carried: nt.Carry,
) -> None:
    tree, result, _ = carried
    assert result.result is Carried.WRITTEN, result.reason
    edits = {e.path: e for e in result.edits}
    assert set(edits) == {tree.relpath(CONNECTOR), tree.relpath(ENGINE)}
    connector, engine = edits[tree.relpath(CONNECTOR)], edits[tree.relpath(ENGINE)]
    for qualname, mark in ((native.LISTENER, native.MARK_LISTENER), (native.REGISTER, native.MARK_REGISTER)):
        assert connector.after.count(mark) == 1
        assert mark in native.c.function_code(connector.after, qualname)
    assert connector.after.count(native.MARK_READY) == 1
    assert engine.after.count(native.MARK_NOTIFY) == 1
    assert native.MARK_NOTIFY in native.c.function_code(engine.after, native.NOTIFY)
    for edit in (connector, engine):
        assert "vllm_fix" not in edit.after
    # The one line removed outside the re-indented listener blocks: the plain ready event.
    removed = [ln[1:].strip() for ln in connector.diff().splitlines() if ln.startswith("-") and "Event" in ln]
    assert removed == ["ready_event = threading.Event()"]


def test_the_diff_applies_to_a_clean_copy(carried: nt.Carry, tmp_path: Path) -> None:
    _, result, _ = carried
    nt.assert_git_applies(result.edits, tmp_path)


def test_the_probe_sees_the_bug_on_the_plain_tree_and_not_on_the_changed_one(
    carried: nt.Carry,
) -> None:
    tree, _, changed = carried
    checks = ("start-up-waits-on-dead-handshake-listener", "notify-bind-failure-unseen")
    nt.assert_probe_tells(FIX, tree, changed, *checks)  # negative control: the plain tree


@pytest.mark.native_control
def test_a_taken_notify_port_fails_with_the_port_and_the_setting(
    carried: nt.Carry,
) -> None:
    tree, _, changed = carried
    plain = nt.run_in_tree(tree, NOTIFY_ON_A_TAKEN_PORT)
    assert plain["error"] == "" and not plain["alive"]  # returned; its listener died unseen
    fixed = nt.run_in_tree(changed, NOTIFY_ON_A_TAKEN_PORT)
    assert str(fixed["port"]) in fixed["error"]
    assert "Address already in use" in fixed["error"] and "notify_port" in fixed["error"]


def test_a_drifted_listener_cannot_be_carried(carried: nt.Carry, tmp_path: Path) -> None:
    """The runtime fix refuses a handshake listener that is no longer a staticmethod of
    (metadata, ready_event, base_port, ...); so does the native carry, and nothing is written."""
    tree, _, _ = carried
    old = "        ready_event: threading.Event,\n        base_port: int,"
    new = "        ready: threading.Event,\n        base_port: int,"
    drifted = nt.replaced(tree, tmp_path / "drifted", CONNECTOR, old, new)
    reason = "is not (metadata, ready_event, base_port, ...)"
    nt.assert_cannot_carry(FIX, drifted, CONNECTOR, tmp_path / "work", reason)


def test_a_carried_tree_needs_nothing_more(carried: nt.Carry, tmp_path: Path) -> None:
    _, _, changed = carried
    nt.assert_needs_nothing_more(FIX, changed, tmp_path)
