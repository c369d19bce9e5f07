"""Cost of each fix's decision in a fresh process: probe + recognize + apply + re-probe.

Goal: under 50 ms per fix, under 150 ms for all fixes that decide in one vLLM process.

A fix decides when vLLM imports its trigger module, so in every process kind that imports it
(``decide_kinds``): the kinds its own targets are in, and every kind in which any fix has a
target in that module (the MoRIIO connector module holds engine-core and worker targets, so
both import it, and every fix triggered by it decides in both, whatever its own targets). What
vLLM has imported by then is vLLM's own cost, not the fix's, so each sample is a fresh
interpreter that first imports (not measured):

* the trigger and target modules, and
* the module that starts that kind of vLLM process ("in a vLLM process" column): the engine
  core (``vllm.v1.engine.core``), the GPU worker (``vllm.v1.worker.gpu_worker``), the OpenAI
  server (``vllm.entrypoints.openai.api_server``, or what of it this environment can import),

then times the ladder (``evaluate(fix, apply=True)``). The "cold" column imports only the
trigger and targets: whatever else a probe needs is charged to the fix.

Children run with their own ``VLLM_CACHE_ROOT`` (a temporary folder), where a fix may keep what
it learnt about this vLLM install (sync-load-zeroing's coverage memo). The medians use a root
an earlier sample has filled, as every process after the first one on a machine does; the
"first process" column is one sample in an empty root, as the first process after installing
or upgrading vLLM meets it. The "after workers" column (engine-core fixes) is the realistic
first engine core of a multi-process engine: vLLM starts the engine core's workers (which
import the fixes' MoRIIO triggers too, and decide there) before the engine core builds the
scheduler that imports them, so per sample, in an empty root, a worker-context sample of the
same fixes runs first (it may fill the root) and the engine-core sample after it is timed;
median over the samples, as the figure is small and one sample is noisy. Each fix's figure is
its worst process kind. "All fixes in one process" runs every fix that decides in that kind of
process, in turn, in one interpreter, plus the cold case of all eleven in one. Run it where the
packages' bytecode is compiled, as an install compiles it (an editable checkout under
PYTHONDONTWRITEBYTECODE=1 compiles every fix module in every sample).

    python benchmarks/bench_decision.py [--samples 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_fix_core import Fix

# The module vLLM imports first in each process kind (its entry point), where importable.
CONTEXT = {
    "engine-core": ("vllm.v1.engine.core",),
    "worker": ("vllm.v1.worker.gpu_worker",),
    "api-server": ("vllm.engine.arg_utils", "vllm.entrypoints.openai.api_server"),
}

CHILD = r"""
import importlib, json, sys, time, logging
logging.disable(logging.CRITICAL)
from vllm_fix_core import Settings, evaluate
from vllm_fix_core.registry import installed_fixes
wanted = set(sys.argv[1].split(","))
context = [m for m in sys.argv[2].split(",") if m]
fixes = [i.fix for i in installed_fixes() if "all" in wanted or i.fix.id in wanted]
missing = []
for module in context:
    try:
        importlib.import_module(module)
    except Exception as exc:
        missing.append(f"{module}: {exc!r}"[:120])
for fix in fixes:
    for module in (fix.trigger_module, *(t.module for t in fix.targets)):
        try:
            importlib.import_module(module)
        except Exception:
            pass
# As timeit does: the imports above leave a full garbage collection due, which would land in
# whichever decision allocates next (300+ ms on vLLM 0.33.0) and is owed to vLLM's imports.
import gc
gc.collect()
settings = Settings(disabled=frozenset(), strict=False)
out = {}
t_all = time.perf_counter()
for fix in fixes:
    t0 = time.perf_counter()
    decision = evaluate(fix, settings, apply=True)
    out[fix.id] = {"ms": (time.perf_counter() - t0) * 1e3, "answer": decision.answer.value}
