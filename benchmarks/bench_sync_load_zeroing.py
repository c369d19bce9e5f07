"""sync-load-zeroing: patched / unpatched time of MoRIIOConnectorScheduler.build_connector_meta,
in one process, interleaved (unpatched round, patched round, ...) with medians.

The step: a hybrid READ consumer drains 64 pending READs (n attention blocks each, plus a
Mamba slot) into the metadata while the step zeroes every newly allocated block (the READ
destinations, one recomputed tail block per request, the Mamba slots). The filter runs once per
scheduler step; the layout's coverage is computed once per process (by the ladder's probe at
startup, before timing here).

    python benchmarks/bench_sync_load_zeroing.py
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import interleaved

from vllm_fix_core import Answer, runtime
from vllm_fix_sync_load_zeroing import FIX
from vllm_fix_sync_load_zeroing.probe import Case, require_feature, scheduler, step_output
from vllm_fix_testing import STRICT

READS = 64


def bench(blocks_per_read: int) -> float:
    pending = tuple((tuple(range(i * 40, i * 40 + blocks_per_read)), (5000 + i,)) for i in range(READS))
    sched = scheduler(require_feature(), Case("bench", pending=pending), "LBHNC")
    recv: dict[str, Any] = dict(sched._reqs_need_recv)
    params: dict[str, Any] = dict(sched._req_kv_params)
    zero = tuple(b for i in range(READS) for b in (*range(i * 40, i * 40 + blocks_per_read + 1), 5000 + i))

    def step() -> None:
        sched._reqs_need_recv = dict(recv)
        sched._req_kv_params = dict(params)
        sched.build_connector_meta(step_output(zero))

    a, b = interleaved(
        step,
        step,
        apply=lambda: runtime.apply(FIX, STRICT),
        revert=lambda: runtime.revert(FIX),
        rounds=30,
        calls=100,
    )
    print(
        f"build_connector_meta, {READS} pending READs x {blocks_per_read} blocks, {len(zero)} blocks "
        f"to zero: unpatched {a * 1e6:.0f} us/step, patched {b * 1e6:.0f} us/step, ratio {b / a:.3f} "
        "(goal <= 1.02)"
    )
    return b / a


def upstream_reference(blocks_per_read: int) -> None:
    """On a vLLM with its own exclusion: the step with nothing to zero (vLLM skips its exclusion)
    against the same step zeroing every allocated block (vLLM filters them)."""
    pending = tuple((tuple(range(i * 40, i * 40 + blocks_per_read)), (5000 + i,)) for i in range(READS))
    sched = scheduler(require_feature(), Case("bench", pending=pending), "LBHNC")
    recv: dict[str, Any] = dict(sched._reqs_need_recv)
    params: dict[str, Any] = dict(sched._req_kv_params)
    zero = tuple(b for i in range(READS) for b in (*range(i * 40, i * 40 + blocks_per_read + 1), 5000 + i))

    def step(blocks: tuple[int, ...]) -> None:
        sched._reqs_need_recv = dict(recv)
        sched._req_kv_params = dict(params)
        sched.build_connector_meta(step_output(blocks))

    a, b = interleaved(
        lambda: step(()), lambda: step(zero), apply=lambda: None, revert=lambda: None, rounds=30, calls=100
    )
    print(
        f"  {READS} pending READs x {blocks_per_read} blocks: without zeroing {a * 1e6:.0f} us/step, "
        f"with {len(zero)} blocks to zero {b * 1e6:.0f} us/step, ratio {b / a:.3f}"
    )


def main() -> int:
    import logging

    logging.getLogger("vllm").setLevel(logging.ERROR)
    decision = runtime.apply(FIX, STRICT)
    runtime.revert(FIX)
    if decision.answer is Answer.FIXED_UPSTREAM:
        print(f"sync-load-zeroing: {decision.answer.value} on this vLLM; nothing patched.")
        print("Reference: the cost of vLLM's own exclusion (same step, zeroing list empty vs full):")
        for blocks_per_read in (1, 8, 32):
            upstream_reference(blocks_per_read)
        return 0
    if decision.answer is not Answer.AFFECTED_FIXED:
        print(f"sync-load-zeroing: {decision.answer.value} on this vLLM; nothing to time")
        return 0
    # Hybrid models size attention blocks to the recurrent-state page (hundreds of tokens), so a
    # 4k-token prompt is about 8 blocks; 32 blocks per READ is a dense-attention-sized case.
    for blocks_per_read in (1, 8, 32):
        bench(blocks_per_read)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
