"""`vllm-fixes list/status/verify` against an installed (fake) fix distribution, in subprocesses,
and VLLM_PLUGINS as real vLLM applies it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from vllm_fix_core import runtime
from vllm_fix_core.cli import VLLM_PLUGINS_WARNING
from vllm_fix_core.ladder import Answer, Decision

# The rest runs on synthetic targets; these need vLLM's own plugin loader or its version header.
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs an installed vLLM")


@pytest.fixture
def fake_dist(demo: Any, tmp_path: Path) -> dict[str, str]:
    """A dist-info on PYTHONPATH registering the demo fix in both entry-point groups."""
    (tmp_path / "demo_decl.py").write_text(
        "from vllm_fix_core.declaration import *\n"
        f"FIX = Fix(id={demo.fix.id!r}, title='demo', distribution='vllm-fix-demo',"
        " upstream=(Upstream(1, UpstreamStatus.PENDING),), why='w', how='h', retire_when='r',"
        f" targets=(Target({demo.module!r}, 'Widget.compute', ProcessKind.WORKER),),"
        f" links=lambda: Links(*(getattr(__import__({demo.fix_module!r}), n)"
        " for n in ('probe', 'recognize', 'apply'))))\n"
        "def register():\n"
        "    from vllm_fix_core.runtime import install\n"
        "    install(FIX)\n"
    )
    info = tmp_path / "vllm_fix_demo-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-fix-demo\nVersion: 0.0.1\n")
    (info / "entry_points.txt").write_text(
        f"[vllm.general_plugins]\n{demo.fix.entry_point} = demo_decl:register\n\n"
        f"[vllm_fixes]\n{demo.fix.id} = demo_decl:FIX\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    env.pop("VLLM_PLUGINS", None)
    return env


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "vllm_fix_core.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def only_demo(items: list[dict[str, Any]], demo: Any) -> dict[str, Any]:
    return next(i for i in items if i["fix"] == demo.fix.id)


def test_list_json(fake_dist: dict[str, str], demo: Any) -> None:
    out = cli(fake_dist, "list", "--json")
    assert out.returncode == 0, out.stderr
    item = only_demo(json.loads(out.stdout), demo)
    assert item["version"] == "0.0.1" and item["entry_point"] == demo.fix.entry_point
    assert item["upstream"][0]["url"].endswith("/pull/1")


def test_status_reports_rung_and_vllm_plugins(fake_dist: dict[str, str], demo: Any) -> None:
    out = cli(fake_dist, "status", "--json")
    data = json.loads(out.stdout)
    row = only_demo(data["fixes"], demo)
    assert row["answer"] == "would fix"
    assert row["checks"] == {"off-by-one": True, "negatives-stay-negative": False}
    assert row["plugin_loaded_by_vllm"] is True and data["warnings"] == []
    env = {**fake_dist, "VLLM_PLUGINS": "some_other_plugin", "VLLM_FIXES_DISABLE": demo.fix.id}
    data = json.loads(cli(env, "status", "--json").stdout)
    row = only_demo(data["fixes"], demo)
    assert row["answer"] == "disabled"
    assert row["plugin_loaded_by_vllm"] is False and "not named" in row["vllm_plugins"]
    assert data["warnings"] == [VLLM_PLUGINS_WARNING]
    text = cli(env, "status").stdout
    assert "WARNING: VLLM_PLUGINS is set" in text


def test_verify_table_and_exit_codes(fake_dist: dict[str, str], demo: Any, tmp_path: Path) -> None:
    out = cli(fake_dist, "verify", "--json", "--fix", demo.fix.id)
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(out.stdout)["results"][0]
    assert result["answer"] == "affected → fixed"
    # A fix that does not fix: verify fails (non-zero exit) and says so.
    fix_src = tmp_path / f"{demo.fix_module}.py"
    fix_src.write_text(fix_src.read_text().replace('"mode": "good"', '"mode": "ineffective"'))
    out = cli(fake_dist, "verify", "--fix", demo.fix.id)
    assert out.returncode == 1
    assert "failed to fix" in out.stdout
    assert out.stdout.strip().splitlines()[-1].endswith("0 cannot check, 1 failed to fix") or (
        "1 failed to fix" in out.stdout.strip().splitlines()[-1]
    )
    unknown = cli(fake_dist, "verify", "--fix", "no-such-fix")
    assert unknown.returncode == 2
    assert "no-such-fix" in unknown.stderr and demo.fix.id in unknown.stderr  # lists the valid ids


@needs_vllm
def test_vllm_plugins_filter_matches_real_vllm(fake_dist: dict[str, str], demo: Any) -> None:
    """What `status` says about VLLM_PLUGINS is what vLLM's own loader does."""
    cases: list[tuple[str | None, bool]] = [
        (None, True),
        ("some_other_plugin", False),
        (demo.fix.entry_point, True),
    ]
    code = (
        "import json, os, sys\n"
        "from vllm.plugins import load_plugins_by_group as load\n"
        "out = []\n"
        "for allowed in json.loads(sys.argv[1]):\n"
        "    os.environ.pop('VLLM_PLUGINS', None)\n"
        "    if allowed is not None: os.environ['VLLM_PLUGINS'] = allowed\n"
        "    out.append(sorted(load('vllm.general_plugins')))\n"
        "print(json.dumps(out))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps([a for a, _ in cases])],
        env=fake_dist,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    loaded_by_vllm = json.loads(proc.stdout.strip().splitlines()[-1])
    for (allowed, expected), names in zip(cases, loaded_by_vllm, strict=True):
        assert (demo.fix.entry_point in names) is expected
        env = dict(fake_dist)
        if allowed is not None:
            env["VLLM_PLUGINS"] = allowed
        status = json.loads(cli(env, "status", "--json", "--fix", demo.fix.id).stdout)
        assert status["fixes"][0]["plugin_loaded_by_vllm"] is expected


def test_bad_switch_values_are_loud(fake_dist: dict[str, str], demo: Any) -> None:
    out = cli({**fake_dist, "VLLM_FIXES_STRICT": "2"}, "status")
    assert out.returncode == 2 and "VLLM_FIXES_STRICT" in out.stderr
    out = cli({**fake_dist, "VLLM_FIXES_DISABLE": "no-such-fix"}, "status", "--json")
    warnings = json.loads(out.stdout)["warnings"]
    assert any("no-such-fix" in w and demo.fix.id in w for w in warnings)


@needs_vllm
def test_json_stdout_is_only_json_and_ends_with_a_summary_line(fake_dist: dict[str, str], demo: Any) -> None:
    for command in ("status", "verify"):
        out = cli(fake_dist, command, "--json", "--fix", demo.fix.id)
        data = json.loads(out.stdout)  # nothing else on stdout
        assert data["summary"].startswith(f"vLLM {data['vllm']['version']}: 1 fix — ")
        text = cli(fake_dist, command, "--fix", demo.fix.id).stdout.strip().splitlines()
        assert text[0].startswith(f"vLLM {data['vllm']['version']} (") and data["vllm"]["path"] in text[0]
        assert text[-1] == data["summary"]


def test_verify_writes_the_report(fake_dist: dict[str, str], demo: Any, tmp_path: Path) -> None:
    """`verify` honours VLLM_FIXES_REPORT: one line per decision, the runtime's own record."""
    report = tmp_path / "report.jsonl"
    env = {**fake_dist, "VLLM_FIXES_REPORT": str(report)}
    for _ in range(2):  # a second run appends
        out = cli(env, "verify", "--json", "--fix", demo.fix.id)
        assert out.returncode == 0, out.stdout + out.stderr
    lines = [json.loads(line) for line in report.read_text().splitlines()]
    assert [(r["fix"], r["answer"]) for r in lines] == [(demo.fix.id, "affected → fixed")] * 2
    assert lines[0]["pid"] != lines[1]["pid"] != os.getpid()
    assert set(lines[0]) == set(runtime.report_record(Decision("x", Answer.AFFECTED_FIXED, "r")))
    assert lines[0]["reason"] == json.loads(out.stdout)["results"][0]["reason"]


def test_verify_with_an_unwritable_report_warns_and_answers(
    fake_dist: dict[str, str], demo: Any, tmp_path: Path
) -> None:
    env = {**fake_dist, "VLLM_FIXES_REPORT": str(tmp_path / "missing" / "report.jsonl")}
    out = cli(env, "verify", "--json", "--fix", demo.fix.id)
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads(out.stdout)["results"][0]["answer"] == "affected → fixed"  # stdout: only JSON
    assert out.stderr.count("cannot be written") == 1, out.stderr


ENVIRON_CHECK = """
from vllm.platforms import current_platform
from vllm.plugins import load_general_plugins
load_general_plugins()
try:
    current_platform.validate_environ(True)  # what --fail-on-environ-validation runs
except ValueError as exc:
    print("refused:", exc)
else:
    print("accepted")
"""


@needs_vllm
def test_vllm_plugins_empty_with_a_switch_set_fails_vllms_environ_check(
    fake_dist: dict[str, str], demo: Any
) -> None:
    """What the README says: our variables are known to vLLM only once our plugin has loaded, so
    `VLLM_PLUGINS=` with a VLLM_FIXES_* variable set makes vLLM refuse to start under
    --fail-on-environ-validation; VLLM_FIXES_DISABLE=all (plugins loaded) or unsetting is accepted."""
    base = {k: v for k, v in fake_dist.items() if not k.startswith("VLLM_FIXES_")}

    def check(**env: str) -> str:
        proc = subprocess.run(
            [sys.executable, "-c", ENVIRON_CHECK],
            env={**base, **env},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout.strip().splitlines()[-1]

    refused = check(VLLM_PLUGINS="", VLLM_FIXES_DISABLE=demo.fix.id)
    assert refused.startswith("refused:") and "VLLM_FIXES_DISABLE" in refused
    assert check(VLLM_FIXES_DISABLE="all") == "accepted"
    assert check(VLLM_PLUGINS="") == "accepted"
