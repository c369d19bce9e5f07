"""The coverage memo on real vLLM: a cold decision writes it with the facts the live computation
gives; a fresh engine-core process with the memo decides the same without importing
vllm.v1.worker.utils; a changed recorded file, another vLLM (or torch, Python, this package, the
layout environment) invalidates it; a corrupt memo or an unwritable cache root costs the live
computation and one DEBUG line, never an exception."""

from __future__ import annotations

import importlib
import json
import logging
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from packaging.version import Version

from vllm_fix_core import Rung
from vllm_fix_sync_load_zeroing import memo
from vllm_fix_sync_load_zeroing.coverage import hybrid_layouts, read_rewrites_zeroed_bytes
from vllm_fix_sync_load_zeroing.memo import CoverageFacts, compute_facts, coverage_facts
from vllm_fix_sync_load_zeroing.probe import attention_spec, probe
from vllm_fix_testing import vllm_version
from vllm_fix_testing.plugin_scenarios import Capture, run_scenarios

AFFECTED = vllm_version() < Version("0.32.0")  # the fix applies: apply() imports worker utils
RUNG = (Rung.APPLIED if AFFECTED else Rung.UPSTREAM_FIXED).value
SCENARIOS = [
    "cold-decide",
    "warm-probe",
    "warm-decide",
    "corrupt-memo",
    "other-vllm-version",
    "unwritable",
]


@pytest.fixture(scope="module")
def runs(_module_cache_root: Path) -> dict[str, dict[str, Any]]:
    """The scenarios in order, in forked engine-core-like processes, on a fresh cache root."""
    assert not list(_module_cache_root.rglob("*.json"))
    script = Path(__file__).with_name("_memo_scenarios.py")
    results: dict[str, dict[str, Any]] = run_scenarios(script, SCENARIOS, timeout=600)
    for name, result in results.items():
        assert "crashed" not in result, (name, result)
        assert result["worker_utils_before"] is False, name
    return results


@pytest.fixture
def memo_lines() -> Iterator[list[tuple[str, str]]]:
    capture = Capture()
    log = memo._memo_logger()
    log.addHandler(capture)
    level = log.level
    log.setLevel(logging.DEBUG)
    yield capture.lines
    log.setLevel(level)
    log.removeHandler(capture)


def live_facts() -> CoverageFacts:
    return compute_facts(attention_spec)


def live_probe_checks() -> list[list[Any]]:
    importlib.import_module(memo.WORKER_UTILS)  # loaded: the probe computes its facts live
    return [[c.name, c.affected, c.guard] for c in probe().checks]


# ---- (1) a cold decision writes the memo, with what the live computation gives ---------------


def test_cold_decision_writes_the_memo(runs: dict[str, dict[str, Any]], _module_cache_root: Path) -> None:
    r = runs["cold-decide"]
    assert r["memo_before"] is None and r["memo_after"] is not None
    assert r["rung"] == RUNG, r["message"]
    assert r["worker_utils_after"] is True  # cold: it had to ask vLLM's zeroer
    path = Path(r["memo_path"])
    assert path.parent == _module_cache_root / "vllm-fixes" / "sync-load-zeroing"
    assert [line for line in r["lines"] if "coverage memo" in line[1]] == []  # a plain miss is quiet
    data = json.loads(path.read_bytes())
    assert data["stamp"] == memo.current_stamp()
    recorded = {entry[0] for entry in data["files"]}
    assert importlib.import_module(memo.WORKER_UTILS).__file__ in recorded
    assert sys.modules["vllm.v1.kv_cache_interface"].__file__ in recorded


def test_memoized_facts_are_the_live_facts(runs: dict[str, dict[str, Any]]) -> None:
    facts = live_facts()
    assert runs["cold-decide"]["memo_facts"] == facts.to_json()
    assert facts.zeroer is True
    assert facts.layouts == hybrid_layouts()
    assert dict(facts.covered) == {
        name: read_rewrites_zeroed_bytes(name, attention_spec()) for name in facts.layouts
    }
    assert dict(facts.errors) == {}


def test_memo_round_trips_in_process(cache_root: Path) -> None:
    facts = coverage_facts(attention_spec, use_memo=True)
    path = memo.memo_path()
    assert path.is_relative_to(cache_root)
    assert facts == live_facts()
    assert memo.read_memo(path, memo.current_stamp()) == facts


# ---- (2) a fresh process with the memo: same answers, no vllm.v1.worker.utils ----------------


