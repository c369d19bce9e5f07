"""Overhead of vllm-fix-completion-ownership on MultiConnector's per-step hot paths.

Measures, in one process with interleaved repetitions, the time spent in
``MultiConnector.get_transfer_results`` (what ``get_finished`` and the model runner
call on every worker, every step) and ``MultiConnector.update_connector_output`` (the
scheduler, every step) with and without the fix, and prints patched / unpatched
ratios. Goal: <= 1.02. No assertions on time.

The step mix is a prefill instance with MultiConnector[MoRIIO READ producer, X] and 2
workers under async scheduling (vllm_fix_testing.prefill_instance: real
MultiConnector, real MoRIIO scheduler/worker code, real KVOutputAggregator and
scheduler free loop; X and the RDMA ACK queue are fakes): 0-6 new requests per step,
40 % handed to decode (owners {MoRIIO}), 40 % handed to decode and saved by X (owners
{MoRIIO, X}), 20 % plain (no owner); decode ACKs 2-6 steps after the finish, X's save
2-8 steps after. In this mix unpatched vLLM frees the same requests at the same steps
as the fix does (ACKs land after the owner counts reached the workers and X finishes
last), so both sides do the same work.

Run: python benchmarks/bench_completion_ownership.py [--steps 1500] [--reps 7]
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

METHODS = ("get_transfer_results", "update_connector_output")


def workload(world: object, steps: int, seed: int) -> None:
    from vllm_fix_testing.prefill_instance import World

    assert isinstance(world, World)
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


def one_run(fixed: bool, steps: int, seed: int) -> tuple[dict[str, int], object]:
    from vllm_fix_testing.prefill_instance import World

    with patched() if fixed else nullcontext():
        world = World(num_workers=2, async_scheduling=True)
        gc.collect()  # keep a collection of the previous run out of this one's timings
        workload(world, steps, seed)
        return dict(world.timings), world.figures()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args(argv)
    import logging

    logging.getLogger("vllm").setLevel(logging.ERROR)
    from vllm_fix_testing import vllm_version

    one_run(False, 100, 0)  # warm-up, both sides
    one_run(True, 100, 0)
    ratios: dict[str, list[float]] = {m: [] for m in METHODS}
    per_step: dict[bool, dict[str, list[float]]] = {f: {m: [] for m in METHODS} for f in (False, True)}
    figures: dict[bool, object] = {}
    for rep in range(args.reps):
        seed = 1000 + rep
        order = (False, True) if rep % 2 == 0 else (True, False)
        got: dict[bool, dict[str, int]] = {}
        for fixed in order:
            got[fixed], figures[fixed] = one_run(fixed, args.steps, seed)
        for m in METHODS:
            ratios[m].append(got[True][m] / got[False][m])
            for fixed in (False, True):
                per_step[fixed][m].append(got[fixed][m] / args.steps / 1000)
    print(
        f"vLLM {vllm_version()}: {args.reps} interleaved reps x {args.steps} steps, "
        "2 workers, async scheduling"
    )
    for fixed in (False, True):
        print(f"  {'patched  ' if fixed else 'unpatched'} last run: {figures[fixed].line()}")  # type: ignore[attr-defined]
    for m in METHODS:
        us = {f: statistics.median(per_step[f][m]) for f in (False, True)}
        print(
            f"  {m:24s} unpatched {us[False]:7.2f} us/step  patched {us[True]:7.2f} us/step (medians)  "
            f"ratio median {statistics.median(ratios[m]):.3f} (min {min(ratios[m]):.3f}, "
            f"max {max(ratios[m]):.3f}; goal <= 1.02)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
