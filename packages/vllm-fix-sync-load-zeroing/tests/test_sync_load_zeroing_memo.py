"""The coverage memo on real vLLM: a cold engine-core decision imports nothing the engine core has
not imported (no vllm.v1.worker.utils, no vllm._aiter_ops: issue 33), answers from the
specification's facts, which are the facts the live computation gives, and writes them; a fresh
engine-core process with the memo decides the same; a changed recorded file, another vLLM (or
torch, Python, this package, the layout environment) invalidates it; a corrupt memo or an
unwritable cache root costs the computation and one DEBUG line, never an exception. A process
with vllm.v1.worker.utils loaded (a worker) computes live and refreshes the memo, so the engine
core deciding after its workers finds it valid."""

from __future__ import annotations

import importlib
import json
import logging
import os
import shutil
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from packaging.version import Version

from vllm_fix_core import Answer
from vllm_fix_sync_load_zeroing import memo, memo_file, memo_key
from vllm_fix_sync_load_zeroing.coverage import read_rewrites_zeroed_bytes
from vllm_fix_sync_load_zeroing.facts import (
    WORKER_UTILS,
    CoverageFacts,
    compute_facts,
    second_group_spec,
    spec_facts,
)
from vllm_fix_sync_load_zeroing.memo import coverage_facts
from vllm_fix_sync_load_zeroing.oracle import hybrid_layouts
from vllm_fix_sync_load_zeroing.probe import attention_spec, probe
from vllm_fix_testing import vllm_version
from vllm_fix_testing.plugin_scenarios import Capture, run_scenarios

