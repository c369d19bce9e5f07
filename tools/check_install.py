"""Run inside an operator's environment after the documented install: is it what the README says?

- every fix package and the core are installed, the test-support package is not;
- `vllm-fixes status` exits 0, writes only JSON with --json, and no fix says "cannot check"
  (a target that does not import means the environment is broken, e.g. msgpack is missing);
- the text output ends with the summary line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import distributions
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workspace


def main() -> int:
    installed = {d.metadata["Name"].lower() for d in distributions()}
    expected = {p.name for p in workspace.packages() if p.fix_id} | {workspace.CORE, workspace.META}
    missing = expected - installed
    assert not missing, f"not installed by `pip install vllm-fixes`: {sorted(missing)}"
    assert "vllm-fix-testing" not in installed, "the test-support package was installed"
    exe = str(Path(sys.executable).parent / "vllm-fixes")
    out = subprocess.run([exe, "status", "--json"], capture_output=True, text=True, check=False)
    assert out.returncode == 0, f"status exited {out.returncode}: {out.stdout[-2000:]} {out.stderr[-2000:]}"
    data = json.loads(out.stdout)
    answers = {f["fix"]: f["answer"] for f in data["fixes"]}
    assert "cannot check" not in answers.values(), answers
    assert set(answers) == {p.fix_id for p in workspace.packages() if p.fix_id}, answers
    text = subprocess.run([exe, "status"], capture_output=True, text=True, check=True).stdout
    assert text.strip().splitlines()[-1] == data["summary"], text[-500:]
    print(text)
    print(f"install check: {len(answers)} fixes installed from the wheelhouse; {data['summary']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
