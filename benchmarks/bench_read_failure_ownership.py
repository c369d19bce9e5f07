"""Overhead of vllm-fix-read-failure-ownership: patched / unpatched _pop_done_transfers.

One process, real vLLM: vLLM's own MoRIIOConnectorWorker._pop_done_transfers and the
fix's replacement for this release's shape are timed on identical worker states,
interleaved batch by batch. A state is a READ consumer tracking 64 requests of 40
statuses each (32 attention layers + 4 KDA layers x conv/SSM), with a realistic mix
per call: most still in flight, some done, a few failed (attention-only: failures are
recovered; hybrid: none, since a hybrid failure ends the step). Only the MORI engine is
stood in for (lock-free statuses, vllm_fix_testing's wrapper).
Prints the figures; asserts nothing about time.

Usage: python benchmarks/bench_read_failure_ownership.py [--batches 60] [--calls 10]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from types import SimpleNamespace
from typing import Any

from vllm_fix_core.patching import original_of
from vllm_fix_read_failure_ownership import patch
from vllm_fix_read_failure_ownership.probe import FrozenStatus
from vllm_fix_testing import FakeWrapper

REQUESTS = 64
STATUSES = 40
MIXES = {
    # name: (hybrid, pending, done, failed) requests per call
    "attention-only": (False, 48, 12, 4),
    "hybrid": (True, 52, 12, 0),
}


def make_worker(hybrid: bool, mix: tuple[int, int, int], ports: Any) -> Any:
    mc = patch._mc()
    cls = mc.MoRIIOConnectorWorker
    w = cls.__new__(cls)
    w.is_producer, w.mode, w.world_size, w._has_mamba = False, mc.MoRIIOMode.READ, 1, hybrid
    w.moriio_config = SimpleNamespace(recv_abort_timeout=120.0)
    w.moriio_wrapper = FakeWrapper()
    w._recving_transfers, w._recving_transfers_callback_addr = {}, {}
    w._recving_transfers_start, w._recving_local_blocks, w._invalid_block_ids = {}, {}, set()
    now = time.monotonic()
    kinds = ["pending"] * mix[0] + ["done"] * mix[1] + ["failed"] * mix[2]
    for i, kind in enumerate(kinds):
        statuses = [FrozenStatus("done") for _ in range(STATUSES)]
        if kind != "done":
            statuses[i % STATUSES] = FrozenStatus(kind)
        req = f"req-{i}"
        w._recving_transfers[req] = {f"layer{j}": [s] for j, s in enumerate(statuses)}
        w._recving_transfers_callback_addr[req] = ("10.0.0.1", ports, f"tx-{i}")
        w._recving_transfers_start[req] = now - (i % 30)
        w._recving_local_blocks[req] = [2 * i, 2 * i + 1]
    return w


def timed(func: Any, workers: list[Any]) -> float:
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter_ns()
        for w in workers:
            func(w)
        return (time.perf_counter_ns() - start) / len(workers) / 1e3  # us per call
    finally:
        gc.enable()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=60)
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args()

    import logging

    from vllm_fix_testing import vllm_version

    mc = patch._mc()
    logging.getLogger(mc.logger.name).setLevel(logging.CRITICAL)  # failures log errors
    logging.getLogger("vllm.fixes.read-failure-ownership").setLevel(logging.CRITICAL)
    shape = patch.recognize()
    unpatched = original_of(mc.MoRIIOConnectorWorker, patch.TARGET)
    patched = patch.REPLACEMENTS[shape]
    ports: Any = ("7000", "7001") if shape == "vllm-0.33.0" else "7000"
    print(f"vLLM {vllm_version()} shape {shape}: {REQUESTS} tracked READs x {STATUSES} statuses")
    for name, (hybrid, *mix) in MIXES.items():
        times: dict[str, list[float]] = {"unpatched": [], "patched": []}
        for batch in range(args.batches + 2):
            order = [("unpatched", unpatched), ("patched", patched)]
            if batch % 2:
                order.reverse()
            for label, func in order:
                workers = [make_worker(hybrid, (mix[0], mix[1], mix[2]), ports) for _ in range(args.calls)]
                t = timed(func, workers)
                if batch >= 2:  # warm-up
                    times[label].append(t)
        u, p = statistics.median(times["unpatched"]), statistics.median(times["patched"])
        ratios = sorted(b / a for a, b in zip(times["unpatched"], times["patched"], strict=True))
        q1, q3 = ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]
        print(
            f"{name:>15}: unpatched {u:8.1f} us/call, patched {p:8.1f} us/call (medians); "
            f"patched/unpatched ratio {statistics.median(ratios):.3f} "
            f"[IQR {q1:.3f}-{q3:.3f}] over {args.batches} interleaved pairs of {args.calls} calls"
        )


if __name__ == "__main__":
    main()
