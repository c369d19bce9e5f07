"""The native carry on the installed release's own sources: written, verified, git-apply-able,
observed part by part by the probe with the runtime fix off, refused for a drifted runner and
for the execute_model shape (0.15 - 0.21), idempotent; the helper it writes decides which
connectors wait exactly as the runtime rule does."""

from __future__ import annotations

import ast
import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("libcst")

from vllm_fix_core.backport import Carried, ask_tree
from vllm_fix_spec_kv_readiness import FIX, native, patch, probe, readiness
from vllm_fix_spec_kv_readiness.declaration import ASYNC_UTILS, KV_CONNECTOR, MODEL_RUNNER
from vllm_fix_testing import native_trees as nt

# The probe's own checks (guards included), run in a child that imports vLLM from the tree with
# every runtime fix off: {check: affected}, or {"raised": ...} when the step cannot run.
SCENARIO = """
import json
import vllm
from vllm_fix_spec_kv_readiness import probe

try:
    found = {c.name: c.affected for c in probe.probe().checks}
except Exception as exc:
    found = {"raised": f"{type(exc).__name__}: {exc}"}
print(json.dumps(found))
"""
SYMPTOMS = ("kv-output-misses-step-saves", "output-visible-before-draft-kv")
GUARDS = (
    "transfer-results-drained-once",
    "non-read-connector-keeps-overlap",
    "non-speculative-step-unchanged",
)
REFUSED_SHAPE = "execute_model collects the step's KV connector output"
TESTS = Path(__file__).resolve().parent

# The helper written into the tree and the runtime rule, asked of the connectors the rule's own
# tests build (test_spec_kv_readiness_rules.PUBLISHERS) and of the explicit opt-in either way:
# {case: [helper, rule, expected]} for the connectors this release has.
ANSWERS = f"""
import json
import sys

import pytest
import vllm
from vllm.v1.worker.gpu.model_runner import {native.HELPER} as written
from vllm_fix_spec_kv_readiness.readiness import publishes_for_remote_read as rule

sys.path.insert(0, {str(TESTS)!r})
import test_spec_kv_readiness_rules as rules


def opted(flag):
    connector = rules.example("kv_consumer")
    connector.{readiness.OPT_IN_ATTRIBUTE} = flag
    return connector


cases = [
    *rules.PUBLISHERS,
    ("explicit-opt-in", lambda: opted(True), True),
    ("explicit-opt-out", lambda: opted(False), False),
]
found = {{}}
for name, make, expected in cases:
    try:
        connector = make()
    except pytest.skip.Exception:  # a connector this release does not have
        continue
    found[name] = [written(connector), rule(connector), expected]
print(json.dumps(found))
"""

# One speculative step through the tree's sample_tokens (the probe's run_step) with a connector
# that presents itself as a MoRIIO producer does, without requires_full_step_completion: in
# READ mode and in WRITE mode. {mode: {waited: [events get_output waited on], after_draft:
# whether one of them was recorded after the draft's last kernel}}.
MORIIO_STEP = """
import json
from types import SimpleNamespace

import vllm
from vllm_fix_spec_kv_readiness import probe, stand_ins


class MoRIIOConnector(stand_ins.Connector):
    def __init__(self, step, *, read_publisher):
        super().__init__(step, read_publisher=read_publisher)
        del self.requires_full_step_completion
        self._kv_transfer_config = SimpleNamespace(is_kv_producer=True, kv_role="kv_producer")
        self.mode = SimpleNamespace(name="READ" if read_publisher else "WRITE")


probe.Connector = MoRIIOConnector
found = {}
for mode, read in (("READ", True), ("WRITE", False)):
    outcome = probe.run_step(speculative=True, read_publisher=read)
    assert outcome.drafted
    last = outcome.step.at(stand_ins.DRAFT_DONE)
    found[mode] = {
        "waited": sorted(e.name for e in outcome.step.synced),
        "after_draft": any(e.recorded_at > last for e in outcome.step.synced),
    }
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def carried(tmp_path_factory: pytest.TempPathFactory) -> nt.Carry:
    """(the release's tree, the carry's result, a copy of the tree with the edits written)."""
    return nt.carried_trees(FIX, tmp_path_factory.mktemp)


@pytest.fixture(scope="module")
def shape(carried: nt.Carry) -> str:
    return patch.recognize()


@pytest.fixture
def written(carried: nt.Carry, shape: str) -> nt.Carry:
    """The carry, where this release's shape is one the transformation writes."""
    if shape.startswith(patch.IN_EXECUTE):
        pytest.skip(
            "the execute_model shape (0.15 - 0.21) is refused: see test_the_execute_model_shape_is_refused"
        )
    return carried