AFFECTED = vllm_version() < Version("0.32.0")  # the fix applies
ANSWER = (Answer.AFFECTED_FIXED if AFFECTED else Answer.FIXED_UPSTREAM).value
SCENARIOS = [
    "cold-decide",
    "warm-probe",
    "warm-decide",
    "corrupt-memo",
    "other-vllm-version",
    "unwritable",
    # on a memo of their own (under VLLM_CACHE_ROOT/workers), as an engine core and its workers
    "worker-decide",
    "engine-after-worker-probe",
    "engine-after-worker-decide",
    "worker-valid-memo",
    "worker-other-facts",
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
        assert result["worker_utils_at_decision"] is name.startswith("worker-"), name
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


@pytest.fixture
def fresh_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """As in a process that has not refreshed the memo yet (refresh_memo tries once per process)."""
    monkeypatch.setattr(memo, "_refreshed", set())


def memo_lines_of(r: dict[str, Any]) -> list[list[str]]:
    return [line for line in r["lines"] if "coverage memo" in line[1]]


def live_facts() -> CoverageFacts:
    return compute_facts(attention_spec)


def live_probe_checks() -> list[list[Any]]:
    importlib.import_module(WORKER_UTILS)  # loaded: the probe computes its facts live
    return [[c.name, c.affected, c.guard] for c in probe().checks]


# ---- (1) a cold decision imports nothing, answers from the specification, writes the memo -----


def test_cold_decision_imports_nothing_the_engine_core_has_not(runs: dict[str, dict[str, Any]]) -> None:
    """Issue 33: the engine core's first decision imported vllm.v1.worker.utils, and with it
    vllm._aiter_ops (AITER_SITUV2_A4W4=1 in os.environ, the aiter logger disabled, on 0.32.0)."""
    for name in ("cold-decide", "warm-decide", "corrupt-memo", "other-vllm-version", "unwritable"):
        r = runs[name]
        assert r["answer"] == ANSWER, (name, r["message"])
        assert r["worker_utils_after"] is False, name
        assert r["new_vllm_modules"] == [], name
        assert r["aiter_ops_loaded"] is False, name
        assert r["aiter_env"] == r["aiter_env_before"], name  # no AITER_* variable set


def test_cold_decision_writes_the_memo(runs: dict[str, dict[str, Any]], _module_cache_root: Path) -> None:
    r = runs["cold-decide"]
    assert r["memo_before"] is None and r["memo_after"] is not None
    assert r["answer"] == ANSWER, r["message"]
    path = Path(r["memo_path"])
    assert path.parent == _module_cache_root / "vllm-fixes" / "sync-load-zeroing"
    assert [line for line in r["lines"] if "coverage memo" in line[1]] == []  # a plain miss is quiet
    data = json.loads(path.read_bytes())
    assert data["stamp"] == memo_key.current_stamp()
    recorded = {entry[0] for entry in data["files"]}
    assert sys.modules["vllm.v1.kv_cache_interface"].__file__ in recorded


def test_memoized_facts_are_the_live_facts(runs: dict[str, dict[str, Any]]) -> None:
    """The specification's facts the cold engine core wrote are what vLLM's zeroer measures."""
    facts = live_facts()
    assert runs["cold-decide"]["memo_facts"] == facts.to_json()
    assert facts.zeroer is True
    assert facts.layouts == hybrid_layouts()
    spec = attention_spec()
    assert dict(facts.covered) == {name: read_rewrites_zeroed_bytes(name, spec) for name in facts.layouts}
    assert dict(facts.grouped) == {
        name: read_rewrites_zeroed_bytes(name, spec, more_specs=(second_group_spec(spec),))
        for name in facts.layouts
    }
    assert dict(facts.errors) == dict(facts.grouped_errors) == {}


def test_specification_facts_are_the_measured_facts() -> None:
    assert spec_facts() == live_facts()


def test_memo_round_trips_in_process(cache_root: Path) -> None:
    facts = coverage_facts(attention_spec, use_memo=True)
    path = memo_key.memo_path()
    assert path.is_relative_to(cache_root)
    assert facts == live_facts()
    assert memo_file.read_memo(path, memo_key.current_stamp()) == facts


# ---- (2) a fresh process with the memo: same answers, no vllm.v1.worker.utils ----------------


def test_probe_on_the_memo_does_not_import_worker_utils(runs: dict[str, dict[str, Any]]) -> None:
    r = runs["warm-probe"]
    assert r["worker_utils_after"] is False
    assert r["memo_after"] == r["memo_before"] == runs["cold-decide"]["memo_after"]  # read, not rewritten
    assert r["checks"] == live_probe_checks()


def test_decision_on_the_memo_reaches_the_same_rung(runs: dict[str, dict[str, Any]]) -> None:
    r = runs["warm-decide"]
    assert r["answer"] == runs["cold-decide"]["answer"] == ANSWER, r["message"]
    assert r["memo_after"] == r["memo_before"]
    assert r["worker_utils_after"] is False  # nothing imports it, apply() included (0.31.0)
    assert len(r["lines"]) == 1  # the decision line only


# ---- (3) a changed recorded file invalidates the memo ----------------------------------------


@pytest.fixture
def recorded_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temporary copy of a vLLM source file, recorded in the memo next to vLLM's own files."""
    copy = tmp_path / "utils.py"
    shutil.copy2(importlib.import_module(WORKER_UTILS).__file__ or "", copy)
    real = memo_key.vllm_files

    def with_copy() -> list[tuple[str, int, int]]:
        st = copy.stat()
        return [*real(), (str(copy), st.st_size, st.st_mtime_ns)]

    monkeypatch.setattr(memo_key, "vllm_files", with_copy)
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
    return memo_file.read_memo(memo_key.memo_path(), memo_key.current_stamp()) is not None


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
    recorded = {entry[0] for entry in json.loads(memo_key.memo_path().read_bytes())["files"]}
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
    assert r["answer"] == ANSWER, r["message"]
    assert r["memo_facts"] == runs["cold-decide"]["memo_facts"]  # rewritten, valid again
    memo_lines = [line for line in r["lines"] if "coverage memo" in line[1]]
    assert len(memo_lines) == 1 and memo_lines[0][0] == "DEBUG"
    assert "unreadable" in memo_lines[0][1]


def test_memo_of_another_vllm_version_in_a_fresh_process(runs: dict[str, dict[str, Any]]) -> None:
    r = runs["other-vllm-version"]
    assert r["answer"] == ANSWER, r["message"]  # not "not applicable", as its facts would say
    assert r["memo_facts"] == runs["cold-decide"]["memo_facts"]
    assert (
        json.loads(Path(r["memo_path"]).read_bytes())["stamp"]["vllm_version"]
        == memo_key.current_stamp()["vllm_version"]
    )
    assert [line for line in r["lines"] if "coverage memo" in line[1]] == []  # stale is not an error


def test_unwritable_cache_root_in_a_fresh_process(runs: dict[str, dict[str, Any]]) -> None:
    r = runs["unwritable"]
    assert r["answer"] == ANSWER, r["message"]
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
    path = memo_key.memo_path()
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
    path = memo_key.memo_path()
    data = json.loads(path.read_bytes())
    data["stamp"][key] = value
    data["facts"] = CoverageFacts(zeroer=False).to_json()  # would make the probe "not applicable"
    path.write_text(json.dumps(data))
    assert coverage_facts(attention_spec, use_memo=True) == live_facts()
    assert computed == [1, 1] and memo_lines == []
    assert json.loads(path.read_bytes())["stamp"] == memo_key.current_stamp()


def test_no_cache_root_at_all(monkeypatch: pytest.MonkeyPatch, memo_lines: list[tuple[str, str]]) -> None:
    def broken() -> Path:
        raise RuntimeError("no cache root")

    monkeypatch.setattr(memo_key, "memo_path", broken)
    assert coverage_facts(attention_spec, use_memo=True) == live_facts()
    assert len(memo_lines) == 1 and "no memo key" in memo_lines[0][1]


# ---- (5) a worker refreshes the memo; its engine core, deciding after it, reads it -------------


def test_worker_decision_writes_the_memo(runs: dict[str, dict[str, Any]], _module_cache_root: Path) -> None:
    r = runs["worker-decide"]
    assert r["answer"] == ANSWER, r["message"]
    assert Path(r["memo_path"]).parent == _module_cache_root / "workers" / "vllm-fixes" / "sync-load-zeroing"
    assert r["memo_before"] is None and r["memo_after"] is not None
    assert r["memo_facts"] == live_facts().to_json()  # exactly the live facts
    assert memo_lines_of(r) == []  # a plain miss is quiet
    data = json.loads(Path(r["memo_path"]).read_bytes())
    assert data["stamp"] == memo_key.current_stamp()
    assert importlib.import_module(WORKER_UTILS).__file__ in {entry[0] for entry in data["files"]}


def test_engine_core_after_its_workers_reads_their_memo(runs: dict[str, dict[str, Any]]) -> None:
    written = runs["worker-decide"]["memo_after"]
    r = runs["engine-after-worker-probe"]
    assert r["worker_utils_after"] is False  # answered from the workers' memo
    assert r["memo_before"] == r["memo_after"] == written
    assert r["checks"] == live_probe_checks()
    r = runs["engine-after-worker-decide"]
    assert r["answer"] == runs["worker-decide"]["answer"] == ANSWER, r["message"]
    assert r["memo_before"] == r["memo_after"] == written
    assert r["worker_utils_after"] is False and r["new_vllm_modules"] == []
    assert len(r["lines"]) == 1  # the decision line only


def test_worker_leaves_a_valid_memo_alone(runs: dict[str, dict[str, Any]]) -> None:
    r = runs["worker-valid-memo"]
    assert r["answer"] == ANSWER, r["message"]
    assert r["memo_before"] == r["memo_after"] == runs["worker-decide"]["memo_after"]
    assert r["memo_mtime_before"] is not None
    assert r["memo_mtime_after"] == r["memo_mtime_before"]  # read, not rewritten
    assert len(r["lines"]) == 1  # the decision line only


def test_worker_rewrites_a_memo_with_other_facts(runs: dict[str, dict[str, Any]]) -> None:
    r = runs["worker-other-facts"]
    assert r["answer"] == ANSWER, r["message"]
    assert r["edited_facts"] != live_facts().to_json()
    assert r["memo_facts"] == live_facts().to_json()  # rewritten with what the zeroer does
    assert r["memo_after"] != r["memo_before"]
    assert r["memo_mtime_after"] != r["memo_mtime_before"]
    lines = memo_lines_of(r)
    assert len(lines) == 1 and lines[0][0] == "DEBUG", r["lines"]
    assert "holds other facts" in lines[0][1] and "refreshed" in lines[0][1]


def test_loaded_worker_utils_means_live_facts_and_a_refreshed_memo(
    cache_root: Path, memo_lines: list[tuple[str, str]], computed: list[int]
) -> None:
    """Where vLLM's worker utils are loaded (this process), the probe computes live, from the
    objects as loaded, and writes what it computed into the memo."""
    assert live_probe_checks()
    assert computed == [1]  # live, not from the memo
    path = memo_key.memo_path()
    assert path.is_relative_to(cache_root)
    assert memo_file.read_memo(path, memo_key.current_stamp()) == live_facts()
    assert memo_lines == []


def test_refresh_writes_only_when_needed(fresh_process: None, memo_lines: list[tuple[str, str]]) -> None:
    facts = live_facts()
    assert memo.refresh_memo(facts) is True  # missing: written
    path = memo_key.memo_path()
    before = path.stat()
    memo._refreshed.clear()
    assert memo.refresh_memo(facts) is False  # valid, same facts: read only
    assert (path.stat().st_ino, path.stat().st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    memo._refreshed.clear()
    data = json.loads(path.read_bytes())
    data["stamp"]["torch_version"] = "0.0.1"  # stale
    path.write_text(json.dumps(data))
    assert memo.refresh_memo(facts) is True
    assert memo_file.read_memo(path, memo_key.current_stamp()) == facts
    assert memo_lines == []  # missing and stale are quiet


def test_refresh_is_tried_once_per_process(
    fresh_process: None, memo_lines: list[tuple[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The re-probe of the same decision does not read the memo again: one read, one DEBUG line
    at most per process, facts and memo."""
    facts = live_facts()
    reads: list[int] = []
    real = memo_file.read_memo

    def counting(path: Path, stamp: Any) -> CoverageFacts | None:
        reads.append(1)
        return real(path, stamp)

    monkeypatch.setattr(memo_file, "read_memo", counting)
    memo_key.memo_path().parent.mkdir(parents=True)
    memo_key.memo_path().write_bytes(b"not json")
    assert memo.refresh_memo(facts) is True
    assert memo.refresh_memo(facts) is False
    assert reads == [1] and len(memo_lines) == 1
    other = CoverageFacts(True, facts.layouts, {name: False for name in facts.layouts}, {})
    assert memo.refresh_memo(other) is True  # other facts (vLLM's objects changed): refreshed again
    assert reads == [1, 1]


@pytest.mark.parametrize("memo_state", ["valid", "unwritable"])
def test_reprobe_after_apply_adds_nothing(
    memo_state: str,
    cache_root: Path,
    fresh_process: None,
    memo_lines: list[tuple[str, str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A probe that read the memo (or computed and wrote it) and a later one in the same process
    that computes live (vllm.v1.worker.utils loaded meanwhile): that refresh neither reads the
    memo again nor repeats the DEBUG line of a memo it cannot write."""
    if memo_state == "unwritable":
        (cache_root / "vllm-fixes").write_text("a file where the memo's directory would be\n")
    else:
        coverage_facts(attention_spec, use_memo=True)
        monkeypatch.setattr(memo, "_refreshed", set())
    first = coverage_facts(attention_spec, use_memo=True)  # as with vllm.v1.worker.utils not loaded
    lines = list(memo_lines)
    assert len(lines) == (1 if memo_state == "unwritable" else 0), lines
    monkeypatch.setattr(memo_file, "read_memo", None)  # a read would raise: refresh_memo logs it
    monkeypatch.setattr(memo_file, "write_memo", None)
    assert coverage_facts(attention_spec) == first  # loaded: live, then refresh
    assert memo_lines == lines


@pytest.mark.parametrize("kind", ["corrupt", "other-facts", "unwritable", "raising"])
def test_refresh_never_raises(
    kind: str,
    cache_root: Path,
    fresh_process: None,
    memo_lines: list[tuple[str, str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    facts = live_facts()
    path = memo_key.memo_path()
    if kind == "unwritable":
        (cache_root / "vllm-fixes").write_text("a file where the memo's directory would be\n")
    else:
        memo_file.write_memo(path, memo_key.current_stamp(), facts)
    if kind == "corrupt":
        path.write_bytes(b'{"stamp": {"schema": 1, trunc')
    elif kind == "other-facts":
        memo_file.write_memo(path, memo_key.current_stamp(), CoverageFacts(zeroer=False))
    elif kind == "raising":
        path.unlink()

        def broken(*args: Any) -> None:
            raise RuntimeError("disk on fire")

        monkeypatch.setattr(memo_file, "write_memo", broken)
    importlib.import_module(WORKER_UTILS)
    assert coverage_facts(attention_spec) == facts  # the probe's path: live, then refresh
    assert len(memo_lines) == 1 and memo_lines[0][0] == "DEBUG", memo_lines
    expected = {
        "corrupt": ("unreadable", "; refreshed from the live facts"),
        "other-facts": ("holds other facts", "; refreshed from the live facts"),
        "unwritable": ("cannot write", "; not refreshed"),
        "raising": ("disk on fire", "; not refreshed"),
    }[kind]
    assert expected[0] in memo_lines[0][1] and memo_lines[0][1].endswith(expected[1])
    if kind in ("corrupt", "other-facts"):
        assert memo_file.read_memo(path, memo_key.current_stamp()) == facts


def test_concurrent_writers_never_break_a_reader(cache_root: Path) -> None:
    """Several workers refreshing at once while an engine core reads: every read sees a whole,
    valid memo, never a temporary file or a partial one; no temporary file stays."""
    facts = live_facts()
    path, stamp = memo_key.memo_path(), memo_key.current_stamp()
    memo_file.write_memo(path, stamp, facts)  # the writers replace it while the reader reads
    stop = threading.Event()
    failures: list[BaseException] = []

    writes: list[int] = []

    def writer() -> None:
        try:
            while not stop.is_set():
                memo_file.write_memo(path, stamp, facts)
                writes.append(1)
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=writer) for _ in range(3)]
    for thread in threads:
        thread.start()
    seen = []
    try:
        while len(seen) < 200:
            seen.append(memo_file.read_memo(path, stamp))
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert failures == [] and len(writes) > 20  # the reads did race replaces
    assert all(got == facts for got in seen)
    assert [p.name for p in path.parent.iterdir()] == [path.name]
