"""Every fix as vLLM loads it: through vLLM's own load_general_plugins(), in a child process.

One scenario table (vllm_fix_testing.plugin_scenarios), each row in its own forked child of one
interpreter that imported vLLM: every fix's plugin alone, lazily deciding once when vLLM imports
its trigger (never "cannot check" or "failed to fix"); every fix disabled; and the rows a fix
pins beyond that (MoRIIO unimportable, an unknown target shape, strict mode, an unknown id).
"""

from __future__ import annotations

import time
from importlib.metadata import entry_points
from typing import Any

import pytest
from packaging.version import Version

from vllm_fix_core import Answer
from vllm_fix_core.registry import Installed, installed_fixes
from vllm_fix_testing import vllm_version
from vllm_fix_testing.plugin_scenarios import plugin_scenarios, run_plugin_scenarios

MORIIO = "vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_connector"
KV_CONNECTOR = "vllm.v1.worker.gpu.kv_connector"
FIX_IDS = sorted(item.fix.id for item in installed_fixes())
ALL_FIXES = [
    "bind-failure",
    "completion-ownership",
    "handshake-port",
    "k3-eof-flush",
    "listener-port",
    "mr-extent",
    "read-eligibility",
    "read-failure-ownership",
    "spec-kv-readiness",
    "sync-load-context",
    "sync-load-zeroing",
]
# The level of a decision's one line, per answer (docs/architecture.md, the ladder).
LEVEL = {
    Answer.AFFECTED_FIXED.value: "INFO",
    Answer.FIXED_UPSTREAM.value: "INFO",
    Answer.NOT_APPLICABLE.value: "DEBUG",
    Answer.REFUSED.value: "WARNING",
}
# Fix-specific rows of the lazy load: the answer each fix's own plugin test pinned on the test
# targets, and the target that then carries exactly the fix's layer (vLLM 0.32.0 already
# excludes the READ destinations: sync-load-zeroing is "fixed upstream" there and patches nothing;
# the matrix cell of 0.31.0, where it is "affected → fixed", runs this file too).
ZEROING_AFFECTED = vllm_version() < Version("0.32.0")
PINNED: dict[str, tuple[str, str, list[str]]] = {
    "read-eligibility": (
        Answer.AFFECTED_FIXED.value,
        f"{MORIIO}:MoRIIOConnectorScheduler.get_num_new_matched_tokens",
        ["read-eligibility"],
    ),
    "read-failure-ownership": (
        Answer.AFFECTED_FIXED.value,
        f"{MORIIO}:MoRIIOConnectorWorker._pop_done_transfers",
        ["read-failure-ownership"],
    ),
    "spec-kv-readiness": (
        Answer.AFFECTED_FIXED.value,
        f"{KV_CONNECTOR}:ActiveKVConnector.post_forward",
        ["spec-kv-readiness"],
    ),
    "sync-load-context": (
        Answer.AFFECTED_FIXED.value,
        f"{KV_CONNECTOR}:ActiveKVConnector.pre_forward",
        ["sync-load-context"],
    ),
    "sync-load-zeroing": (
        Answer.AFFECTED_FIXED.value if ZEROING_AFFECTED else Answer.FIXED_UPSTREAM.value,
        f"{MORIIO}:MoRIIOConnectorScheduler.build_connector_meta",
        ["sync-load-zeroing"] if ZEROING_AFFECTED else [],
    ),
}


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, Any]]:
    names = list(plugin_scenarios(FIX_IDS))
    start = time.monotonic()
    out = run_plugin_scenarios(names, timeout=900)
    print(f"{len(names)} plugin-load scenarios in {time.monotonic() - start:.1f} s")
    return out


def fix_lines(result: dict[str, Any], fix_id: str) -> list[list[str]]:
    return [line for line in result["all_lines"] if line[1].startswith(f"vllm-fix {fix_id}:")]


def test_every_fix_is_installed_and_has_a_row(fixes: list[Installed]) -> None:
    assert FIX_IDS == ALL_FIXES
    assert set(PINNED) <= set(FIX_IDS)
    names = plugin_scenarios(FIX_IDS)
    assert {f"{fid}:lazy" for fid in FIX_IDS} <= set(names)


@pytest.mark.parametrize("fix_id", ALL_FIXES)
def test_entry_points_declared(fix_id: str) -> None:
    fix = {item.fix.id: item.fix for item in installed_fixes()}[fix_id]
    module = fix.entry_point  # vllm_fix_<slug>, also the import name
    plugins = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert plugins[fix.entry_point] == f"{module}.plugin:register"
    declared = {ep.name: ep.value for ep in entry_points(group="vllm_fixes")}
    assert declared[fix.id] == f"{module}.declaration:FIX"