def _added_lines(before: str, after: str) -> list[int]:
    old = set(before.splitlines())
    return [i + 1 for i, line in enumerate(after.splitlines()) if line not in old]


def _span(source: str, qualname: str) -> tuple[int, int]:
    node = native.c.ast_of(source, qualname)
    assert node.end_lineno is not None
    # A decorated def starts at its first decorator.
    start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    return start, node.end_lineno


def test_the_tree_is_recognised_as_the_runtime_recognises_it(carried: nt.Carry, shape: str) -> None:
    tree, _, _ = carried
    if shape.startswith(patch.IN_EXECUTE):
        with pytest.raises(native.CannotCarry, match=REFUSED_SHAPE):
            native.recognize(tree)
    else:
        assert native.recognize(tree) == shape


def test_the_plain_tree_has_the_bug(carried: nt.Carry) -> None:
    tree, _, _ = carried
    assert ask_tree(tree, FIX)["answer"] == "would fix"


def test_the_diff_applies_to_a_clean_copy(written: nt.Carry, tmp_path: Path) -> None:
    _, result, _ = written
    nt.assert_git_applies(result.edits, tmp_path)


def test_carry_is_written_and_touches_only_the_functions(written: nt.Carry, shape: str) -> None:
    tree, result, changed = written
    assert result.result is Carried.WRITTEN, result.reason
    deferred = shape.startswith(patch.DEFERRED)
    modules = [MODEL_RUNNER, ASYNC_UTILS, *([KV_CONNECTOR] if deferred else [])]
    assert [e.path for e in result.edits] == [tree.relpath(m) for m in modules]
    edits = {e.path: e for e in result.edits}
    # Where the added lines may lie (the AsyncOutput class holds its new attribute and get_output).
    spans = {
        MODEL_RUNNER: [native.SAMPLE_TOKENS, native.HELPER],
        ASYNC_UTILS: ["AsyncOutput"],
        KV_CONNECTOR: [native.POST_FORWARD],
    }
    markers = {MODEL_RUNNER: 2, ASYNC_UTILS: 2, KV_CONNECTOR: 1}
    for module in modules:
        edit = edits[tree.relpath(module)]
        assert "vllm_fix" not in edit.after  # the tree never imports this project
        assert (
            edit.after.count("# vllm-fixes spec-kv-readiness (vllm-project/vllm#60637): ") == markers[module]
        )
        added = _added_lines(edit.before, edit.after)
        # A span starts at its def, or at the marker comment right above a written helper.
        within = [(a - 1, b) for a, b in (_span(edit.after, q) for q in spans[module])]
        assert added and all(any(a <= n <= b for a, b in within) for n in added), (module, added, within)
        removed = [
            ln[1:] for ln in edit.diff().splitlines() if ln.startswith("-") and not ln.startswith("---")
        ]
        # Only the 0.33 runner loses a line: finalize_step() after the drafter becomes the full collection.
        assert removed == (
            ["            self.kv_connector.finalize_step()"] if deferred and module == MODEL_RUNNER else []
        )
        ast.parse(edit.after)
    assert ask_tree(changed, FIX)["answer"] == "fixed upstream"


