"""All fixes as vLLM loads them, in one fresh process: lazily, one line per fix."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from vllm_fix_core.registry import Installed


def test_every_fix_decides_once_when_vllm_imports_its_target(fixes: list[Installed]) -> None:
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("_load_all.py"))],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    ids = {i.fix.id for i in fixes}
    # Loading the plugins decided nothing and imported no target: every fix waits for vLLM.
    assert data["after_load"] == {fid: "pending" for fid in ids}
    for fid in ids:
        assert data["decisions"][fid] in ("affected → fixed", "fixed upstream"), (fid, data["lines"].get(fid))
        assert len(data["lines"][fid]) == 1, (fid, data["lines"][fid])
