"""The native carry on the installed release's own sources: written, verified, git-apply-able,
behaving as the rule says with the runtime fix off, refused for a drifted runner, idempotent."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("libcst")

from vllm_fix_core.backport import Carried
from vllm_fix_sync_load_context import FIX, native
from vllm_fix_testing import native_trees as nt

# One real FULL-replay step and one on the other branch (the probe's steps), asked in a child
# process that imports vLLM from the tree with every runtime fix off: what start_load_kv saw.
SCENARIO = """
import json
import vllm
from vllm_fix_sync_load_context.probe import _dispatches_modes, probe_config, run_step
from vllm_fix_sync_load_context.stand_ins import RecordingLoader, Seen
out = {}
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


@pytest.fixture(scope="module")
def carried(tmp_path_factory: pytest.TempPathFactory) -> nt.Carry:
    """(the release's tree, the carry's result, a copy of the tree with the edits written)."""
    return nt.carried_trees(FIX, tmp_path_factory.mktemp)


def test_carry_is_written_and_changes_only_the_full_branch(
    carried: nt.Carry,
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


def test_the_diff_applies_to_a_clean_copy(carried: nt.Carry, tmp_path: Path) -> None:
    _, result, _ = carried
    nt.assert_git_applies(result.edits, tmp_path)


def test_probe_sees_the_bug_on_the_plain_tree_and_not_on_the_changed_one(
    carried: nt.Carry,
) -> None:
    tree, _, changed = carried
    nt.assert_probe_tells(FIX, tree, changed)  # negative control: the plain tree, runtime fix off


@pytest.mark.native_control
def test_the_full_step_loads_in_its_own_context_on_the_changed_tree(
    carried: nt.Carry,
) -> None:
    tree, result, changed = carried
    if result.result is Carried.REFUSED:  # (0.15 - 0.17: the backport grid checks the reason)
        pytest.skip(f"the carry is refused on this release: {result.reason}")
    plain, fixed = nt.run_in_tree(tree, SCENARIO), nt.run_in_tree(changed, SCENARIO)
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


def test_a_drifted_runner_cannot_be_carried(carried: nt.Carry, tmp_path: Path) -> None:
    """A runner whose other branch no longer opens set_forward_context around pre_forward is
    refused by the runtime fix; the native carry refuses it too, and nothing is written."""
    tree, _, _ = carried

    def drift(text: str) -> str:
        at = text.index("with set_forward_context(", text.index("    def execute_model("))
        assert native.c.function_code(text, native.EXECUTE).count("with set_forward_context(") == 1
        return text[:at] + "with open_step_context(" + text[at + len("with set_forward_context(") :]

    drifted = nt.rewritten(tree, tmp_path / "drifted", native.RUNNER, drift)
    with pytest.raises(native.CannotCarry, match="no longer calls pre_forward inside set_forward_context"):
        native.transform(drifted)
    nt.assert_cannot_carry(FIX, drifted, native.RUNNER, tmp_path / "work")


def test_a_carried_tree_needs_nothing_more(carried: nt.Carry, tmp_path: Path) -> None:
    _, _, changed = carried
    nt.assert_needs_nothing_more(FIX, changed, tmp_path)
