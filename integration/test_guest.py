"""Probes are guests: a worker-like vLLM process with every fix loaded and every trigger module
imported is the same as one under VLLM_FIXES_DISABLE=all, apart from each fix's decision line.

Two fresh processes (integration/_guest_process.py), run side by side, each seeded as a TP=4 CPU
worker's environment is (LOCAL_WORLD_SIZE=4, VLLM_WORKER_MULTIPROC_METHOD=fork, RANK, ...: what
vLLM's CPU platform hook would rewrite) with VLLM_PORT set to a free port below the kernel's
ephemeral range, every bind traced and vLLM's log captured at INFO. They must show no difference
in os.environ, the state of every logger, the exception hooks, vLLM's module globals (among them
parallel_state._TP / _WORLD and the MoRIIO connector's IOEngine / MoRIIO_enabled), threads, open
descriptors, torch settings, random-generator states, signal handlers, vLLM's log lines at INFO
and what the process printed; and the fixes' process binds neither VLLM_PORT nor a port outside
the ephemeral range. Where a difference remains, the message names the fix whose decision made it.

The negative controls put each kind of leak back, through a probe-like callable run by the core's
``ladder.run_probe`` (inside its guest context) in the baseline process after its snapshot, and
show that the same comparison catches it: each kind a leak that outlives the guest context.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from vllm_fix_core.registry import Installed

HERE = Path(__file__).resolve().parent


def _helper() -> Any:
    """integration/_guest_process.py, the child's script, for its comparison (nothing runs)."""
    spec = importlib.util.spec_from_file_location("_guest_process", HERE / "_guest_process.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


guest = _helper()
LEAKS: dict[str, tuple[Any, bool, str, str]] = guest.LEAKS


def _start(out: Path, env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(HERE / "_guest_process.py"), str(out), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture(scope="module")
def processes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("guest")
    port = guest.free_configured_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_FIXES_")}
    env.update(guest.WORKER_ENV, VLLM_LOGGING_LEVEL="INFO", VLLM_PORT=str(port), MASTER_PORT=str(port + 1))
    started = time.monotonic()
    children = {
        "fixes": _start(tmp / "fixes.json", env),
        "baseline": _start(tmp / "baseline.json", {**env, "VLLM_FIXES_DISABLE": "all"}, "--leaks"),
    }
    found: dict[str, Any] = {"port": port}
    try:
        for name, child in children.items():
            stdout, stderr = child.communicate(timeout=900)
            assert child.returncode == 0, f"{name} process failed:\n{stdout[-3000:]}\n{stderr[-3000:]}"
            found[name] = json.loads((tmp / f"{name}.json").read_text())
            found[name]["stdout"], found[name]["stderr"] = stdout, stderr
    finally:
        for child in children.values():
            if child.poll() is None:
                child.kill()
                child.wait()
    found["wall_s"] = time.monotonic() - started
    return found


def _culprits(difference: str, per_fix: dict[str, list[str]], imported_by: dict[str, list[str]]) -> list[str]:
    """The fixes whose decision made this difference (what each decision changed in the process;
    for a line only the baseline logged, the decision that first imported the logging module)."""
    tagged = re.search(r"during ([a-z0-9-]+)", difference)
    if tagged:
        return [tagged.group(1)]
    missing = re.match(r"log: only in the baseline \(x\d+\): \w+ ([\w.]+):", difference)
    if missing:
        return [fid for fid, modules in imported_by.items() if missing.group(1) in modules]
    key = difference.split(": fixes ", 1)[0]
    key = re.sub(r"^(\w+: only with the fixes) \(x\d+\)", r"\1", key)
    return [
        fid
        for fid, changes in per_fix.items()
        if any(re.sub(r"^(\w+: only with the fixes) \(x\d+\)", r"\1", c).startswith(key) for c in changes)
    ]


def test_every_fix_decided_in_the_fixes_process_and_none_in_the_baseline(
    processes: dict[str, Any], fixes: list[Installed]
) -> None:
    ids = {i.fix.id for i in fixes}
    decided = processes["fixes"]["decisions"]
    assert set(decided) == ids
    # The comparison means something only where every probe ran: no fix waits for its trigger.
    assert {fid: a for fid, a in decided.items() if a in ("pending", "disabled", "cannot check")} == {}
    assert processes["baseline"]["decisions"] == {fid: "disabled" for fid in ids}


def test_a_worker_process_is_the_same_with_the_fixes_as_without(processes: dict[str, Any]) -> None:
    fixes, baseline = processes["fixes"], processes["baseline"]
    differences = guest.compare(
        fixes["snapshot"],
        baseline["snapshot"],
        vllm_port=processes["port"],
        ephemeral=guest.ephemeral_range(),
    )
    differences += guest.compare_output(fixes["stdout"], baseline["stdout"])
    differences += guest.compare_output(fixes["stderr"], baseline["stderr"])
    imported = sorted(set(fixes["modules"]) - set(baseline["modules"]))
    report = [
        f"{d}\n    from: {', '.join(_culprits(d, fixes['per_fix'], fixes['imported_by'])) or '?'}"
        for d in differences
    ]
    print(f"guest test: both processes in {processes['wall_s']:.0f} s; vLLM modules only the fixes imported:")
    print(f"  {', '.join(imported) or 'none'}")
    # A module first imported inside a probe runs its import-time code as the probe's guest.
    imports = "; ".join(f"{fid}: {', '.join(mods)}" for fid, mods in fixes["imported_by"].items())
    assert not differences, (
        f"{len(differences)} differences between a worker process with the fixes and one under "
        "VLLM_FIXES_DISABLE=all:\n" + "\n".join(report) + f"\nvLLM modules first imported by a "
        f"decision: {imports or 'none'}"
    )


@pytest.mark.parametrize("kind", sorted(LEAKS))
def test_the_comparison_catches_a_leak_that_outlives_the_guest_context(
    processes: dict[str, Any], kind: str
) -> None:
    _, _, category, names = LEAKS[kind]
    differences = processes["baseline"]["leaks"][kind]
    assert any(d.startswith(category) and names in d for d in differences), (kind, differences)
