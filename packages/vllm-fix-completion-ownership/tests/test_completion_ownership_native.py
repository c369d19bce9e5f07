"""The native carry on the installed release's own sources: written, verified, git-apply-able,
behaving as the rule says with the runtime fix off, refused for a drifted body, idempotent."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("libcst")

from vllm_fix_completion_ownership import FIX, native
from vllm_fix_completion_ownership.declaration import MODULE
from vllm_fix_core.backport import Carried
from vllm_fix_testing import native_trees as nt

# The probe's checks (each symptom and guard), asked in a child process that imports vLLM from
# the tree with every runtime fix off.
SCENARIO = """
import json
import vllm
from vllm_fix_completion_ownership.probe import probe
report = probe()
print(json.dumps({"checks": {c.name: c.affected for c in report.checks}}))
"""


@pytest.fixture(scope="module")
def carried(tmp_path_factory: pytest.TempPathFactory) -> nt.Carry:
    """(the release's tree, the carry's result, a copy of the tree with the edits written)."""
    return nt.carried_trees(FIX, tmp_path_factory.mktemp)


def test_carry_is_written_and_changes_only_the_multiconnector(
    carried: nt.Carry,
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


def test_the_diff_applies_to_a_clean_copy(carried: nt.Carry, tmp_path: Path) -> None:
    _, result, _ = carried
    nt.assert_git_applies(result.edits, tmp_path)


@pytest.mark.native_control
def test_probe_sees_the_bug_on_the_plain_tree_and_not_on_the_changed_one(
    carried: nt.Carry,
) -> None:
    tree, _, changed = carried
    nt.assert_probe_tells(FIX, tree, changed)  # negative control: the plain tree, runtime fix off
    plain, fixed = nt.run_in_tree(tree, SCENARIO)["checks"], nt.run_in_tree(changed, SCENARIO)["checks"]
    symptoms = ["swallowed-completion", "early-completion", "stray-completion", "stray-recving"]
    if "def register_finished_partial_tail(" in tree.read(MODULE):  # vLLM 0.30.0+
        symptoms.append("partial-tail-owner-ignored")
    # Unchanged tree: every symptom of the bug (D1, D2, stray reports, D4) is seen.
    assert {name: plain[name] for name in symptoms} == dict.fromkeys(symptoms, True)
    # Changed tree, runtime fix off: none is, and every guard holds.
    assert not any(fixed.values()), fixed


def test_a_drifted_body_cannot_be_carried(carried: nt.Carry, tmp_path: Path) -> None:
    """update_connector_output's body is rewritten, so the runtime fix accepts only its known
    fingerprint; a changed body is refused by the native carry too, and nothing is written."""
    tree, _, _ = carried

    def drift(text: str) -> str:
        start = text.index("    def update_connector_output(", text.index("class MultiConnector("))
        needle = "c.update_connector_output(connector_output)"
        at = text.index(needle, start)
        return text[:at] + needle + " or None" + text[at + len(needle) :]

    drifted = nt.rewritten(tree, tmp_path / "drifted", MODULE, drift)
    with pytest.raises(native.CannotCarry, match="update_connector_output changed"):
        native.transform(drifted)
    nt.assert_cannot_carry(FIX, drifted, MODULE, tmp_path / "work")


def test_a_carried_tree_needs_nothing_more(carried: nt.Carry, tmp_path: Path) -> None:
    _, _, changed = carried
    nt.assert_needs_nothing_more(FIX, changed, tmp_path)
