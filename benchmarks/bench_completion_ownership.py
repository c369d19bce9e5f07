"""Overhead of vllm-fix-completion-ownership, at two levels, in one process.

1. Function level: CPU time spent in ``MultiConnector.get_transfer_results`` (every worker,
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
   ``Scheduler.update_from_output()`` (CPU thread time), and separately the time spent in
   the MultiConnector's scheduler-side entry points during those steps (what the fix adds).

Interleaved repetitions (unpatched, patched, patched, unpatched, ...), medians; a fresh
scheduler per run. Goal: step ratio <= 1.02 and <= 3 us added per step. No assertions.

Run: python benchmarks/bench_completion_ownership.py [--steps 1500] [--reps 7]
     [--step-steps 300] [--step-reps 9]
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
        start = time.thread_time_ns()
        try:
            return method(*args, **kwargs)
        finally:
            sink[1] -= 1
            if not sink[1]:
                spent = time.thread_time_ns() - start
                sink[0] += spent
                by_method[name] += spent

    return timed


def step_run(fixed: bool, steps: int, warm: int, connector_time: bool) -> tuple[float, int, dict[str, float]]:
    """CPU us per step (schedule + update_from_output, or the connector's share of it, also
    per entry point), and the number of requests held at the end."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    with patched() if fixed else nullcontext():
        sched = step_scheduler()
        sink = [0, 0]
        by_method = dict.fromkeys(SCHEDULER_METHODS, 0)
        if connector_time:
            mc = sched.connector
            for name in SCHEDULER_METHODS:  # instance attributes: whatever is installed, timed
                setattr(mc, name, _timed(getattr(mc, name), sink, by_method, name))
        k = 0
        for i in range(RUNNING):
            _add(sched, k, 2 + i)  # staggered: one request reaches max_tokens per step
            k += 1
        gc.collect()
        gc.disable()  # as timeit does: a collection lands in whichever call allocates
        try:
            total = _steps(sched, sink, by_method, k, steps, warm, KVConnectorOutput, ModelRunnerOutput)
        finally:
            gc.enable()
        per_step = (sink[0] if connector_time else total) / steps / 1000
        return per_step, len(sched.requests), {m: ns / steps / 1000 for m, ns in by_method.items()}


def _steps(
    sched: Any,
    sink: list[int],
    by_method: dict[str, int],
    k: int,
    steps: int,
    warm: int,
    kv_output: Any,
    runner_output_cls: Any,
) -> int:
    due: dict[int, set[str]] = {}
    total = 0
    for n in range(warm + steps):
        if n == warm:
            sink[0] = 0
            by_method.update(dict.fromkeys(by_method, 0))
        t0 = time.thread_time_ns()
        output = sched.schedule()
        t1 = time.thread_time_ns()
        ids = list(output.num_scheduled_tokens)
        for rid in output.finished_req_ids:
            due.setdefault(n + 3, set()).add(rid)
        runner_output = runner_output_cls(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[7] for _ in ids],
            kv_connector_output=kv_output(finished_sending=due.pop(n, None)),
        )
        t2 = time.thread_time_ns()
        sched.update_from_output(output, runner_output)
        t3 = time.thread_time_ns()
        if n >= warm:
            total += (t1 - t0) + (t3 - t2)
        _add(sched, k, RUNNING)
        k += 1
    return total


def step_level(steps: int, reps: int) -> tuple[dict[str, tuple[float, float, float]], dict[str, float]]:
    step_run(False, 20, 5, False)  # warm-up (first scheduler build inspects the model)
    step_run(True, 20, 5, False)
    out: dict[str, tuple[float, float, float]] = {}
    added: dict[str, list[float]] = {m: [] for m in SCHEDULER_METHODS}
    for label, connector_time in (("step", False), ("connector", True)):
        times: dict[bool, list[float]] = {False: [], True: []}
        ratios: list[float] = []
        for rep in range(reps):
            order = (False, True) if rep % 2 == 0 else (True, False)
            got: dict[bool, float] = {}
            held: dict[bool, int] = {}
            methods: dict[bool, dict[str, float]] = {}
            for fixed in order:
                got[fixed], held[fixed], methods[fixed] = step_run(fixed, steps, 50, connector_time)
            if connector_time:
                for m in SCHEDULER_METHODS:
                    added[m].append(methods[True][m] - methods[False][m])
            if held[False] != held[True]:
                raise SystemExit(f"different work: {held[False]} vs {held[True]} requests held at the end")
            ratios.append(got[True] / got[False])
            for fixed in (False, True):
                times[fixed].append(got[fixed])
        out[label] = (
            statistics.median(times[False]),
            statistics.median(times[True]),
            statistics.median(ratios),
        )
    return out, {m: statistics.median(v) for m, v in added.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--step-steps", type=int, default=300)
    parser.add_argument("--step-reps", type=int, default=9)
    args = parser.parse_args(argv)
    import logging

    logging.getLogger("vllm").setLevel(logging.ERROR)
    from vllm_fix_testing import vllm_version

    print(f"vLLM {vllm_version()}: completion-ownership overhead (CPU thread time, medians)")
    functions = function_level(args.steps, args.reps)
    print(f"function level: {args.reps} interleaved reps x {args.steps} steps, 2 workers, async scheduling")
    for m, (a, b, r) in functions.items():
        print(
            f"  {m:24s} unpatched {a:7.2f} us/step  patched {b:7.2f} us/step  "
            f"added {b - a:+6.2f} us  ratio {r:.3f}"
        )
    steps, per_method = step_level(args.step_steps, args.step_reps)
    print(
        f"step level: {args.step_reps} interleaved reps x {args.step_steps} steps, "
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