@pytest.mark.native_control
def test_negative_controls_pass_on_the_changed_tree_and_fail_on_the_plain_one(
    written: nt.Carry, shape: str
) -> None:
    """The probe's checks, asked of the plain and the changed tree with the runtime fix off: the
    plain tree shows the bug (both symptoms where the output is collected before the draft,
    readiness alone where it is collected after it), the changed tree none, guards kept."""
    tree, _, changed = written
    plain, fixed = (nt.run_in_tree(t, SCENARIO) for t in (tree, changed))
    expected = {
        "kv-output-misses-step-saves": shape.startswith(patch.DEFERRED),
        "output-visible-before-draft-kv": True,
    }
    assert plain == {**expected, **{g: False for g in GUARDS}}, plain
    assert fixed == {name: False for name in (*SYMPTOMS, *GUARDS)}, fixed


def test_the_written_helper_decides_as_the_runtime_rule(written: nt.Carry) -> None:
    """On the changed tree, with the runtime fixes off, the helper sample_tokens asks answers
    every connector of the rule's tests as readiness.publishes_for_remote_read does: NIXL pull
    and MoRIIO READ producers (and a MultiConnector holding one) publish for a remote READ
    without requires_full_step_completion; that attribute, where set, decides."""
    tree, result, changed = written
    (edit,) = [e for e in result.edits if e.path == tree.relpath(MODEL_RUNNER)]
    assert native.helper_code().strip() in edit.after
    found = nt.run_in_tree(changed, ANSWERS)
    assert {"moriio-read-producer", "multi-with-moriio-read", "explicit-opt-in"} <= set(found), found
    assert all(helper is rule is expected for helper, rule, expected in found.values()), found


@pytest.mark.native_control
def test_a_moriio_read_producer_waits_without_the_opt_in(written: nt.Carry) -> None:
    """A step whose connector is a MoRIIO producer in READ mode (no requires_full_step_completion)
    waits for the draft's KV on the changed tree and does not on the plain one; in WRITE mode
    it keeps the overlap (only the output copy is waited on) on both."""
    tree, _, changed = written
    plain, fixed = (nt.run_in_tree(t, MORIIO_STEP) for t in (tree, changed))
    overlap = {"waited": ["copy"], "after_draft": False}
    assert plain == {"READ": overlap, "WRITE": overlap}, plain
    assert fixed == {"READ": {"waited": ["copy", "step-done"], "after_draft": True}, "WRITE": overlap}, fixed


def _drop(text: str, lines: str) -> str:
    assert text.count(lines) == 1, lines
    return text.replace(lines, "")


def _undo_collection(text: str) -> str:
    """The 0.33 runner's collection after the drafter back to vLLM's finalize_step() call."""
    start = text.index(native.MARK_COLLECT)
    start = text.rindex("\n", 0, start) + 1
    end = text.index(")\n", start) + 2
    return text[:start] + "            self.kv_connector.finalize_step()\n" + text[end:]


# One part of the change undone at a time: (module, undo, what the probe must then see).
PARTS: dict[str, tuple[str, Any, str]] = {
    "the event is recorded after the draft": (
        MODEL_RUNNER,
        lambda t: _drop(t, "            draft_kv_event.record()\n"),
        "output-visible-before-draft-kv",
    ),
    "the event is handed to the AsyncOutput": (
        MODEL_RUNNER,
        lambda t: _drop(t, "            async_output.draft_kv_event = draft_kv_event\n"),
        "output-visible-before-draft-kv",
    ),
    "get_output waits on it": (
        ASYNC_UTILS,
        lambda t: _drop(
            t, "        if self.draft_kv_event is not None:\n            self.draft_kv_event.synchronize()\n"
        ),
        "output-visible-before-draft-kv",
    ),
    "AsyncOutput declares it": (
        ASYNC_UTILS,
        lambda t: _drop(t, "    draft_kv_event: torch.cuda.Event | None = None\n"),
        "raised",
    ),
    "the deferred post_forward only starts loads": (
        KV_CONNECTOR,
        lambda t: _drop(t, "        if defer_finalize:\n            return None\n"),
        "kv-output-misses-step-saves",
    ),
    "the output is collected after the drafter": (
        MODEL_RUNNER,
        _undo_collection,
        "kv-output-misses-step-saves",
    ),
}
DEFERRED_ONLY = ("the deferred post_forward only starts loads", "the output is collected after the drafter")


