"""Overhead of vllm-fix-completion-ownership, at two levels, in one process.

1. Function level: CPU thread time spent in ``MultiConnector.get_transfer_results`` (every worker,
   every step) and ``MultiConnector.update_connector_output`` (the scheduler, every step)
   with and without the fix. Workload: a prefill instance with MultiConnector[MoRIIO READ
   producer, X] and 2 workers under async scheduling (``vllm_fix_testing.prefill_instance``:
   real MultiConnector, real MoRIIO scheduler/worker code, real KVOutputAggregator and
   scheduler free loop; X and the RDMA ACK queue are stand-ins): 0-6 new requests per step,
   40 % owned by MoRIIO, 40 % by MoRIIO and X, 20 % by nobody. Unpatched vLLM frees the same
   requests at the same steps as the fix does in this mix, so both sides do the same work.

2. Step level: a real ``Scheduler`` with a real ``MultiConnector`` built by vLLM's connector
   factory ([MoRIIOConnector READ producer, an async saver child]) and 64 running requests;
   every step one request reaches max_tokens and is handed off (owners MoRIIO, plus X for
   every other one), one new request arrives, and the workers' finished_sending for a
   request arrives 3 steps after it finished. Timed: ``Scheduler.schedule()`` +
   ``Scheduler.update_from_output()``, and separately the time spent in
   the MultiConnector's scheduler-side entry points during those steps (what the fix adds).
   An unpatched and a patched scheduler live side by side and step in alternating chunks
   (the fix is applied for the patched one's chunks and reverted for the other's), so that a
   slow stretch of a shared machine lands on both; per chunk, each side's lower quartile of
   step pairs (see ``_low``); reported: medians over the chunks. Wall-clock timers
   (``perf_counter_ns``): on this kind of VM a CPU-time read costs ~0.9 us, five times as
   much, and would swamp the entry points' figures; preempted stretches are what ``_low``
   leaves out.

Level 1 runs interleaved repetitions (unpatched, patched, patched, unpatched, ...), medians; a
fresh world per run. Goal: step ratio <= 1.02 and <= 3 us added per step. No assertions.

Run: python benchmarks/bench_completion_ownership.py [--steps 1500] [--reps 7]
     [--chunks 60] [--chunk 24]
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

METHODS = ("get_transfer_results", "update_connector_output")
# The MultiConnector methods a Scheduler step calls that the fix wraps or replaces.
SCHEDULER_METHODS = (
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "get_num_new_matched_tokens",
)
RUNNING = 64


# ------------------------------------------------------------------------------ level 1
def workload(world: Any, steps: int, seed: int) -> None:
    rng = random.Random(seed)
    live: dict[str, int] = {}
    made = 0
    for n in range(steps):
        for _ in range(rng.randint(0, 6)):
            rid = f"b{made}"
            made += 1
            roll = rng.random()
            kind = "plain" if roll < 0.2 else "pd"
            world.add(rid, kind, x_holds=roll >= 0.6)
            live[rid] = n + rng.randint(1, 3)
        for rid, at in list(live.items()):
            if at > n:
                continue
            del live[rid]
            world.finish(rid, n)
            if world.kinds[rid] == "pd":
                world.ack(rid, n + rng.randint(2, 6))
            if rid in world.x.holds:
                world.x_done(rid, n + rng.randint(7, 9))
        world.step()


@contextmanager
def patched() -> Iterator[None]:
    from vllm_fix_completion_ownership import FIX
    from vllm_fix_testing import applied

    with applied(FIX):
        yield


def one_run(fixed: bool, steps: int, seed: int) -> tuple[dict[str, int], Any]:
    from vllm_fix_testing.prefill_instance import World

    with patched() if fixed else nullcontext():
        world = World(num_workers=2, async_scheduling=True)
        gc.collect()  # keep a collection of the previous run out of this one's timings
        gc.disable()  # as timeit does: a collection lands in whichever call allocates
        try:
            workload(world, steps, seed)
        finally:
            gc.enable()
        return dict(world.timings), world.figures()


def function_level(steps: int, reps: int) -> dict[str, tuple[float, float, float]]:
    one_run(False, 100, 0)  # warm-up, both sides
    one_run(True, 100, 0)
    ratios: dict[str, list[float]] = {m: [] for m in METHODS}
    per_step: dict[bool, dict[str, list[float]]] = {f: {m: [] for m in METHODS} for f in (False, True)}
    for rep in range(reps):
        seed = 1000 + rep
        order = (False, True) if rep % 2 == 0 else (True, False)
        got: dict[bool, dict[str, int]] = {}
        for fixed in order:
            got[fixed], _ = one_run(fixed, steps, seed)
        for m in METHODS:
            ratios[m].append(got[True][m] / got[False][m])
            for fixed in (False, True):
                per_step[fixed][m].append(got[fixed][m] / steps / 1000)
    return {
        m: (
            statistics.median(per_step[False][m]),
            statistics.median(per_step[True][m]),
            statistics.median(ratios[m]),
        )
        for m in METHODS
    }


# ------------------------------------------------------------------------------ level 2
def step_scheduler() -> Any:
    """A real Scheduler whose connector is vLLM's MultiConnector[MoRIIO READ producer, X],
    built by vLLM's connector factory; sized for 64 running requests."""
    from vllm_fix_testing import MORIIO_EXTRA_CONFIG, real_scheduler, tiny_model_dir

    model = tiny_model_dir(Path(tempfile.mkdtemp()) / "tiny")
    children = [
        {
            "kv_connector": "MoRIIOConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {**MORIIO_EXTRA_CONFIG, "read_mode": True},
        },
        {
            "kv_connector": "AsyncSaverConnector",
            "kv_role": "kv_producer",
            "kv_connector_module_path": "vllm_fix_testing.prefill_instance",
        },
    ]
    sched = real_scheduler(
        model,
        kv_connector="MultiConnector",
        kv_role="kv_producer",
        extra_config={"connectors": children},
        num_blocks=4096,
    )
    # real_scheduler is sized for 16 sequences / 64 tokens: widen it for 64 running requests.
    sched.scheduler_config.max_num_batched_tokens = 4096
    sched.scheduler_config.max_num_seqs = 256
    for attr in ("max_num_running_reqs", "max_num_active_reqs"):
        if hasattr(sched, attr):
            setattr(sched, attr, 256)
    sched.max_num_scheduled_tokens = 4096
    return sched


