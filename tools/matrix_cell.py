"""One release-matrix cell in one process: `vllm-fixes verify --json`, then the per-target check.

    python tools/matrix_cell.py --verify-out VERIFY.json --hostile-out HOSTILE.json

Both steps import the same vLLM once. The verify result is what `vllm-fixes verify --json`
prints; the per-target result is one entry per fix this release needs: each patched target,
undone alone (vLLM's original layered over it), "observed" when verification then fails.
`tools/matrix.py record --hostile` compares and judges both. Exits 0 unless a step crashed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--verify-out", type=Path, required=True)
    parser.add_argument("--hostile-out", type=Path, required=True)
    args = parser.parse_args(argv)

    from vllm_fix_core import cli
    from vllm_fix_testing import hostile

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli.main(["verify", "--json"])  # its exit status: judged by `matrix.py record`
    args.verify_out.write_text(out.getvalue())
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        hostile.main([])
    entries = [json.loads(line) for line in out.getvalue().splitlines() if line.startswith("{")]
    args.hostile_out.write_text(json.dumps(entries, indent=2, ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
