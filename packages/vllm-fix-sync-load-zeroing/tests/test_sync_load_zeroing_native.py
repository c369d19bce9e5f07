"""The native carry on the installed release's own sources: written, verified, git-apply-able,
keeping zeroing off READ destinations with the runtime fix off, refused for other shapes.

vLLM 0.31.0 needs the fix; 0.32.0 and 0.33.0 exclude READ destinations themselves, so there the
tree that needs it is the release's own sources without that exclusion (a fork that did not
take it), and the release itself needs nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("libcst")

from vllm_fix_core.backport import Carried, ask_tree, carry
from vllm_fix_core.native import CannotCarry, SourceTree
from vllm_fix_sync_load_zeroing import FIX, native
from vllm_fix_sync_load_zeroing.declaration import MODULE
from vllm_fix_testing import native_trees as nt
from vllm_fix_testing import vllm_version

# The probe's decision table through the tree's own build_connector_meta, in a child process
# that imports vLLM from the tree with every runtime fix off: what each case zeroes under a
# block-compact layout vLLM accepts for a hybrid model, under a layout whose pages a block-copy
# READ does not rewrite entirely, and with the layout unresolved.
SCENARIO = """
import json
import vllm
from vllm_fix_sync_load_zeroing import probe

mc = probe.require_feature()
found = {}
for layout in ("LBNHC", "LHBNC", None):
    for case in probe.CASES:
        zeroed, reads = probe.observed_zeroing_meta(mc, case, layout)
        found[f"{case.name}/{layout}"] = {"zeroed": zeroed, "reads": len(reads)}
print(json.dumps({"found": found}))
"""
ZERO = [7, 8, 9, 90]
EXCLUDED = {"attn-import": [9, 90], "two-reads": [9, 90]}


def lines_rewritten(tree: SourceTree, dest: Path, change: Callable[[list[str]], list[str]]) -> SourceTree:
    """A copy of `tree` whose connector module's lines are `change(lines)`."""
    return nt.rewritten(tree, dest, MODULE, lambda text: "".join(change(text.splitlines(keepends=True))))


def without_upstream_exclusion(tree: SourceTree, dest: Path) -> SourceTree:
    """The tree without the `if ... new_block_ids_to_zero:` block vLLM 0.32.0 added to
    build_connector_meta (what a fork that did not take it has)."""
    import ast

    method = native.c.ast_of(tree.read(MODULE), native.QUALNAME)
    assert isinstance(method, ast.FunctionDef)
    blocks = [
        s for s in method.body if isinstance(s, ast.If) and "new_block_ids_to_zero" in ast.unparse(s.test)
    ]
    assert len(blocks) == 1 and blocks[0].end_lineno is not None
    first, last = blocks[0].lineno, blocks[0].end_lineno
    return lines_rewritten(tree, dest, lambda lines: lines[: first - 1] + lines[last:])


@pytest.fixture(scope="module")
def carried(tmp_path_factory: pytest.TempPathFactory) -> nt.Carry:
    """(a tree that needs the fix, the carry's result, a copy of it with the edits written)."""
    tree = nt.installed_tree(tmp_path_factory.mktemp("release"))
    if str(vllm_version()) != "0.31.0":
        tree = without_upstream_exclusion(tree, tmp_path_factory.mktemp("fork"))
    return nt.carried_trees(FIX, tmp_path_factory.mktemp, tree)


def test_the_plain_tree_has_the_bug(carried: nt.Carry) -> None:
    tree, _, _ = carried
    assert ask_tree(tree, FIX)["answer"] == "would fix"


def test_the_diff_applies_to_a_clean_copy(carried: nt.Carry, tmp_path: Path) -> None:
    _, result, _ = carried
    nt.assert_git_applies(result.edits, tmp_path)


def test_carry_is_written_and_only_adds_lines(carried: nt.Carry) -> None:
    tree, result, changed = carried
    assert result.result is Carried.WRITTEN, result.reason
    assert [e.path for e in result.edits] == [tree.relpath(MODULE)]
    (edit,) = result.edits
    assert edit.after.count(native.MARK) == 1
    assert "vllm_fix" not in edit.after
    diff = edit.diff().splitlines()
    assert not [ln for ln in diff if ln.startswith("-") and not ln.startswith("---")]
    assert not [ln for ln in diff if ln.startswith("+") and ln != ln.rstrip()]
    added = native.c.module_names(edit.after) - native.c.module_names(edit.before)
    assert added <= {"KVCacheLayout"}
    assert ask_tree(changed, FIX)["answer"] == "fixed upstream"


@pytest.mark.native_control
def test_negative_controls_pass_on_the_changed_tree_and_fail_on_the_plain_one(
    carried: nt.Carry,
) -> None:
    tree, _, changed = carried
    plain, fixed = (nt.run_in_tree(t, SCENARIO)["found"] for t in (tree, changed))
    # Unchanged tree: the READ destinations 7 and 8 are zeroed in the READ's own step (the bug).
    assert plain["attn-import/LBNHC"]["zeroed"] == ZERO
    assert all(v["zeroed"] == ZERO for v in plain.values())
    # Changed tree, runtime fix off: under a block-compact layout exactly the aligned attention
    # destinations skip zeroing, never the tail (9) or Mamba state (90), and only for a hybrid
    # READ consumer; elsewhere, and with the layout unresolved, everything is still zeroed.
    for key, value in fixed.items():
        name, layout = key.split("/")
        want = EXCLUDED.get(name, ZERO) if layout == "LBNHC" else ZERO
        assert value["zeroed"] == want, key
        assert value["reads"] == plain[key]["reads"], key  # the READs still reach the metadata


def test_other_shapes_cannot_be_carried(carried: nt.Carry, tmp_path: Path) -> None:
    """A build_connector_meta of another signature is refused by the runtime fix (the probe,
    calling it positionally, still sees the bug); the native carry refuses it too, and
    writes nothing."""
    tree, _, _ = carried
    method = native.c.ast_of(tree.read(MODULE), native.QUALNAME)
    signature = method.lineno + 1  # "        scheduler_output: SchedulerOutput," follows "self,"

    def drift(lines: list[str]) -> list[str]:
        assert lines[signature].strip() == "scheduler_output: SchedulerOutput,", lines[signature]
        return [*lines[: signature + 1], "        trace: bool = False,\n", *lines[signature + 1 :]]

    drifted = lines_rewritten(tree, tmp_path / "drifted", drift)
    reason = "unexpected signature build_connector_meta('self', 'scheduler_output', 'trace')"
    nt.assert_cannot_carry(FIX, drifted, MODULE, tmp_path / "work", reason)


def test_the_release_itself(carried: nt.Carry, tmp_path: Path) -> None:
    """0.32.0 and 0.33.0 need nothing, and their exclusion is not written twice."""
    if str(vllm_version()) == "0.31.0":
        pytest.skip("vLLM 0.31.0 is the release that needs the fix (the tests above)")
    release = nt.installed_tree(tmp_path / "release")
    result = carry(FIX, release, tmp_path / "work")
    assert result.result is Carried.CARRIES_IT, result.reason
    with pytest.raises(CannotCarry, match="already changes new_block_ids_to_zero"):
        native.transform(release)


def test_a_carried_tree_needs_nothing_more(carried: nt.Carry, tmp_path: Path) -> None:
    _, _, changed = carried
    nt.assert_needs_nothing_more(FIX, changed, tmp_path)
    with pytest.raises(CannotCarry, match="already changes new_block_ids_to_zero"):
        native.transform(changed)
