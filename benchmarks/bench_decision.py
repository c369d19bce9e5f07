"""Cost of each fix's decision in a fresh process: probe + recognize + apply + re-probe.

Goal: under 50 ms per fix, under 150 ms for all fixes in one process. Each sample is a fresh
interpreter that first imports every fix's target modules (vLLM imports them anyway; not
measured), then times the ladder (`evaluate(fix, apply=True)`) for one fix, or for all of them
in turn.

    python benchmarks/bench_decision.py [--samples 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = r"""
import importlib, json, sys, time, logging
logging.disable(logging.CRITICAL)
from vllm_fix_core import Settings, evaluate
from vllm_fix_core.registry import installed_fixes
wanted = sys.argv[1]
fixes = [i.fix for i in installed_fixes() if wanted in ("all", i.fix.id)]
for fix in fixes:
    for target in fix.targets:
        try:
            importlib.import_module(target.module)   # vLLM's own import: not measured
        except Exception:
            pass
settings = Settings(disabled=frozenset(), strict=False)
out = {}
t_all = time.perf_counter()
for fix in fixes:
    t0 = time.perf_counter()
    decision = evaluate(fix, settings, apply=True)
    out[fix.id] = {"ms": (time.perf_counter() - t0) * 1e3, "rung": decision.rung.value}
print(json.dumps({"fixes": out, "all_ms": (time.perf_counter() - t_all) * 1e3}))
"""


def sample(which: str) -> dict[str, object]:
    proc = subprocess.run([sys.executable, "-c", CHILD, which], capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=3)
    args = parser.parse_args()
    from vllm_fix_core.registry import installed_fixes

    ids = [i.fix.id for i in installed_fixes()]
    print(f"{'fix':28} {'rung':18} median ms (fresh process each, {args.samples} samples; goal < 50)")
    for fix_id in ids:
        rows = [sample(fix_id) for _ in range(args.samples)]
        ms = [r["fixes"][fix_id]["ms"] for r in rows]  # type: ignore[index]
        rung = rows[0]["fixes"][fix_id]["rung"]  # type: ignore[index]
        print(f"{fix_id:28} {rung:18} {statistics.median(ms):8.1f}  (min {min(ms):.1f}, max {max(ms):.1f})")
    totals = [float(sample("all")["all_ms"]) for _ in range(args.samples)]  # type: ignore[arg-type]
    print(f"all {len(ids)} fixes in one process: median {statistics.median(totals):.1f} ms (goal < 150)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
