"""tools/newest.py and `tools/matrix.py newest`: the registry's newest vLLM against the matrix, and
what fails the `newest` session. The registry is never asked: its answer is injected."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import matrix
import newest
import vllm_env

RELEASES = ("0.32.0", "0.33.0", "0.34.0")


def test_a_release_newer_than_the_matrix_s_newest_is_named_and_exits_1() -> None:
    code, line = newest.check(["0.33.0", "0.34.0", "0.35.0"], RELEASES)
    assert code == 1
    assert "vLLM 0.35.0, newer than the matrix's newest release 0.34.0" in line


def test_every_newer_release_is_named_oldest_first() -> None:
    assert newest.newer(["0.35.0", "0.34.1", "0.34.0", "0.33.9"], RELEASES) == ["0.34.1", "0.35.0"]
    code, line = newest.check(["0.35.0", "0.34.1"], RELEASES)
    assert (code, "vLLM 0.34.1, 0.35.0, newer" in line) == (1, True)


def test_the_matrix_s_newest_on_the_registry_exits_0() -> None:
    assert newest.check(["0.34.0"], RELEASES) == (
        0,
        "newest: the registry's newest vLLM, 0.34.0, is the matrix's newest release",
    )
    code, line = newest.check(["0.33.0"], RELEASES)
    assert code == 0 and "0.33.0, is not newer than the matrix's newest, 0.34.0" in line


@pytest.mark.parametrize("version", ["0.35.0rc1", "0.35.0.dev3", "0.35.0a1", "0.35.0+cpu", "latest"])
def test_a_pre_release_or_anything_but_a_release_is_never_newer(version: str) -> None:
    assert newest.release_key(version) is None
    assert newest.check([version, "0.34.0"], RELEASES)[0] == 0
    assert newest.check([version], RELEASES)[0] == 2


def test_versions_compare_as_releases_not_as_text() -> None:
    assert newest.newer(["0.100.0", "0.9.0"], ("0.34.0",)) == ["0.100.0"]
    assert newest.newer(["0.34", "0.34.0.0"], ("0.34.0",)) == []  # the same release
    assert newest.newer(["0.34.0.post1"], ("0.34.0",)) == ["0.34.0.post1"]
    assert newest.newest(["0.34.0.post1", "0.34.1", "0.34.0"]) == "0.34.1"


def test_uv_compile_output_is_read() -> None:
    out = "# a comment\nvllm==0.34.0\n    # via -r -\nvllm-fix-core==1.0\n"
    assert newest.parse_compile(out) == ["0.34.0"]
    assert newest.parse_compile("VLLM == 0.35.1  # note\n") == ["0.35.1"]
    assert newest.parse_compile("") == []


def test_matrix_newest_compares_with_the_releases_of_vllm_env(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    asked: list[str] = []

    def registry(python_version: str) -> list[str]:
        asked.append(python_version)
        return ["99.0.0"]

    monkeypatch.setattr(newest, "registry_versions", registry)
    assert matrix.main(["newest"]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [
        f"newest: the registry holds vLLM 99.0.0, newer than the matrix's newest release "
        f"{vllm_env.RELEASES[-1]} (tools/vllm_env.py RELEASES); see docs/releasing.md"
    ]
    assert asked == ["3.11"]
    monkeypatch.setattr(newest, "registry_versions", lambda python_version: [vllm_env.RELEASES[-1]])
    assert matrix.main(["newest", "--python-version", "3.12"]) == 0


def test_matrix_newest_exits_2_when_the_registry_cannot_be_asked(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def unreachable(python_version: str) -> list[str]:
        raise newest.RegistryError("uv pip compile exited 2: no network")

    monkeypatch.setattr(newest, "registry_versions", unreachable)
    assert matrix.main(["newest"]) == 2
    said = capsys.readouterr().out
    assert said == "newest: could not ask the registry: uv pip compile exited 2: no network\n"


def _result(*answers: tuple[str, str]) -> dict[str, Any]:
    return {
        "vllm": {"version": "0.34.0"},
        "results": [
            {"fix": fix, "answer": answer, "reason": f"why {fix}", "shape": None, "checks": []}
            for fix, answer in answers
        ],
        "summary": "vLLM 0.34.0: ...",
    }


def test_each_fix_that_does_not_work_is_one_line_with_its_reason() -> None:
    result = _result(
        ("mr-extent", "cannot check"),
        ("bind-failure", "affected → fixed"),
        ("listener-port", "refused"),
        ("handshake-port", "fixed upstream"),
        ("read-eligibility", "failed to fix"),
        ("k3-eof-flush", "not applicable"),
    )
    assert newest.judge(result, "0.34.0") == [
        "newest 0.34.0: listener-port: refused: why listener-port",
        "newest 0.34.0: mr-extent: cannot check: why mr-extent",
        "newest 0.34.0: read-eligibility: failed to fix: why read-eligibility",
    ]
    assert newest.judge(_result(("a", "affected → fixed"), ("b", "fixed upstream")), "0.34.0") == []


def _fake_verify(monkeypatch: pytest.MonkeyPatch, stdout: str, returncode: int) -> None:
    class Done:
        def __init__(self) -> None:
            self.stdout, self.returncode = stdout, returncode

    monkeypatch.setattr(newest.subprocess, "run", lambda *args, **kwargs: Done())


def test_verify_fails_naming_the_fixes_and_stores_the_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    result = _result(("mr-extent", "cannot check"), ("bind-failure", "affected → fixed"))
    _fake_verify(monkeypatch, json.dumps(result), 1)
    out = tmp_path / "verify.json"
    assert newest.verify("0.34.0", out) == 1
    printed = capsys.readouterr().out.splitlines()
    assert "newest 0.34.0: mr-extent: cannot check: why mr-extent" in printed
    assert "newest 0.34.0: bind-failure: affected → fixed" in printed
    assert json.loads(out.read_text()) == result

    _fake_verify(monkeypatch, json.dumps(_result(("bind-failure", "affected → fixed"))), 0)
    assert newest.verify("0.34.0", out) == 0


def test_verify_fails_on_another_vllm_or_no_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _fake_verify(monkeypatch, json.dumps(_result(("bind-failure", "affected → fixed"))), 0)
    assert newest.verify("0.35.0", tmp_path / "v.json") == 1
    assert "imported vLLM 0.34.0, not 0.35.0" in capsys.readouterr().out
    _fake_verify(monkeypatch, "Traceback ...", 1)
    assert newest.verify("0.34.0", tmp_path / "v.json") == 1
    assert "vllm-fixes verify did not complete (exit 1)" in capsys.readouterr().out


def test_a_release_the_matrix_does_not_know_is_installed_as_the_matrix_installs_a_release(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The machine's index settings (one `pip config` process per command) do not matter here.
    monkeypatch.setattr(vllm_env, "uv_args", lambda: ["--find-links", "/wheels"])
    generic = next(r for r in vllm_env.RELEASES if r not in vllm_env.TARGETS)
    unknown = "99.0.0"
    assert unknown not in vllm_env.ALL_TARGETS
    with pytest.raises(SystemExit, match="unknown vLLM target"):
        vllm_env.install_commands(unknown, "py")
    known = vllm_env.ALL_TARGETS
    with newest.admitted(unknown):
        commands = vllm_env.install_commands(unknown, "py", ["pytest"], compile_bytecode=False)
        others = {t: vllm_env.install_commands(t, "py", ["pytest"]) for t in known}
    assert known == vllm_env.ALL_TARGETS
    expected = vllm_env.install_commands(generic, "py", ["pytest"], compile_bytecode=False)
    assert json.dumps(commands) == json.dumps(expected).replace(f"vllm=={generic}", f"vllm=={unknown}")
    assert others == {t: vllm_env.install_commands(t, "py", ["pytest"]) for t in known}
    with newest.admitted(generic):  # a known release: nothing to let through
        assert vllm_env.ALL_TARGETS is known


def test_a_package_whose_tests_failed_is_one_line_with_the_report_s_counts(tmp_path: Path) -> None:
    report = tmp_path / "newest-demo.xml"
    report.write_text(
        '<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests">'
        '<testsuite name="pytest" errors="2" failures="11" skipped="1" tests="16"></testsuite></testsuites>'
    )
    assert newest.tests_failed("0.34.0", "vllm-fix-demo", report) == (
        f"newest 0.34.0: vllm-fix-demo: its tests failed: 11 failed, 2 errors of 16 ({report})"
    )
    missing = tmp_path / "none.xml"
    assert newest.tests_failed("0.34.0", "vllm-fix-demo", missing) == (
        f"newest 0.34.0: vllm-fix-demo: its tests failed (no report at {missing})"
    )
