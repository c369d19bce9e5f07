"""The native carry on the installed release's own sources: written, verified, git-apply-able,
behaving as the rule says with the runtime fix off, refused for a drifted body, idempotent."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("libcst")

from vllm_fix_core.backport import Carried
from vllm_fix_k3_eof_flush import FIX, native
from vllm_fix_k3_eof_flush.patch import K3_MODULE
from vllm_fix_testing import native_trees as nt

# The README's failing scenarios (what test_k3_eof_flush_vllm.py streams unpatched), through
# the real KimiK3Parser in a child process that imports vLLM from the tree, runtime fixes off.
SCENARIO = """
import json
import vllm
from vllm_fix_k3_eof_flush.probe import MARKERS, REASONING, SEQUENCE, streamed
print(json.dumps({
    "plain": streamed(SEQUENCE),
    "tools": streamed(SEQUENCE, with_tools=True),
    "think": streamed(REASONING),
    "markers": streamed(MARKERS),
    "held": streamed(SEQUENCE, finished=False),
}))
"""


@pytest.fixture(scope="module")
def carried(tmp_path_factory: pytest.TempPathFactory) -> nt.Carry:
    """(the release's tree, the carry's result, a copy of the tree with the edits written)."""
    return nt.carried_trees(FIX, tmp_path_factory.mktemp)


def test_the_diff_applies_to_a_clean_copy(carried: nt.Carry, tmp_path: Path) -> None:
    _, result, _ = carried
    nt.assert_git_applies(result.edits, tmp_path)


def test_carry_is_written_and_touches_only_parse_delta(
    carried: nt.Carry,
) -> None:
    tree, result, _ = carried
    assert result.result is Carried.WRITTEN, result.reason
    assert [e.path for e in result.edits] == [tree.relpath(K3_MODULE)]
    (edit,) = result.edits
    assert edit.after.count(native.MARK_METHOD) == 1
    assert edit.after.count(native.MARK_HELPERS) == 1
    assert "vllm_fix" not in edit.after
    # vLLM's body is kept, byte for byte, under the private name; the rest only gains lines.
    removed = [ln[1:] for ln in edit.diff().splitlines() if ln.startswith("-") and not ln.startswith("---")]
    assert [ln.strip() for ln in removed] == ["from typing import TYPE_CHECKING", "def parse_delta("]
    assert edit.after.count("\nimport logging\n") == 1
    assert native.HOLDING in native.c.module_names(edit.after) or f"def {native.HOLDING}(" in edit.after
    added = native.c.module_names(edit.after) - native.c.module_names(edit.before)
    assert added == {"_k3_held_tail", "_release_held_tail", "Any", "logging"}


@pytest.mark.native_control
def test_negative_controls_pass_on_the_changed_tree_and_fail_on_the_plain_one(
    carried: nt.Carry,
) -> None:
    tree, _, changed = carried
    plain, fixed = nt.run_in_tree(tree, SCENARIO), nt.run_in_tree(changed, SCENARIO)
    # Unchanged tree: the held-back "<" is lost at the end of the stream (the bug).
    assert plain["plain"] == ["Plan.", "List"] and plain["tools"][1] == "List"
    assert plain["think"][0] == "Compare x "
    # Changed tree, runtime fix off: released once, in its channel; no marker leaks, and
    # nothing is released before the end.
    assert fixed["plain"] == ["Plan.", "List<"]
    assert fixed["tools"][1] == "List<"
    assert fixed["think"][0] == "Compare x <"
    assert fixed["markers"] == plain["markers"] == ["Plan.", "Hi"]
    assert fixed["held"] == plain["held"] == ["Plan.", "List"]


# The runtime fix's "never harm the stream" path, on the changed tree: a tail that cannot be
# computed is not released, the stream ends as vLLM made it, and the failure is logged.
BROKEN = """
import json, logging
import vllm.parser.kimi_k3 as k3
from vllm_fix_k3_eof_flush.probe import SEQUENCE, streamed

def broken(*args, **kwargs):
    raise RuntimeError("a readiness helper failed")

k3._k3_held_tail = broken
seen = []
class Seen(logging.Handler):
    def emit(self, record):
        seen.append(record.getMessage())
logging.getLogger("vllm.parser.kimi_k3").addHandler(Seen())
print(json.dumps({"plain": streamed(SEQUENCE), "logged": seen}))
"""


def test_a_tail_that_cannot_be_computed_leaves_the_final_delta_as_vllm_made_it(carried: nt.Carry) -> None:
    _, _, changed = carried
    out = nt.run_in_tree(changed, BROKEN)
    assert out["plain"] == ["Plan.", "List"]  # vLLM's own final delta, no exception to the client
    assert out["logged"] == ["held-back tail not released"]


def test_a_drifted_body_cannot_be_carried(carried: nt.Carry, tmp_path: Path) -> None:
    """The runtime fix refuses a parse_delta whose `finished` is no longer keyword-only (the
    probe, passing it by keyword, still runs and sees the bug); so does the native carry."""
    tree, _, _ = carried
    old = "        prompt_token_ids: list[int] | None = None,\n        *,\n        finished: bool,\n"
    new = "        prompt_token_ids: list[int] | None = None,\n        finished: bool = False,\n"
    drifted = nt.replaced(tree, tmp_path / "drifted", K3_MODULE, old, new)
    reason = "unexpected signature KimiK3Parser.parse_delta"
    nt.assert_cannot_carry(FIX, drifted, K3_MODULE, tmp_path / "work", reason)


def test_a_carried_tree_needs_nothing_more(carried: nt.Carry, tmp_path: Path) -> None:
    _, _, changed = carried
    nt.assert_needs_nothing_more(FIX, changed, tmp_path)
