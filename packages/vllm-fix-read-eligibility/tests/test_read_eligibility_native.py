"""The native carry on the installed release's own sources: written, verified, git-apply-able,
behaving as the rule says with the runtime fix off, refused for a drifted body, idempotent."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("libcst")

from vllm_fix_core.backport import Carried
from vllm_fix_read_eligibility import FIX, native
from vllm_fix_read_eligibility.declaration import MODULE
from vllm_fix_testing import native_trees as nt

# The negative controls of test_read_eligibility_scenarios.py, asked in a child process that
# imports vLLM from the tree with every runtime fix off.
SCENARIO = """
import json
from vllm_fix_read_eligibility.probe import PLAIN, PROMPT, consumer, malformed, matched, request
from vllm_fix_read_eligibility.probe import row_id, well_formed
from vllm_fix_read_eligibility.releases import block_layout
import vllm
layout = block_layout()
bad = {k: matched(consumer(), p, rid=row_id(k)) for k, p in malformed(layout).items()}
good = matched(consumer(), well_formed(layout))
req = request(malformed(layout)["empty-groups"], rid="req-malformed-7")
first = consumer().get_num_new_matched_tokens(req, 0)
# vLLM's own scheduler tests pass requests without a request_id (a namespace of the fields read)
import types
bare = types.SimpleNamespace(num_prompt_tokens=PROMPT, prompt_token_ids=None, prompt_embeds=object(),
                             kv_transfer_params={"do_remote_prefill": True})
try:
    bare_answer = list(consumer().get_num_new_matched_tokens(bare, 0))
except AttributeError as exc:  # a release whose own body reads another field
    bare_answer = repr(exc)
print(json.dumps({"bad": bad, "good": good, "first": list(first),
                  "flag": req.kv_transfer_params["do_remote_prefill"], "prompt": PROMPT,
                  "bare": bare_answer}))
"""


@pytest.fixture(scope="module")
def carried(tmp_path_factory: pytest.TempPathFactory) -> nt.Carry:
    """(the release's tree, the carry's result, a copy of the tree with the edits written)."""
    return nt.carried_trees(FIX, tmp_path_factory.mktemp)


def test_carry_is_written_and_touches_only_the_claim(carried: nt.Carry) -> None:
    tree, result, _ = carried
    assert result.result is Carried.WRITTEN, result.reason
    assert [e.path for e in result.edits] == [tree.relpath(MODULE)]
    (edit,) = result.edits
    assert edit.after.count(native.MARK_GUARD) == 1  # the changed method
    assert edit.after.count(native.MARK_HELPERS) == 1  # the helpers added next to it
    assert "vllm_fix" not in edit.after  # a fork carries no dependency on us
    removed = [ln for ln in edit.diff().splitlines() if ln.startswith("-") and not ln.startswith("---")]
    assert removed == []  # only additions: the guard and the helpers
    assert native.MARK_GUARD in native.c.function_code(edit.after, native.QUALNAME)
    added = native.c.module_names(edit.after) - native.c.module_names(edit.before)
    assert added == {"_read_blocks_needed", "_read_block_ids_refusal", "_read_route_refusal", native.HELPER}


def test_the_diff_applies_to_a_clean_copy(carried: nt.Carry, tmp_path: Path) -> None:
    _, result, _ = carried
    nt.assert_git_applies(result.edits, tmp_path)


@pytest.mark.native_control
def test_negative_controls_pass_on_the_changed_tree_and_fail_on_the_plain_one(
    carried: nt.Carry,
) -> None:
    tree, _, changed = carried
    plain, fixed = nt.run_in_tree(tree, SCENARIO), nt.run_in_tree(changed, SCENARIO)
    prompt = plain["prompt"]
    # Unchanged tree: every malformed row claims N-1 (the bug), as the scenarios test asserts.
    assert set(map(tuple, plain["bad"].values())) == {(prompt - 1, False)}
    # Changed tree, runtime fix off: no malformed row claims, a real remote prefill still does,
    # and the refused request's flag is cleared so nothing is queued from it.
    assert {k: tuple(v) for k, v in fixed["bad"].items()} == {k: (0, False) for k in plain["bad"]}
    assert tuple(fixed["good"]) == tuple(plain["good"]) == (prompt - 1, False)
    assert fixed["first"] == [0, False] and fixed["flag"] is False
    assert plain["first"] == [prompt - 1, False] and plain["flag"] is True
    # A request without a request_id (vLLM's own tests build them) is refused, not raised on
    # (the plain tree's answer for it differs by release: N-1 on 0.33, -1 on 0.29).
    assert fixed["bare"] == [0, False]


def test_a_drifted_body_cannot_be_carried(carried: nt.Carry, tmp_path: Path) -> None:
    """The runtime fix refuses a body that no longer decides by is_producer / mode; so does
    the native carry, and nothing is written."""
    tree, _, _ = carried

    def drift(text: str) -> str:
        start = text.index(
            "    def get_num_new_matched_tokens(", text.index("class MoRIIOConnectorScheduler")
        )
        at = text.index("if self.is_producer:", start)
        return text[:at] + 'if getattr(self, "is_producer"):' + text[at + len("if self.is_producer:") :]

    drifted = nt.rewritten(tree, tmp_path / "drifted", MODULE, drift)
    assert "self.is_producer" not in native.c.function_code(drifted.read(MODULE), native.QUALNAME)
    nt.assert_cannot_carry(FIX, drifted, MODULE, tmp_path / "work", "no longer decides by self.is_producer")


def test_a_carried_tree_needs_nothing_more(carried: nt.Carry, tmp_path: Path) -> None:
    _, _, changed = carried
    nt.assert_needs_nothing_more(FIX, changed, tmp_path)
