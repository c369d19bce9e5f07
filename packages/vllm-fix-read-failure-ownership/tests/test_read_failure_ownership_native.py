"""The native carry on the installed release's own sources: written, verified, git-apply-able,
failing hybrid READs closed with the runtime fix off, refused for a drifted body, idempotent."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("libcst")

from vllm_fix_core import ast_fingerprint, original_of
from vllm_fix_core.backport import Carried, ask_tree
from vllm_fix_core.fingerprint import node_fingerprint
from vllm_fix_read_failure_ownership import FIX, native, patch
from vllm_fix_read_failure_ownership.declaration import MODULE
from vllm_fix_testing import native_trees as nt

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
print(json.dumps({"outcomes": found}))
"""


@pytest.fixture(scope="module")
def carried(tmp_path_factory: pytest.TempPathFactory) -> nt.Carry:
    """(the release's tree, the carry's result, a copy of the tree with the edits written)."""
    return nt.carried_trees(FIX, tmp_path_factory.mktemp)


def test_the_tree_is_recognised_as_the_runtime_recognises_it(
    carried: nt.Carry,
) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector as mc

    tree, _, _ = carried
    installed = ast_fingerprint(original_of(mc.MoRIIOConnectorWorker, native.TARGET))
    assert node_fingerprint(native.c.ast_of(tree.read(MODULE), native.QUALNAME)) == installed
    assert native.recognize(tree) == patch.recognize()


def test_the_plain_tree_has_the_bug(carried: nt.Carry) -> None:
    tree, _, _ = carried
    assert ask_tree(tree, FIX)["answer"] == "would fix"


def test_the_diff_applies_to_a_clean_copy(carried: nt.Carry, tmp_path: Path) -> None:
    _, result, _ = carried
    nt.assert_git_applies(result.edits, tmp_path)


def test_carry_is_written_and_only_adds_lines_to_the_method(
    carried: nt.Carry,
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


@pytest.mark.native_control
def test_negative_controls_pass_on_the_changed_tree_and_fail_on_the_plain_one(
    carried: nt.Carry,
) -> None:
    tree, _, changed = carried
    plain, fixed = (nt.run_in_tree(t, SCENARIO)["outcomes"] for t in (tree, changed))
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


def test_a_drifted_body_cannot_be_carried(carried: nt.Carry, tmp_path: Path) -> None:
    """The runtime fix changes only an exactly fingerprinted body; so does the native carry
    (here a body that no longer reports the blocks of a timed-out READ: the probe still sees
    the bug)."""
    tree, _, _ = carried
    text = tree.read(MODULE)
    method = native.c.function_code(text, native.QUALNAME)
    old = "                        self._record_failed_recv(req_id)\n                        to_remove"
    assert text.count(old) == 1 and "_record_failed_recv" in method
    drifted = nt.replaced(tree, tmp_path / "drifted", MODULE, old, "                        to_remove")
    reasons = ("normalized-AST fingerprint", "not one of the known shapes")
    nt.assert_cannot_carry(FIX, drifted, MODULE, tmp_path / "work", *reasons)
    assert drifted.read(MODULE) == text.replace(old, "                        to_remove")


def test_a_tree_without_transfer_error_cannot_be_carried(carried: nt.Carry, tmp_path: Path) -> None:
    tree, _, _ = carried
    drifted = nt.replaced(tree, tmp_path / "no-error", MODULE, "    TransferError,\n", "")
    with pytest.raises(native.CannotCarry, match="no module-level TransferError"):
        native.transform(drifted)


def test_a_carried_tree_needs_nothing_more(carried: nt.Carry, tmp_path: Path) -> None:
    _, _, changed = carried
    nt.assert_needs_nothing_more(FIX, changed, tmp_path)
