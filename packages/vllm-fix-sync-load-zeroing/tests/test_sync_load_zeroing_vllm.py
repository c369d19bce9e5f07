"""Sync-load zeroing on real vLLM: the decision table, the negative control on 0.31.0, the fix,
"fixed upstream" on 0.32.0 - 0.34.0 (several attention groups on 0.34.0), the #59164 API shape,
and fail-safe bad input.

vLLM's worker utilities are imported here, as in a worker: the patch's coverage is then measured
with vLLM's zeroer (where they are not loaded it is the specification's, checked against the
measurement below)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import vllm.v1.worker.utils  # noqa: F401  (loaded, as in a worker: coverage is measured)
from packaging.version import Version

from vllm_fix_core import Answer, NotApplicable, PatchSet, Settings, evaluate, runtime
from vllm_fix_sync_load_zeroing import FIX, coverage
from vllm_fix_sync_load_zeroing.coverage import read_rewrites_zeroed_bytes
from vllm_fix_sync_load_zeroing.facts import second_group_spec
from vllm_fix_sync_load_zeroing.oracle import hybrid_layouts, zeroing_is_overwritten
from vllm_fix_sync_load_zeroing.probe import (
    CASES,
    GROUP_CASES,
    ZERO,
    Case,
    attention_groups_read,
    attention_spec,
    fork_connector,
    probe,
    require_feature,
    scheduler,
    step_output,
)
from vllm_fix_testing import applied, assert_every_target_observed, assert_hostile_wrapper_fails, vllm_version

VERSION = vllm_version()
HAS_EXCLUSION = Version("0.32.0") <= VERSION  # build_connector_meta excludes READ destinations
HEAD_SLICE_READ = Version("0.33.0") <= VERSION  # MoRIIO READs non-dense layouts head by head
SEVERAL_GROUPS = Version("0.34.0") <= VERSION  # the hybrid READ carries every attention group
LENIENT = Settings(disabled=frozenset(), strict=False)


def mc() -> Any:
    return require_feature()


def zeroed_after_step(case: Case, layout: str, zero: tuple[int, ...] = ZERO, spec: Any = None) -> list[int]:
    sched = scheduler(mc(), case, layout, spec)
    out = step_output(zero)
    sched.build_connector_meta(out)
    return list(out.new_block_ids_to_zero or [])


# The decision table (spec §4.3): what the step zeroes of [7, 8, 9, 90] under a covered layout.
# 7, 8: aligned attention READ destinations; 9: the locally recomputed tail; 90: a Mamba slot.
TABLE = {
    "attn-import": [9, 90],
    "two-reads": [9, 90],
    "state-only": [7, 8, 9, 90],
    "nothing-pending": [7, 8, 9, 90],
    "producer": [7, 8, 9, 90],
    "attention-only-model": [7, 8, 9, 90],
    "write-mode": [7, 8, 9, 90],
}


# With two attention groups (0.34.0): 10 is the second group's READ destination, 11 its tail.
GROUP_TABLE = {
    "two-attention-groups": [9, 11, 90],
    "state-group-on-full-hit": [7, 8, 9, 11, 90],
    "state-only-two-groups": [7, 8, 9, 10, 11, 90],
    "write-mode-two-groups": [7, 8, 9, 10, 11, 90],
}


def test_hybrid_layouts_are_the_block_compact_ones() -> None:
    assert set(hybrid_layouts()) == {"LBHNC", "LBNHC", "BLHNC", "BLNHC"}


def test_layout_coverage_table() -> None:
    """Spec §4.2, computed from this vLLM: layer- and block-compact layouts are always rewritten
    whole; LHBNC and BHLNC only where MoRIIO's READ copies head slices (0.33.0)."""
    covered = {
        name
        for name in ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
        if read_rewrites_zeroed_bytes(name, attention_spec())
    }
    expected = {"LBHNC", "LBNHC", "BLHNC", "BLNHC"} | ({"LHBNC", "BHLNC"} if HEAD_SLICE_READ else set())
    assert covered == expected