def test_probe_on_the_memo_does_not_import_worker_utils(runs: dict[str, dict[str, Any]]) -> None:
    r = runs["warm-probe"]
    assert r["worker_utils_after"] is False
    assert r["memo_after"] == r["memo_before"] == runs["cold-decide"]["memo_after"]  # read, not rewritten
    assert r["checks"] == live_probe_checks()


def test_decision_on_the_memo_reaches_the_same_rung(runs: dict[str, dict[str, Any]]) -> None:
    r = runs["warm-decide"]
    assert r["rung"] == runs["cold-decide"]["rung"] == RUNG, r["message"]
    assert r["memo_after"] == r["memo_before"]
    # Where the fix applies, apply() imports the module on purpose (the patched method needs it
    # on its first step with pending READs); elsewhere nothing imports it.
    assert r["worker_utils_after"] is AFFECTED
    assert len(r["lines"]) == 1  # the decision line only


# ---- (3) a changed recorded file invalidates the memo ----------------------------------------


@pytest.fixture
def recorded_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temporary copy of a vLLM source file, recorded in the memo next to vLLM's own files."""
    copy = tmp_path / "utils.py"
    shutil.copy2(importlib.import_module(memo.WORKER_UTILS).__file__ or "", copy)
    real = memo.vllm_files

    def with_copy() -> list[tuple[str, int, int]]:
        st = copy.stat()
        return [*real(), (str(copy), st.st_size, st.st_mtime_ns)]

    monkeypatch.setattr(memo, "vllm_files", with_copy)
    return copy