@pytest.mark.native_control
@pytest.mark.parametrize("part", sorted(PARTS))
def test_undoing_any_one_part_brings_the_bug_back(
    written: nt.Carry, shape: str, part: str, tmp_path: Path
) -> None:
    _, _, changed = written
    if part in DEFERRED_ONLY and not shape.startswith(patch.DEFERRED):
        pytest.skip("that part is written only where post_forward defers its drain (0.33)")
    module, undo, symptom = PARTS[part]
    undone = nt.rewritten(changed, tmp_path / "undone", module, undo)
    found = nt.run_in_tree(undone, SCENARIO)
    if symptom == "raised":  # get_output reads an attribute vLLM's AsyncOutput does not have
        assert "AttributeError" in found.get("raised", ""), found
    else:
        assert found[symptom], found
    assert ask_tree(undone, FIX)["answer"] != "fixed upstream"


def test_a_drifted_runner_cannot_be_carried(written: nt.Carry, shape: str, tmp_path: Path) -> None:
    """A runner the runtime fix does not recognise (0.33: no finalize_step() after the drafter;
    earlier: a post_forward that no longer clears the connector metadata) still has the bug, and
    the native carry refuses it with the runtime's reason, writing nothing."""
    tree, _, _ = written
    if shape.startswith(patch.DEFERRED):
        module, old, new = (
            MODEL_RUNNER,
            "        if defer_kv_finalize:\n            self.kv_connector.finalize_step()\n",
            "",
        )
        reason = "does not run post_forward(defer_finalize=...) -> propose() -> finalize_step()"
    else:
        module, old, new = KV_CONNECTOR, "self.kv_connector.clear_connector_metadata()", "pass"
        reason = "post_forward no longer calls/reads clear_connector_metadata"
    text = tree.read(module)
    drifted = nt.replaced(tree, tmp_path / "drifted", module, old, new)
    assert ask_tree(drifted, FIX)["answer"] == "refused"
    nt.assert_cannot_carry(FIX, drifted, module, tmp_path / "work", "does not recognise this runner", reason)
    assert drifted.read(module) == text.replace(old, new)


def test_the_execute_model_shape_is_refused(carried: nt.Carry, shape: str) -> None:
    """0.15 - 0.21: the output is collected in execute_model, before the drafter; the carry says
    what the tree lacks and writes nothing."""
    if not shape.startswith(patch.IN_EXECUTE):
        pytest.skip("this release collects the KV output in sample_tokens")
    _, result, _ = carried
    assert result.result is Carried.REFUSED and REFUSED_SHAPE in result.reason and result.edits == ()


def test_a_carried_tree_needs_nothing_more(written: nt.Carry, tmp_path: Path) -> None:
    _, _, changed = written
    nt.assert_needs_nothing_more(FIX, changed, tmp_path)


def test_the_probe_stands_in_device_events_only_in_its_own_thread() -> None:
    """While the probe runs, torch.cuda.Event is its recording stand-in in the probing thread
    only; afterwards it is torch's own again."""
    import torch

    real = torch.cuda.Event
    made: list[str] = []
    seen: dict[str, Any] = {}
    event = probe._device_events(lambda *args, **kwargs: made.append("real") or "real-event")
    readiness.override_events(lambda: "stand-in")
    try:
        seen["probe"] = event(blocking=True)
        other = threading.Thread(target=lambda: seen.update(other=event(blocking=True)))
        other.start()
        other.join()
    finally:
        readiness.override_events(None)
    assert seen == {"probe": "stand-in", "other": "real-event"} and made == ["real"]
    probe.probe()
    assert torch.cuda.Event is real
