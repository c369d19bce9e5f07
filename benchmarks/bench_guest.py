"""What the fixes add to a vLLM process: resident memory (RSS) and CPU time, fixes on against
VLLM_FIXES_DISABLE=all, the same trigger modules imported in both.

Bounds (issue 33): all fixes together add at most 5 MB RSS and 150 ms CPU to a process.

Each sample is a fresh interpreter seeded as a TP=4 CPU worker's environment is (the guest
test's, integration/test_guest.py, with VLLM_PORT set) that imports vLLM, then runs vLLM's own
``load_general_plugins()`` and imports the trigger modules of its process kind, the way vLLM
would; it reports its CPU time (user + system) from just before the plugins load to the end,
and its RSS at the end (and the peak). Samples alternate between fixes on and off, round by
round, so drift on a shared machine hits both; the figures are medians.

Process kinds: ``worker`` imports every fix's trigger module (the worker-like process of the
guest test); ``engine-core`` and ``api-server`` import the trigger modules of the fixes that
decide in that kind of process (a fix decides wherever its trigger module is imported: the kinds
of its own targets, and every kind with a target of any fix in that module; see
bench_decision.py). ``--per-fix`` adds, in the worker-like process, each fix alone
(``VLLM_FIXES_DISABLE`` naming every other fix) against all off.

The decisions use ``VLLM_CACHE_ROOT`` as it is set (a fix may keep what it learnt about this
vLLM there: sync-load-zeroing's coverage memo); the first process on a machine may pay more.

    python benchmarks/bench_guest.py [--rounds 5] [--kinds worker,engine-core,api-server] [--per-fix]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

BOUND_RSS_MB = 5.0
BOUND_CPU_MS = 150.0

CHILD = r"""
import importlib, json, os, resource, sys, time

def rss_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0

def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

import vllm.plugins  # vLLM itself: not part of the measurement
from vllm_fix_core import runtime

# Each decision's own share, where the fixes decide (runtime.evaluate, wrapped for the figures).
split = {}
evaluate = runtime.evaluate
def timed(fix, *args, **kwargs):
    c, r = cpu(), rss_kb("VmRSS")
    try:
        return evaluate(fix, *args, **kwargs)
    finally:
        cpu_ms, rss_mb = split.get(fix.id, (0.0, 0.0))
        split[fix.id] = (cpu_ms + (cpu() - c) * 1e3, rss_mb + (rss_kb("VmRSS") - r) / 1024)
runtime.evaluate = timed
rss0, cpu0, wall0 = rss_kb("VmRSS"), cpu(), time.perf_counter()
vllm.plugins.load_general_plugins()
for module in sys.argv[1].split(","):
    importlib.import_module(module)
cpu1, wall1 = cpu(), time.perf_counter()
print(json.dumps({
    "cpu_ms": (cpu1 - cpu0) * 1e3,
    "wall_ms": (wall1 - wall0) * 1e3,
    "process_cpu_ms": cpu1 * 1e3,
    "rss_mb": rss_kb("VmRSS") / 1024,
    "rss_before_mb": rss0 / 1024,
    "hwm_mb": rss_kb("VmHWM") / 1024,
    "decisions": {fid: d.answer.value for fid, d in runtime.decisions().items()},
    "split": split,
}))
"""


def _fixes() -> list[Any]:
    from vllm_fix_core.registry import installed_fixes

    return [item.fix for item in installed_fixes()]


def decide_kinds(fixes: list[Any]) -> dict[str, set[str]]:
    """Per fix id, the process kinds it decides in (as bench_decision.py counts them)."""
    module_kinds: dict[str, set[str]] = {}
    for fix in fixes:
        for target in fix.targets:
            module_kinds.setdefault(target.module, set()).add(target.process.value)
    return {
        fix.id: {p.value for p in fix.processes} | module_kinds.get(fix.trigger_module, set())
        for fix in fixes
    }


def triggers(fixes: list[Any], kind: str) -> list[str]:
    """The trigger modules a process of `kind` imports, in the fixes' order."""
    if kind == "worker":
        chosen = fixes
    else:
        kinds = decide_kinds(fixes)
        chosen = [f for f in fixes if kind in kinds[f.id]]
    return list(dict.fromkeys(f.trigger_module for f in chosen))