def test_attention_groups_the_read_carries() -> None:
    """Asked of vLLM's own split_block_groups: every attention group on 0.34.0, the first one
    before (whose scheduler refuses a hybrid READ with several)."""
    assert attention_groups_read(mc()) == (2 if SEVERAL_GROUPS else 1)


@pytest.mark.skipif(not SEVERAL_GROUPS, reason="this vLLM's hybrid READ carries one attention group")
@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "BLHNC", "BLNHC"])
@pytest.mark.parametrize("case", GROUP_CASES, ids=lambda c: c.name)
def test_decision_table_several_attention_groups(case: Case, layout: str) -> None:
    """0.34.0 excludes the READ destinations of every attention group (a state group's even on
    a full local hit of the others), never a tail block or a Mamba slot."""
    assert zeroed_after_step(case, layout, case.zero) == GROUP_TABLE[case.name]


def _first_group_only(module: Any) -> Any:
    """vLLM's build_connector_meta as if it excluded the first attention group's destinations
    only (0.33.0's exclusion, which reads block_ids[0])."""
    original = module.MoRIIOConnectorScheduler.build_connector_meta

    def build_connector_meta(self: Any, scheduler_output: Any) -> Any:
        later = {
            b
            for _, block_ids in self._reqs_need_recv.values()
            for group in block_ids[1 : len(self._attn_group_ids)]
            for b in group
        }
        before = list(scheduler_output.new_block_ids_to_zero or [])
        meta = original(self, scheduler_output)
        kept = set(scheduler_output.new_block_ids_to_zero or [])
        scheduler_output.new_block_ids_to_zero = [b for b in before if b in kept or b in later]
        return meta

    return build_connector_meta


@pytest.mark.skipif(not SEVERAL_GROUPS, reason="this vLLM's hybrid READ carries one attention group")
def test_probe_sees_the_second_attention_group_zeroed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control for several attention groups: an exclusion of block_ids[0] alone leaves
    the second group's READ destination (10) zeroed on the step its READ lands."""
    module = mc()
    monkeypatch.setattr(module.MoRIIOConnectorScheduler, "build_connector_meta", _first_group_only(module))
    assert zeroed_after_step(GROUP_CASES[0], "LBHNC", GROUP_CASES[0].zero) == [9, 10, 11, 90]
    report = probe()
    assert report.names(True) == ["zeroing-races-sync-read"]
    assert "two-attention-groups" in report.checks[0].detail


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "BLHNC", "BLNHC"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_decision_table_unpatched(case: Case, layout: str) -> None:
    """Negative control on 0.31.0: the READ destinations 7 and 8 are zeroed on the step their
    READ lands (the race); 0.32.0 / 0.33.0 exclude them already."""
    got = zeroed_after_step(case, layout)
    if case.name in ("attn-import", "two-reads") and not HAS_EXCLUSION:
        assert got == [7, 8, 9, 90]
    else:
        assert got == TABLE[case.name]


@pytest.mark.skipif(HAS_EXCLUSION, reason="fixed upstream: nothing to apply")
@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "BLHNC", "BLNHC"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_decision_table_patched(case: Case, layout: str) -> None:
    with applied(FIX):
        assert zeroed_after_step(case, layout) == TABLE[case.name]


def test_ladder_rung_on_this_release() -> None:
    decision = runtime.apply(FIX, LENIENT)
    if HAS_EXCLUSION:
        assert decision.answer is Answer.FIXED_UPSTREAM, decision.message
    else:
        assert decision.answer is Answer.AFFECTED_FIXED, decision.message
        assert decision.before is not None and decision.before.names(True) == ["zeroing-races-sync-read"]


@pytest.mark.skipif(HAS_EXCLUSION, reason="the bug is not present on this release")
def test_hostile_wrapper_fails() -> None:
    assert_hostile_wrapper_fails(FIX)


