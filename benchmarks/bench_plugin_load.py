"""Cost of loading every installed fix's vLLM plugin in a process, before any target module is imported.

Goal: under 20 ms per process. Each sample is a fresh interpreter that imports vLLM (not
measured), then times loading + calling every `vllm_fix_*` entry point of the
`vllm.general_plugins` group, the way vLLM's load_general_plugins() does it, and lists which
of the fixes' trigger and target modules are imported by then (none should be). Run it where
the packages' bytecode is compiled, as an install compiles it.

    python benchmarks/bench_plugin_load.py [--samples 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time
import vllm.plugins  # vLLM itself: not part of the measurement
from importlib.metadata import entry_points
t0 = time.perf_counter()
eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name.startswith("vllm_fix_")]
t1 = time.perf_counter()
for ep in eps:
    ep.load()()
t2 = time.perf_counter()
from vllm_fix_core.registry import installed_fixes
declared = {m for i in installed_fixes() for m in (i.fix.trigger_module, *(t.module for t in i.fix.targets))}
targets = sorted(m for m in declared if m in sys.modules)
print(json.dumps({"n": len(eps), "discover_ms": (t1 - t0) * 1e3, "load_call_ms": (t2 - t1) * 1e3,
                  "target_modules_imported": targets}))
"""


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=5)
    args = parser.parse_args()
    rows = []
    for _ in range(args.samples):
        out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    load = [r["load_call_ms"] for r in rows]
    disc = [r["discover_ms"] for r in rows]
    print(f"fix plugins loaded per process: {rows[0]['n']}")
    print(
        f"load + register, all fixes: median {statistics.median(load):.2f} ms "
        f"(min {min(load):.2f}, max {max(load):.2f}) over {len(rows)} fresh processes; goal < 20 ms"
    )
    print(f"entry-point discovery (vLLM does this anyway): median {statistics.median(disc):.2f} ms")
    print(f"target modules imported by loading: {rows[0]['target_modules_imported'] or 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