def sample(modules: list[str], disable: str, port: int) -> dict[str, Any]:
    from _guest_process import WORKER_ENV

    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_FIXES_")}
    env.update(WORKER_ENV, VLLM_PORT=str(port), MASTER_PORT=str(port + 1))
    if disable:
        env["VLLM_FIXES_DISABLE"] = disable
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, ",".join(modules)], capture_output=True, text=True, env=env, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"sample failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def compare(
    modules: list[str], on_disable: str, rounds: int, port: int
) -> tuple[dict[str, float], dict[str, float], dict[str, str], dict[str, tuple[float, float]]]:
    """Medians (fixes on, all off) of each figure over `rounds` interleaved pairs of samples, and
    the median (CPU ms, RSS MB) each fix's decision took in the samples with the fixes on."""
    on: list[dict[str, Any]] = []
    off: list[dict[str, Any]] = []
    for i in range(rounds):
        pair = [("on", on_disable), ("off", "all")]
        for which, disable in pair if i % 2 == 0 else reversed(pair):
            (on if which == "on" else off).append(sample(modules, disable, port))
    keys = ("cpu_ms", "wall_ms", "process_cpu_ms", "rss_mb", "hwm_mb")
    return (
        {k: statistics.median(r[k] for r in on) for k in keys},
        {k: statistics.median(r[k] for r in off) for k in keys},
        on[-1]["decisions"],
        {
            fid: (
                statistics.median(r["split"][fid][0] for r in on),
                statistics.median(r["split"][fid][1] for r in on),
            )
            for fid in on[-1]["split"]
        },
    )


def verdict(value: float, bound: float) -> str:
    return "within" if value <= bound else "OVER"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5, help="interleaved on/off pairs per figure")
    parser.add_argument("--kinds", default="worker,engine-core,api-server")
    parser.add_argument("--per-fix", action="store_true", help="each fix alone, in the worker-like process")
    args = parser.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integration"))
    from _guest_process import free_configured_port

    fixes = _fixes()
    ids = [f.id for f in fixes]
    port = free_configured_port()
    print(f"{len(fixes)} fixes; medians of {args.rounds} interleaved on/off samples per row")
    print(
        f"bounds for all fixes together: <= {BOUND_RSS_MB:.0f} MB RSS, "
        f"<= {BOUND_CPU_MS:.0f} ms CPU per process"
    )
    header = (
        f"{'process':<36} {'CPU on':>9} {'CPU off':>9} {'+CPU':>9} {'ratio':>6}  "
        f"{'RSS on':>8} {'RSS off':>8} {'+RSS':>8} {'ratio':>6}  {'+peak':>7}"
    )
    print(header)
    rows: list[tuple[str, list[str], str]] = [
        (f"{kind} (all fixes)", triggers(fixes, kind), "") for kind in args.kinds.split(",") if kind
    ]
    if args.per_fix:
        every = triggers(fixes, "worker")
        rows += [(f"worker: {fid} alone", every, ",".join(i for i in ids if i != fid)) for fid in ids]
    splits: dict[str, dict[str, tuple[float, float]]] = {}
    for name, modules, disable in rows:
        on, off, decisions, split = compare(modules, disable, args.rounds, port)
        if not disable:
            splits[name] = split
        cpu, rss = on["cpu_ms"] - off["cpu_ms"], on["rss_mb"] - off["rss_mb"]
        line = (
            f"{name:<36} {on['cpu_ms']:>7.0f}ms {off['cpu_ms']:>7.0f}ms {cpu:>+7.0f}ms "
            f"{on['cpu_ms'] / off['cpu_ms']:>6.2f}  {on['rss_mb']:>6.1f}MB {off['rss_mb']:>6.1f}MB "
            f"{rss:>+6.1f}MB {on['rss_mb'] / off['rss_mb']:>6.3f}  {on['hwm_mb'] - off['hwm_mb']:>+5.1f}MB"
        )
        if not disable:
            line += f"   CPU {verdict(cpu, BOUND_CPU_MS)}, RSS {verdict(rss, BOUND_RSS_MB)} the bounds"
            decided = sorted(
                fid for fid, answer in decisions.items() if answer not in ("pending", "disabled")
            )
            line += f"; decided: {len(decided)} ({', '.join(decided)})"
        print(line, flush=True)
    for name, split in splits.items():
        print(
            f"each decision's own share in {name} (CPU ms / RSS growth MB while it ran; shared imports "
            "count for the first fix that needs them):"
        )
        for fid, (cpu_ms, rss_mb) in sorted(split.items(), key=lambda kv: -kv[1][0]):
            print(f"  {fid:<26} {cpu_ms:>7.0f} ms {rss_mb:>+7.1f} MB")
    print(
        "CPU: user + system time from the plugins' load to the last trigger import (vLLM's own imports "
        "of those modules are in both); RSS at the end, +peak the high-water mark's difference"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