@pytest.fixture
def computed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts live computations."""
    calls: list[int] = []
    real = memo.compute_facts

    def counting(spec: Any) -> CoverageFacts:
        calls.append(1)
        return real(spec)

    monkeypatch.setattr(memo, "compute_facts", counting)
    return calls


def _valid() -> bool:
    return memo.read_memo(memo.memo_path(), memo.current_stamp()) is not None


@pytest.mark.parametrize("change", ["mtime", "size", "removed"])
def test_changed_recorded_file_invalidates(recorded_copy: Path, computed: list[int], change: str) -> None:
    first = coverage_facts(attention_spec, use_memo=True)
    assert computed == [1] and _valid()
    assert coverage_facts(attention_spec, use_memo=True) == first
    assert computed == [1]  # a hit
    st = recorded_copy.stat()
    if change == "mtime":
        os.utime(recorded_copy, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000))
    elif change == "size":
        with recorded_copy.open("ab") as out:
            out.write(b"\n")
        os.utime(recorded_copy, ns=(st.st_atime_ns, st.st_mtime_ns))  # same mtime, other size
    else:
        recorded_copy.unlink()
    assert not _valid()
    assert coverage_facts(attention_spec, use_memo=True) == first  # recomputed live...
    assert computed == [1, 1]
    if change != "removed":
        assert _valid()  # ...and written again for the file as it is now


def test_every_loaded_vllm_module_file_is_recorded(cache_root: Path) -> None:
    coverage_facts(attention_spec, use_memo=True)
    recorded = {entry[0] for entry in json.loads(memo.memo_path().read_bytes())["files"]}
    loaded = {
        module.__file__
        for name, module in list(sys.modules.items())
        if (name == "vllm" or name.startswith("vllm.")) and isinstance(getattr(module, "__file__", None), str)
    }
    assert loaded <= recorded


def test_layout_environment_is_part_of_the_key(monkeypatch: pytest.MonkeyPatch, computed: list[int]) -> None:
    """vLLM's resolver reads VLLM_KV_CACHE_LAYOUT: a memo written without it must not answer for
    a process that sets it (nor the other way round)."""
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    unset = coverage_facts(attention_spec, use_memo=True)
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "LBHNC")
    assert not _valid()
    narrowed = coverage_facts(attention_spec, use_memo=True)
    assert computed == [1, 1]
    assert narrowed.layouts == hybrid_layouts() == ("LBHNC",) != unset.layouts


# ---- (4) corrupt, unwritable, another vLLM: live computation, no exception -------------------


def test_corrupt_memo_in_a_fresh_process(runs: dict[str, dict[str, Any]]) -> None:
    r = runs["corrupt-memo"]
    assert r["rung"] == RUNG, r["message"]
    assert r["memo_facts"] == runs["cold-decide"]["memo_facts"]  # rewritten, valid again
    memo_lines = [line for line in r["lines"] if "coverage memo" in line[1]]
    assert len(memo_lines) == 1 and memo_lines[0][0] == "DEBUG"
    assert "unreadable" in memo_lines[0][1]


def test_memo_of_another_vllm_version_in_a_fresh_process(runs: dict[str, dict[str, Any]]) -> None:
    r = runs["other-vllm-version"]
    assert r["rung"] == RUNG, r["message"]  # not "not applicable", as its facts would say
    assert r["memo_facts"] == runs["cold-decide"]["memo_facts"]
    assert (
        json.loads(Path(r["memo_path"]).read_bytes())["stamp"]["vllm_version"]
        == memo.current_stamp()["vllm_version"]
    )
    assert [line for line in r["lines"] if "coverage memo" in line[1]] == []  # stale is not an error


def test_unwritable_cache_root_in_a_fresh_process(runs: dict[str, dict[str, Any]]) -> None:
    r = runs["unwritable"]
    assert r["rung"] == RUNG, r["message"]
    assert r["memo_after"] is None
    memo_lines = [line for line in r["lines"] if "coverage memo" in line[1]]
    assert len(memo_lines) == 1 and memo_lines[0][0] == "DEBUG"
    assert "cannot write" in memo_lines[0][1]


@pytest.mark.parametrize(
    "garbage",
    [b"", b"not json", b"[]", b'{"stamp": {}, "files": []}', None],
    ids=["empty", "not-json", "a-list", "no-files", "wrong-facts"],
)
def test_corrupt_memo_is_recomputed(garbage: bytes | None, memo_lines: list[tuple[str, str]]) -> None:
    coverage_facts(attention_spec, use_memo=True)
    path = memo.memo_path()
    if garbage is None:  # valid stamp and files, facts of another shape
        data = json.loads(path.read_bytes())
        data["facts"]["covered"] = {"LBHNC": "yes"}
        garbage = json.dumps(data).encode()
    path.write_bytes(garbage)
    memo_lines.clear()
    assert coverage_facts(attention_spec, use_memo=True) == live_facts()
    assert _valid()  # overwritten
    if garbage == b'{"stamp": {}, "files": []}':
        assert memo_lines == []  # a stamp that does not match is stale, not corrupt
    else:
        assert len(memo_lines) == 1 and memo_lines[0][0] == "DEBUG", memo_lines


def test_unwritable_directory(
    cache_root: Path, monkeypatch: pytest.MonkeyPatch, memo_lines: list[tuple[str, str]]
) -> None:
    blocker = cache_root / "vllm-fixes"
    blocker.write_text("a file where the memo's directory would be\n")
    assert coverage_facts(attention_spec, use_memo=True) == live_facts()
    assert not blocker.is_dir()
    assert len(memo_lines) == 1 and "cannot write" in memo_lines[0][1]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory anyway")
def test_read_only_directory(cache_root: Path, memo_lines: list[tuple[str, str]]) -> None:
    cache_root.chmod(0o500)
    try:
        assert coverage_facts(attention_spec, use_memo=True) == live_facts()
    finally:
        cache_root.chmod(0o700)
    assert len(memo_lines) == 1 and "cannot write" in memo_lines[0][1]


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("vllm_version", "0.0.1"),
        ("vllm_path", "/elsewhere/vllm"),
        ("torch_version", "0.0.1"),
        ("python", "2.7.18"),
        ("fix_version", "0.0.1"),
        ("own_source", "0" * 64),
        ("schema", 0),
    ],
)
def test_memo_for_another_install_is_ignored(
    key: str, value: Any, computed: list[int], memo_lines: list[tuple[str, str]]
) -> None:
    coverage_facts(attention_spec, use_memo=True)
    path = memo.memo_path()
    data = json.loads(path.read_bytes())
    data["stamp"][key] = value
    data["facts"] = CoverageFacts(zeroer=False).to_json()  # would make the probe "not applicable"
    path.write_text(json.dumps(data))
    assert coverage_facts(attention_spec, use_memo=True) == live_facts()
    assert computed == [1, 1] and memo_lines == []
    assert json.loads(path.read_bytes())["stamp"] == memo.current_stamp()


def test_no_cache_root_at_all(monkeypatch: pytest.MonkeyPatch, memo_lines: list[tuple[str, str]]) -> None:
    def broken() -> Path:
        raise RuntimeError("no cache root")

    monkeypatch.setattr(memo, "memo_path", broken)
    assert coverage_facts(attention_spec, use_memo=True) == live_facts()
    assert len(memo_lines) == 1 and "no memo key" in memo_lines[0][1]


def test_loaded_worker_utils_means_live_facts_and_no_memo(cache_root: Path) -> None:
    """Where vLLM's worker utils are loaded (this process), the probe computes live, from the
    objects as loaded, and neither reads nor writes the memo."""
    live_probe_checks()
    assert not list(cache_root.rglob("*.json"))