print(json.dumps({"fixes": out, "all_ms": (time.perf_counter() - t_all) * 1e3, "missing": missing}))
"""


ROOTS = tempfile.mkdtemp(prefix="bench-decision-")  # removed at the end
WARM_ROOT = os.path.join(ROOTS, "warm")


def empty_root() -> str:
    return tempfile.mkdtemp(dir=ROOTS)


def after_workers(which: str, samples: int, key: str | None) -> tuple[float, float]:
    """The first engine core of a multi-process engine, which decides after its workers
    started: per sample, in an empty root, a worker-context sample, then an engine-core one.
    Medians (the workers', the engine core's) of `key`'s ms, or of all of them if None."""
    workers: list[float] = []
    engines: list[float] = []
    for _ in range(samples):
        root = empty_root()
        for rows, kind in ((workers, "worker"), (engines, "engine-core")):
            row = sample(which, CONTEXT[kind], root)
            rows.append(float(row["all_ms"] if key is None else row["fixes"][key]["ms"]))
    return statistics.median(workers), statistics.median(engines)


def decide_kinds(fixes: list[Fix]) -> dict[str, list[str]]:
    """Per fix id, the process kinds it decides in: those of its own targets, plus every kind
    with a target (of any fix) in its trigger module, as such a process imports that module."""
    module_kinds: dict[str, set[str]] = {}
    for fix in fixes:
        for target in fix.targets:
            module_kinds.setdefault(target.module, set()).add(target.process.value)
    return {
        fix.id: sorted({p.value for p in fix.processes} | module_kinds.get(fix.trigger_module, set()))
        for fix in fixes
    }


def sample(which: str, context: tuple[str, ...], root: str = WARM_ROOT) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, which, ",".join(context)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "VLLM_CACHE_ROOT": root},
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def median_ms(
    which: str, context: tuple[str, ...], samples: int, key: str | None
) -> tuple[float, str, list[str]]:
    rows = [sample(which, context) for _ in range(samples)]
    if key is None:
        values = [float(r["all_ms"]) for r in rows]
        answer = ""
    else:
        values = [float(r["fixes"][key]["ms"]) for r in rows]
        answer = str(rows[0]["fixes"][key]["answer"])
    return statistics.median(values), answer, list(rows[0]["missing"])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=3)
    args = parser.parse_args()
    from vllm_fix_core.registry import installed_fixes

    fixes = [i.fix for i in installed_fixes()]
    kinds = decide_kinds(fixes)
    missing: set[str] = set()
    sample("all", ())  # fills WARM_ROOT, as the first vLLM process on a machine does
    print(f"median ms over {args.samples} fresh processes each (goal < 50 per fix)")
    print(
        f"{'fix':24} {'answer':18} {'cold':>7} {'in a vLLM process (worst kind)':>32} {'first process':>14}"
        f" {'after workers':>14}"
    )
    for fix in fixes:
        cold, answer, _ = median_ms(fix.id, (), args.samples, fix.id)
        worst, worst_kind = 0.0, ""
        for kind in kinds[fix.id]:
            ms, _, gone = median_ms(fix.id, CONTEXT[kind], args.samples, fix.id)
            missing.update(gone)
            if ms >= worst:
                worst, worst_kind = ms, kind
        first = sample(fix.id, CONTEXT[worst_kind], empty_root())
        first_ms = float(first["fixes"][fix.id]["ms"])
        after = "-"  # only an engine core decides after workers of its own
        if "engine-core" in kinds[fix.id]:
            after = f"{after_workers(fix.id, args.samples, fix.id)[1]:.1f}"
        print(
            f"{fix.id:24} {answer:18} {cold:7.1f} {worst:13.1f}  ({worst_kind:11})"
            f" {first_ms:14.1f} {after:>14}"
        )
    print("all fixes that decide in one process (goal < 150):")
    for kind, context in CONTEXT.items():
        ids = [f.id for f in fixes if kind in kinds[f.id]]
        ms, _, gone = median_ms(",".join(ids), context, args.samples, None)
        missing.update(gone)
        first_all = float(sample(",".join(ids), context, empty_root())["all_ms"])
        print(
            f"  {kind:12} {len(ids):2} fixes {ms:7.1f} ms, first process {first_all:7.1f}  ({', '.join(ids)})"
        )
        if kind == "engine-core":
            worker_ms, engine_ms = after_workers(",".join(ids), args.samples, None)
            print(
                f"  {'':12} first engine core after its workers {engine_ms:7.1f} ms"
                f" (its workers, deciding the same {len(ids)} fixes first: {worker_ms:.1f} ms)"
            )
    cold_all, _, _ = median_ms("all", (), args.samples, None)
    print(f"  cold, all {len(fixes)} fixes in one interpreter: {cold_all:.1f} ms")
    for line in sorted(missing):
        print(f"  (context module not importable here, left out: {line})")
    shutil.rmtree(ROOTS, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