@pytest.mark.skipif(HAS_EXCLUSION, reason="fixed upstream: nothing to apply")
@pytest.mark.parametrize("layout", ["LHBNC", "BHLNC"])
def test_uncovered_layout_keeps_zeroing(layout: str) -> None:
    """0.31.0's READ copies one dense run per block; under LHBNC / BHLNC that run is not the
    block's page, so the zeroed bytes are not all rewritten: the block must stay zeroed."""
    with applied(FIX):
        assert zeroed_after_step(CASES[0], layout) == [7, 8, 9, 90]


def test_applying_twice_and_reverting_restores_the_original() -> None:
    if HAS_EXCLUSION:
        pytest.skip("fixed upstream: nothing patched")
    owner = mc().MoRIIOConnectorScheduler
    original = owner.__dict__["build_connector_meta"]
    with applied(FIX):
        runtime.apply(FIX)
        assert owner.__dict__["build_connector_meta"] is not original
    assert owner.__dict__["build_connector_meta"] is original


# ---- bad input keeps zeroing (fail safe) -------------------------------------------------


@pytest.mark.parametrize("layout", ["NOPE", "NHD", "", None])
def test_unknown_or_unresolved_layout_keeps_zeroing(layout: Any) -> None:
    assert not read_rewrites_zeroed_bytes(layout, attention_spec())
    if not HAS_EXCLUSION:
        with applied(FIX):
            assert zeroed_after_step(CASES[0], layout) == [7, 8, 9, 90]


@pytest.mark.parametrize("layout", ["LHBNC", "BHLNC"])
def test_padded_pages_vllm_cannot_build_keep_zeroing(layout: str) -> None:
    padded = FullAttention(page_size_padded=attention_spec().page_size_bytes + 256)
    assert not read_rewrites_zeroed_bytes(layout, padded)
    if not HAS_EXCLUSION:
        with applied(FIX):
            assert zeroed_after_step(CASES[0], layout, spec=padded) == [7, 8, 9, 90]


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"])
def test_transfer_with_a_skipped_layer_is_not_covered(layout: str) -> None:
    assert not read_rewrites_zeroed_bytes(layout, attention_spec(), frozenset({1}))


def test_missing_attention_spec_keeps_zeroing() -> None:
    if HAS_EXCLUSION:
        pytest.skip("fixed upstream: nothing patched")
    sched = scheduler(mc(), CASES[0], "LBHNC")
    del sched.kv_cache_config
    out = step_output()
    with applied(FIX):
        sched.build_connector_meta(out)
    assert out.new_block_ids_to_zero == [7, 8, 9, 90]


def test_malformed_pending_entry_keeps_its_blocks_zeroed() -> None:
    if HAS_EXCLUSION:
        pytest.skip("fixed upstream: nothing patched")
    sched = scheduler(mc(), Case("mixed", pending=(((7,), (90,)), ((8,), (91,)))), "LBHNC")
    request, _ = sched._reqs_need_recv["probe-1"]
    sched._reqs_need_recv["probe-1"] = (request, [8, [91]])  # attention group is not a list
    out = step_output()
    with applied(FIX):
        sched.build_connector_meta(out)
    assert out.new_block_ids_to_zero == [8, 9, 90]


def test_wrapper_snapshots_destinations_before_vllm_clears_them() -> None:
    if HAS_EXCLUSION:
        pytest.skip("fixed upstream: nothing patched")
    sched = scheduler(mc(), CASES[0], "LBNHC")
    out = step_output()
    with applied(FIX):
        sched.build_connector_meta(out)
        assert sched._reqs_need_recv == {}  # vLLM drained them...
        assert out.new_block_ids_to_zero == [9, 90]  # ...after the wrapper read them
        out2 = step_output()
        sched.build_connector_meta(out2)  # next step: nothing pending, everything zeroed
        assert out2.new_block_ids_to_zero == [7, 8, 9, 90]


# ---- feature absent -> not applicable ------------------------------------------------------