@pytest.mark.parametrize("fix_id", ALL_FIXES)
def test_plugin_loads_and_decides_once_when_vllm_imports_the_trigger(
    results: dict[str, dict[str, Any]], fix_id: str
) -> None:
    r = results[f"{fix_id}:lazy"]
    assert "crashed" not in r and "raised" not in r and "import_errors" not in r, r
    before = r["after_load"][fix_id]
    # Loading the plugin imported nothing and decided nothing: the fix waits for vLLM.
    assert before["imported"] is False and before["answer"] == Answer.PENDING.value
    assert all(layers == [] for layers in before["layers"].values())
    assert r["lines_before_import"] == []
    state = r["state"][fix_id]
    answer = state["answer"]
    assert state["imported"] is True
    assert answer not in (Answer.CANNOT_CHECK.value, Answer.FAILED_TO_FIX.value), r["lines"]
    assert answer in LEVEL, r["lines"]
    assert len(r["lines"]) == 1, r["lines"]
    level, msg = r["lines"][0]
    assert level == LEVEL[answer] and f"{fix_id}: {answer}" in msg
    patched = [key for key, layers in state["layers"].items() if fix_id in layers]
    assert bool(patched) is (answer == Answer.AFFECTED_FIXED.value), state["layers"]
    if fix_id in PINNED:
        pinned_answer, target, layers = PINNED[fix_id]
        assert answer == pinned_answer
        assert state["layers"][target] == layers


def test_read_failure_ownership_installs_its_replacement_for_this_release(
    results: dict[str, dict[str, Any]],
) -> None:
    r = results["read-failure-ownership:lazy"]
    # A shape is named after the first release with that code (0.31 already has 0.32's).
    expected = "vllm-0.33.0" if vllm_version() >= Version("0.33.0") else "vllm-0.32.0"
    assert r["state"]["read-failure-ownership"]["shape"] == expected
    assert r["ours"] is True


@pytest.mark.parametrize("fix_id", ALL_FIXES)
def test_disabled_logs_one_debug_line_and_patches_nothing(
    results: dict[str, dict[str, Any]], fix_id: str
) -> None:
    r = results["disabled"]
    assert "crashed" not in r and "raised" not in r, r
    state = r["state"][fix_id]
    assert state["imported"] is True and state["answer"] == Answer.DISABLED.value
    assert all(layers == [] for layers in state["layers"].values())
    assert fix_lines(r, fix_id) == [["DEBUG", f"vllm-fix {fix_id}: disabled: disabled by VLLM_FIXES_DISABLE"]]


def test_disabled_logs_nothing_else(results: dict[str, dict[str, Any]]) -> None:
    assert len(results["disabled"]["all_lines"]) == len(ALL_FIXES)


def test_unknown_id_is_one_warning_and_the_fix_still_decides(results: dict[str, dict[str, Any]]) -> None:
    r = results["unknown-id"]
    assert "crashed" not in r and "raised" not in r, r
    warnings = [line for line in r["all_lines"] if line[0] == "WARNING"]
    assert len(warnings) == 1
    msg = warnings[0][1]
    assert "VLLM_FIXES_DISABLE names read-eligibility-typo, which is no installed fix" in msg
    assert f"Valid ids: {', '.join(ALL_FIXES)}" in msg
    assert r["state"]["read-eligibility"]["answer"] == Answer.AFFECTED_FIXED.value
    assert len(fix_lines(r, "read-eligibility")) == 1


def test_read_eligibility_moriio_unimportable_logs_one_warning_and_changes_nothing(
    results: dict[str, dict[str, Any]],
) -> None:
    r = results["read-eligibility:moriio-unimportable"]
    assert "msgpack" in r["import_errors"]["read-eligibility"]
    assert r["state"]["read-eligibility"]["imported"] is False
    assert len(r["all_lines"]) == 1
    level, msg = r["all_lines"][0]
    assert level == "WARNING" and f"read-eligibility: {Answer.CANNOT_CHECK.value}" in msg
    assert "failed to import" in msg


def test_read_eligibility_unknown_shape_logs_one_warning_and_changes_nothing(
    results: dict[str, dict[str, Any]],
) -> None:
    r = results["read-eligibility:unknown-shape"]
    assert "raised" not in r and "crashed" not in r, r
    assert r["still_drifted"] is True
    assert r["state"]["read-eligibility"]["layers"] == {
        f"{MORIIO}:MoRIIOConnectorScheduler.get_num_new_matched_tokens": []
    }
    assert len(r["all_lines"]) == 1
    level, msg = r["all_lines"][0]
    assert level == "WARNING" and f"read-eligibility: {Answer.REFUSED.value}" in msg
    assert "this vLLM has the bug" in msg and "no longer decides by" in msg


def test_read_eligibility_unknown_shape_strict_raises(results: dict[str, dict[str, Any]]) -> None:
    r = results["read-eligibility:unknown-shape-strict"]
    assert r["raised"].startswith("FixRefused")
    assert r["state"]["read-eligibility"]["layers"] == {
        f"{MORIIO}:MoRIIOConnectorScheduler.get_num_new_matched_tokens": []
    }


def test_sync_load_context_unknown_shape_logs_one_warning_and_changes_nothing(
    results: dict[str, dict[str, Any]],
) -> None:
    r = results["sync-load-context:unknown-shape"]
    assert "raised" not in r and "crashed" not in r, r
    assert r["still_drifted"] is True
    assert r["state"]["sync-load-context"]["layers"] == {f"{KV_CONNECTOR}:ActiveKVConnector.pre_forward": []}
    assert len(r["all_lines"]) == 1
    level, msg = r["all_lines"][0]
    assert level == "WARNING" and "refused" in msg and "carries no input batch" in msg


def test_sync_load_context_unknown_shape_strict_raises(results: dict[str, dict[str, Any]]) -> None:
    r = results["sync-load-context:unknown-shape-strict"]
    assert r["raised"].startswith("FixRefused")
    assert r["state"]["sync-load-context"]["layers"] == {f"{KV_CONNECTOR}:ActiveKVConnector.pre_forward": []}