def _add(sched: Any, k: int, max_tokens: int) -> None:
    from vllm_fix_testing import real_request

    rid = ("x" if k % 2 else "p") + str(k)  # the async saver holds the "x" ones too
    req = real_request(
        rid,
        16,
        kv_transfer_params={"do_remote_decode": True, "transfer_id": f"t-{rid}"},
        first_token=10 + (k % 500),
    )
    req.max_tokens = req.sampling_params.max_tokens = max_tokens
    sched.add_request(req)


def _timed(
    method: Callable[..., Any], sink: list[int], by_method: dict[str, int], name: str
) -> Callable[..., Any]:
    """sink = [ns, depth]: only the outermost timed call counts (request_finished_all_groups
    calls request_finished); by_method[name] gets the same time, per entry point."""

    def timed(*args: Any, **kwargs: Any) -> Any:
        sink[1] += 1
        start = time.perf_counter_ns()
        try:
            return method(*args, **kwargs)
        finally:
            sink[1] -= 1
            if not sink[1]:
                spent = time.perf_counter_ns() - start
                sink[0] += spent
                by_method[name] += spent

    return timed


class StepDriver:
    """One real Scheduler driven through the step mix, a chunk of steps at a time.

    Built unpatched or with the fix applied; a patched driver must only step while the fix is
    applied, an unpatched one only while it is not (the caller switches between chunks)."""

    def __init__(self, fixed: bool, connector_time: bool) -> None:
        self.sink = [0, 0]
        self.by_method = dict.fromkeys(SCHEDULER_METHODS, 0)
        with patched() if fixed else nullcontext():
            self.sched = step_scheduler()
            if connector_time:
                mc = self.sched.connector
                for name in SCHEDULER_METHODS:  # instance attributes: what is installed now, timed
                    setattr(mc, name, _timed(getattr(mc, name), self.sink, self.by_method, name))
            for k in range(RUNNING):
                _add(self.sched, k, 2 + k)  # staggered: one request reaches max_tokens per step
        self.k = RUNNING
        self.n = 0
        self.due: dict[int, set[str]] = {}

    def run(self, steps: int) -> tuple[list[int], list[int], dict[str, int]]:
        """Per step: ns in schedule + update_from_output, ns in the MultiConnector entry points
        (0 unless timed); and ns per entry point over the chunk."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        sched, sink, due = self.sched, self.sink, self.due
        self.by_method.update(dict.fromkeys(self.by_method, 0))
        step_ns: list[int] = []
        connector_ns: list[int] = []
        gc.collect()
        gc.disable()  # as timeit does: a collection lands in whichever call allocates
        try:
            for _ in range(steps):
                n = self.n
                sink[0] = 0
                t0 = time.perf_counter_ns()
                output = sched.schedule()
                t1 = time.perf_counter_ns()
                ids = list(output.num_scheduled_tokens)
                for rid in output.finished_req_ids:
                    due.setdefault(n + 3, set()).add(rid)
                runner_output = ModelRunnerOutput(
                    req_ids=ids,
                    req_id_to_index={r: i for i, r in enumerate(ids)},
                    sampled_token_ids=[[7] for _ in ids],
                    kv_connector_output=KVConnectorOutput(finished_sending=due.pop(n, None)),
                )
                t2 = time.perf_counter_ns()
                sched.update_from_output(output, runner_output)
                t3 = time.perf_counter_ns()
                step_ns.append((t1 - t0) + (t3 - t2))
                connector_ns.append(sink[0])
                _add(sched, self.k, RUNNING)
                self.k += 1
                self.n += 1
        finally:
            gc.enable()
        return step_ns, connector_ns, dict(self.by_method)


def _low(per_step: list[int]) -> float:
    """Per step, the lower quartile of a chunk's consecutive step pairs (a pair holds one step
    of each owner mix). On a shared VM, stretches where the hypervisor or another process takes
    the core double a step's time (CPU time included: stolen time is counted as this thread's);
    the work of a step is the same in every pair, so the lower quartile is what the step costs
    when nothing is taken from it."""
    pairs = sorted(per_step[i] + per_step[i + 1] for i in range(0, len(per_step) - 1, 2))
    return pairs[len(pairs) // 4] / 2


def step_level(chunks: int, chunk: int) -> tuple[dict[str, tuple[float, float, float]], dict[str, float]]:
    """Two drivers per measure (unpatched, patched) step in alternating chunks in one process;
    the fix is applied for the patched driver's chunks and reverted for the other's. Per chunk:
    each side's lower quartile of step pairs (see _low); reported: the medians over the chunks
    of each side's figure and of the per-chunk ratio. Measures: "step" (no timers inside the
    step) and "connector" (the MultiConnector entry points, timed). Per entry point: the median
    over the chunks of the difference of the chunk means."""
    out: dict[str, tuple[float, float, float]] = {}
    added: dict[str, list[float]] = {m: [] for m in SCHEDULER_METHODS}
    for label, timers in (("step", False), ("connector", True)):
        drivers = {fixed: StepDriver(fixed, timers) for fixed in (False, True)}
        figures: dict[bool, list[float]] = {False: [], True: []}
        ratios: list[float] = []
        for index in range(-2, chunks):  # two warm-up chunks per side
            order = (False, True) if index % 2 == 0 else (True, False)
            got: dict[bool, float] = {}
            methods: dict[bool, dict[str, int]] = {}
            for fixed in order:
                with patched() if fixed else nullcontext():
                    step_ns, connector_ns, methods[fixed] = drivers[fixed].run(chunk)
                got[fixed] = _low(connector_ns if timers else step_ns) / 1000
            if index < 0:
                continue
            for fixed in (False, True):
                figures[fixed].append(got[fixed])
            ratios.append(got[True] / got[False])
            if timers:
                for m in SCHEDULER_METHODS:
                    added[m].append((methods[True][m] - methods[False][m]) / chunk / 1000)
        held = {fixed: len(d.sched.requests) for fixed, d in drivers.items()}
        if held[False] != held[True]:
            raise SystemExit(f"different work: {held[False]} vs {held[True]} requests held at the end")
        out[label] = (
            statistics.median(figures[False]),
            statistics.median(figures[True]),
            statistics.median(ratios),
        )
    return out, {m: statistics.median(v) for m, v in added.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--chunks", type=int, default=60)
    parser.add_argument("--chunk", type=int, default=24)
    args = parser.parse_args(argv)
    import logging

    logging.getLogger("vllm").setLevel(logging.ERROR)
    from vllm_fix_testing import vllm_version

    print(f"vLLM {vllm_version()}: completion-ownership overhead (medians)")
    functions = function_level(args.steps, args.reps)
    print(f"function level: {args.reps} interleaved reps x {args.steps} steps, 2 workers, async scheduling")
    for m, (a, b, r) in functions.items():
        print(
            f"  {m:24s} unpatched {a:7.2f} us/step  patched {b:7.2f} us/step  "
            f"added {b - a:+6.2f} us  ratio {r:.3f}"
        )
    steps, per_method = step_level(args.chunks, args.chunk)
    print(
        f"step level: {args.chunks} interleaved chunks x {args.chunk} steps per side, "
        f"{RUNNING} running requests, MultiConnector[MoRIIO, async saver]"
    )
    a, b, r = steps["step"]
    print(
        f"  Scheduler.schedule + update_from_output  unpatched {a:8.1f} us/step  patched {b:8.1f} us/step  "
        f"ratio {r:.3f} (goal <= 1.02)"
    )
    a, b, r = steps["connector"]
    print(
        f"  of which MultiConnector entry points     unpatched {a:8.2f} us/step  patched {b:8.2f} us/step  "
        f"added {b - a:+.2f} us/step (goal <= 3)"
    )
    print(
        "    added per entry point (outermost call only): "
        + ", ".join(f"{m} {v:+.2f} us" for m, v in per_method.items())
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