def test_release_without_hybrid_read_is_not_applicable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Releases before 0.31.0 have no hybrid READ: their scheduler never sets _has_mamba."""
    module = mc()

    def old_init(self: Any, vllm_config: Any, engine_id: str, kv_cache_config: Any) -> None:
        self.mode = None

    monkeypatch.setattr(module.MoRIIOConnectorScheduler, "__init__", old_init)
    with pytest.raises(NotApplicable, match="hybrid"):
        probe()
    assert runtime.apply(FIX, LENIENT).answer is Answer.NOT_APPLICABLE


def test_release_without_zeroing_is_not_applicable(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.v1.worker.utils as worker_utils

    monkeypatch.delattr(worker_utils, "KVBlockZeroer")
    with pytest.raises(NotApplicable, match="zeroing"):
        probe()


def test_coverage_not_computable_is_cannot_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """A vLLM whose zeroer no longer exposes the segment table the coverage reads: the probe
    cannot judge the rule, so nothing is patched (vLLM's own behaviour stays)."""
    import vllm.v1.worker.utils as worker_utils

    class ChangedZeroer(worker_utils.KVBlockZeroer):  # type: ignore[misc, name-defined]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._meta = None

    monkeypatch.setattr(worker_utils, "KVBlockZeroer", ChangedZeroer)
    decision = runtime.apply(FIX, LENIENT)
    assert decision.answer is Answer.CANNOT_CHECK, decision.message
    runtime.revert(FIX)


# ---- the #59164 API shape ------------------------------------------------------------------


def _fork_class(module: Any) -> type:
    """A MoRIIOConnector carrying get_sync_load_block_ids with the LBNHC-only layout guard the
    #59164 lineage shipped before its review (built from the spec's description)."""

    class ForkMoRIIOConnector(module.MoRIIOConnector):  # type: ignore[misc, name-defined]
        def get_sync_load_block_ids(self) -> list[int]:
            sched = self.connector_scheduler
            if (
                self.mode != module.MoRIIOMode.READ
                or not self.kv_transfer_config.is_kv_consumer
                or not sched._has_mamba
                or self._vllm_config.cache_config.get_resolved_kv_cache_layout().name != "LBNHC"
            ):
                return []
            return [b for pending in sched._reqs_need_recv.values() for b in pending[1][0]]

    return ForkMoRIIOConnector


@pytest.fixture
def fork(monkeypatch: pytest.MonkeyPatch) -> Any:
    module = mc()
    monkeypatch.setattr(module, "MoRIIOConnector", _fork_class(module))
    return module


FORK_TABLE = {
    "attn-import": [7, 8],
    "two-reads": [7, 8],
    "state-only": [],
    "nothing-pending": [],
    "producer": [],
    "attention-only-model": [],
    "write-mode": [],
}


def test_fork_guard_misses_lbhnc(fork: Any) -> None:
    """Negative control for the #59164 API: LBHNC (the ROCm default) gets no exclusion."""
    assert fork_connector(fork, CASES[0], "LBNHC").get_sync_load_block_ids() == [7, 8]
    assert fork_connector(fork, CASES[0], "LBHNC").get_sync_load_block_ids() == []
    report = probe()
    assert report.names(True) == ["zeroing-races-sync-read"]


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "BLHNC", "BLNHC"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_fork_api_patched_follows_the_table(fork: Any, case: Case, layout: str) -> None:
    with applied(FIX) as decision:
        assert decision.shape == "fork-api"
        assert fork_connector(fork, case, layout).get_sync_load_block_ids() == FORK_TABLE[case.name]


def test_fork_api_producer_with_pending_reads_excludes_nothing(fork: Any) -> None:
    with applied(FIX):
        assert (
            fork_connector(
                fork, Case("p", consumer=False, pending=(((7, 8), (90,)),)), "LBHNC"
            ).get_sync_load_block_ids()
            == []
        )


def test_fork_api_uncovered_layout_excludes_nothing(fork: Any) -> None:
    with applied(FIX):
        got = fork_connector(fork, CASES[0], "LHBNC").get_sync_load_block_ids()
    assert got == ([7, 8] if HEAD_SLICE_READ else [])


def test_fork_api_hostile_wrapper_fails(fork: Any) -> None:
    assert_hostile_wrapper_fails(FIX)


def FullAttention(**overrides: Any) -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    base = dict(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16)
    return FullAttentionSpec(**{**base, **overrides})


def test_probe_guard_reads_reach_metadata() -> None:
    sched = scheduler(mc(), CASES[1], "LBHNC")
    meta = sched.build_connector_meta(step_output())
    assert sorted(meta.reqs_to_recv) == ["probe-0", "probe-1"]


# ---- the probe as a regression guard over vLLM's own exclusion ------------------------------


def _regressed(module: Any, kind: str) -> Any:
    """vLLM's build_connector_meta with its exclusion broken one way or the other."""
    original = module.MoRIIOConnectorScheduler.build_connector_meta

    def build_connector_meta(self: Any, scheduler_output: Any) -> Any:
        before = list(scheduler_output.new_block_ids_to_zero or [])
        tail_and_slots = [b for b in before if b >= 9]
        meta = original(self, scheduler_output)
        if kind == "drops-exclusion":
            scheduler_output.new_block_ids_to_zero = before
        else:  # over-excludes: the recomputed tail and the Mamba slots too
            scheduler_output.new_block_ids_to_zero = [
                b for b in scheduler_output.new_block_ids_to_zero or [] if b not in tail_and_slots
            ]
        return meta

    return build_connector_meta


@pytest.mark.parametrize(
    ("kind", "symptom"),
    [
        ("drops-exclusion", "zeroing-races-sync-read"),
        ("over-excludes", "zeroing-skipped-for-unwritten-block"),
    ],
)
def test_probe_catches_a_regressed_exclusion(
    monkeypatch: pytest.MonkeyPatch, kind: str, symptom: str
) -> None:
    """A build_connector_meta that drops the exclusion, or excludes the tail block and Mamba
    slots, is reported; this stand-in is not a shape the fix knows, so the ladder refuses it."""
    module = mc()
    monkeypatch.setattr(module.MoRIIOConnectorScheduler, "build_connector_meta", _regressed(module, kind))
    assert symptom in probe().names(True)
    decision = runtime.apply(FIX, LENIENT)
    assert decision.answer is Answer.REFUSED, decision.message
    runtime.revert(FIX)


# ---- every patched target observed (issue 22) ----------------------------------------------


@pytest.mark.skipif(HAS_EXCLUSION, reason="fixed upstream on this release: nothing is patched")
def test_every_patched_target_observed() -> None:
    assert list(assert_every_target_observed(FIX)) == ["MoRIIOConnectorScheduler.build_connector_meta"]


def test_fork_api_every_patched_target_observed(fork: Any) -> None:
    observed = list(assert_every_target_observed(FIX))
    assert [name.rsplit(".", 2)[-2:] for name in observed] == [
        ["ForkMoRIIOConnector", "get_sync_load_block_ids"]
    ]


# ---- the oracle shares no code with the patch (issue 22) ------------------------------------

FIX_CODE = ("rule", "coverage", "patch")


def _imports(module: str) -> set[str]:
    import ast
    import importlib

    path = importlib.import_module(f"vllm_fix_sync_load_zeroing.{module}").__file__ or ""
    found: set[str] = set()
    for node in ast.walk(ast.parse(Path(path).read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


@pytest.mark.parametrize("module", ["probe", "oracle", "facts", "memo", "memo_key", "memo_file"])
def test_probe_modules_import_nothing_of_the_fix(module: str) -> None:
    fix_code = {f"vllm_fix_sync_load_zeroing.{name}" for name in FIX_CODE}
    assert not _imports(module) & fix_code


def _break_fix_code(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every function of the fix's rule and coverage modules raises (the probe must not care)."""
    import inspect

    from vllm_fix_sync_load_zeroing import coverage, rule

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the probe called the fix's code")

    for module in (rule, coverage):
        for name, value in vars(module).items():
            if inspect.isfunction(value) and value.__module__ == module.__name__:
                monkeypatch.setattr(module, name, broken)
    from vllm_fix_sync_load_zeroing import patch as patch_module

    for name in ("excluded_blocks", "filter_zeroing", "read_destinations", "scheduler_situation"):
        monkeypatch.setattr(patch_module, name, broken)


def test_probe_answer_does_not_move_when_the_fix_code_is_broken(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    importlib.import_module("vllm.v1.worker.utils")  # facts computed live, not from a memo
    intact = [(c.name, c.affected) for c in probe().checks]
    _break_fix_code(monkeypatch)
    assert [(c.name, c.affected) for c in probe().checks] == intact


# ---- a broken rule never verifies (issue 22) --------------------------------------------------


def _all_blocks(situation: Any, pending: Any) -> frozenset[int]:
    return frozenset(range(128))


BREAKS: dict[str, tuple[str, Any]] = {
    # excluded_blocks at the reference patch.py holds: never exclude / exclude every block
    "never-exclude": ("excluded_blocks", lambda situation, pending: frozenset()),
    "exclude-everything": ("excluded_blocks", _all_blocks),
    # filter_zeroing at patch.py's reference: keeps the whole list
    "filter-keeps-all": ("filter_zeroing", lambda blocks, excluded: list(blocks)),
}


# Where the rule is broken: the name patch.py calls it by (its module reference), or the rule's
# own code (as an edit of rule.py would break it: every reference to the function, the probe's
# included, if it held one).
WHERE = ("patch-reference", "rule-code")


def _break_rule(monkeypatch: pytest.MonkeyPatch, kind: str, where: str = "patch-reference") -> None:
    from vllm_fix_sync_load_zeroing import patch as patch_module

    name, broken = BREAKS[kind]
    target = getattr(patch_module, name)
    assert callable(target)  # the reference exists where the patch calls it
    if where == "rule-code":
        monkeypatch.setattr(target, "__code__", broken.__code__)
    else:
        monkeypatch.setattr(patch_module, name, broken)


def _meta_object() -> Any:
    return mc().MoRIIOConnectorScheduler.__dict__["build_connector_meta"]


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("kind", sorted(BREAKS))
def test_broken_rule_fails_to_fix_or_stays_upstream(
    monkeypatch: pytest.MonkeyPatch, kind: str, where: str
) -> None:
    """Affected (0.31.0): a broken rule is "failed to fix", reverted exactly. 0.32.0 / 0.33.0:
    vLLM is right and the probe's answer does not come from the rule: "fixed upstream", never
    "affected → fixed"."""
    original = _meta_object()
    _break_rule(monkeypatch, kind, where)
    decision = evaluate(FIX, LENIENT, apply=True, honour_disable=False)
    try:
        if HAS_EXCLUSION:
            assert decision.answer is Answer.FIXED_UPSTREAM, decision.message
        else:
            assert decision.answer is Answer.FAILED_TO_FIX, decision.message
            assert decision.after is not None and decision.after.affected
    finally:
        if decision.patch is not None:
            decision.patch.revert()
    assert _meta_object() is original
    monkeypatch.undo()
    assert zeroed_after_step(CASES[0], "LBHNC") == ([9, 90] if HAS_EXCLUSION else [7, 8, 9, 90])


@pytest.mark.parametrize("kind", ["exclude-everything", "never-exclude"])  # the fork wrapper filters nothing
@pytest.mark.parametrize("where", WHERE)
def test_fork_api_broken_rule_fails_to_fix(
    fork: Any, monkeypatch: pytest.MonkeyPatch, kind: str, where: str
) -> None:
    original = fork.MoRIIOConnector.__dict__["get_sync_load_block_ids"]
    _break_rule(monkeypatch, kind, where)
    decision = evaluate(FIX, LENIENT, apply=True, honour_disable=False)
    if decision.patch is not None:
        decision.patch.revert()
    assert decision.answer is Answer.FAILED_TO_FIX, decision.message
    assert fork.MoRIIOConnector.__dict__["get_sync_load_block_ids"] is original


@contextmanager
def forced() -> Iterator[None]:
    """The fix's patch installed directly (no ladder), at the shape recognize() gives: on
    0.32.0 / 0.33.0 this layers the wrapper over vLLM's own exclusion."""
    from vllm_fix_sync_load_zeroing import patch as patch_module

    patch = PatchSet(FIX.id)
    patch_module.apply(patch, patch_module.recognize())
    try:
        yield
    finally:
        patch.revert()


@pytest.mark.skipif(not HAS_EXCLUSION, reason="vLLM has no exclusion of its own on this release")
def test_intact_patch_over_vllm_own_exclusion_agrees_with_it() -> None:
    with forced():
        assert probe().names(True) == []
        assert not probe().broken_guards


@pytest.mark.skipif(not HAS_EXCLUSION, reason="vLLM has no exclusion of its own on this release")
@pytest.mark.parametrize("kind", sorted(BREAKS))
def test_broken_patch_over_vllm_own_exclusion_is_seen(monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """The issue's case: the patched scheduler zeroing [7, 8, 9, 90] (or nothing) where vLLM's
    own exclusion zeroes [9, 90] is seen against both references: the table and vLLM itself."""
    _break_rule(monkeypatch, kind)
    with forced():
        got = zeroed_after_step(CASES[0], "LBHNC")
        assert got != [9, 90]
        report = probe()
    assert report.affected
    assert report.broken_guards == ["vllm-own-exclusion-kept"]


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"])
@pytest.mark.parametrize("overrides", [{}, {"num_kv_heads": 1, "head_size": 16}, {"page_size_padded": 1280}])
def test_oracle_and_patch_coverage_agree(layout: str, overrides: dict[str, Any]) -> None:
    """Two independent computations of condition 4 (the probe's byte replay, the patch's interval
    containment) give the same answer; where vLLM cannot build the cache, the oracle raises and
    the patch keeps zeroing."""
    spec = FullAttention(**overrides)
    try:
        measured = zeroing_is_overwritten(layout, spec)
    except Exception:
        measured = False
    assert read_rewrites_zeroed_bytes(layout, spec) is measured


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"])
@pytest.mark.parametrize("overrides", [{}, {"num_kv_heads": 1, "head_size": 16}, {"page_size_padded": 1280}])
def test_oracle_and_patch_coverage_agree_for_two_attention_groups(
    layout: str, overrides: dict[str, Any]
) -> None:
    spec = FullAttention(**overrides)
    second = second_group_spec(spec)
    try:
        measured = zeroing_is_overwritten(layout, spec, second)
    except Exception:
        measured = False
    assert read_rewrites_zeroed_bytes(layout, spec, more_specs=(second,)) is measured


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC", "NHD"])
@pytest.mark.parametrize("overrides", [{}, {"num_kv_heads": 1, "head_size": 16}, {"page_size_padded": 1280}])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("skipped", [frozenset(), frozenset({1})])
def test_specified_coverage_is_the_measured_coverage(
    layout: str, overrides: dict[str, Any], groups: int, skipped: frozenset[int]
) -> None:
    """Where vLLM's worker utilities are not loaded (a multi-process engine core), the patch
    takes condition 4 from the specification instead of importing them (issue 33): it must be
    what vLLM's zeroer measures."""
    spec = FullAttention(**overrides)
    more = (second_group_spec(spec),) * (groups - 1)
    assert coverage.specified(layout, (spec, *more), skipped) is coverage._covered.__wrapped__(
        layout, (spec, *more), skipped, True
    )
