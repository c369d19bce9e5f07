"""sync-load-context: patched / unpatched per-step cost, in one process, interleaved, medians.

Two levels:
 1. ``ActiveKVConnector.pre_forward`` alone, called the way the FULL branch calls it (no
    forward context, the step's input batch and attn_metadata), with a no-op connector behind
    it: a step with synchronous loads (the fix builds and opens the step's context) and a step
    with async loads only (the fix's pass-through);
 2. what a worker pays per step: the real ``GPUModelRunner.execute_model`` (FULL branch, the
    real ActiveKVConnector, a stand-in ``self`` for what needs a GPU, the replay recorded
    instead of launched; vllm_fix_testing.runner), with and without synchronous loads.

The recorded replay costs nothing, so level 2 overstates the ratio a GPU step would show
(a real FULL replay takes milliseconds). No assertions on time.

    python benchmarks/bench_sync_load_context.py
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import per_call

from vllm_fix_core import runtime
from vllm_fix_sync_load_context import FIX
from vllm_fix_testing import STRICT
from vllm_fix_testing.runner import StandInRunner, Timeline, active_connector, step_batch, step_output


class NoOpLoader:
    """A synchronous-load connector that does no work (so only the runner's cost is timed)."""

    timeline = None

    def handle_preemptions(self, metadata: Any) -> None:
        pass

    def bind_connector_metadata(self, metadata: Any) -> None:
        pass

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass

    def finish_forward(self) -> None:
        pass


def paired(fn: Any, *, rounds: int, calls: int) -> tuple[float, float, float]:
    """Median seconds per call (unpatched, patched) and the median of the per-round ratios.

    Each round times unpatched then patched back to back, so load from other processes (this
    machine is shared) hits both sides of a ratio alike."""
    a: list[float] = []
    b: list[float] = []
    for _ in range(rounds):
        revert()
        a.append(per_call(fn, calls))
        apply()
        b.append(per_call(fn, calls))
    revert()
    return (
        statistics.median(a),
        statistics.median(b),
        statistics.median(y / x for x, y in zip(a, b, strict=True)),
    )


def apply() -> None:
    runtime.apply(FIX, STRICT)


def revert() -> None:
    runtime.revert(FIX)


def main() -> int:
    import logging

    from vllm.config import VllmConfig

    logging.getLogger("vllm").setLevel(logging.ERROR)
    config = VllmConfig()
    batch = step_batch(num_reqs=64, padded_to=64)
    attn = {f"model.layers.{i}.self_attn.attn": object() for i in range(32)}
    active = active_connector(config, NoOpLoader())

    for sync in (True, False):
        out = step_output(batch, sync=sync)

        def pre_forward(out: Any = out) -> None:
            active.pre_forward(out, batch, attn_metadata=attn)

        a, b, ratio = paired(pre_forward, rounds=60, calls=1000)
        kind = "sync loads" if sync else "async loads only"
        print(
            f"pre_forward (FULL branch, {kind}): unpatched {a * 1e6:.2f} us, patched {b * 1e6:.2f} us, "
            f"ratio {ratio:.3f}"
        )

    for sync in (True, False):
        runner = StandInRunner(config, active, batch=batch, attn_metadata=attn, timeline=Timeline())
        out = step_output(batch, sync=sync)

        def step(runner: Any = runner, out: Any = out) -> None:
            runner.timeline.events.clear()
            runner.timeline.context_at_run.clear()
            runner.execute(out)

        a, b, ratio = paired(step, rounds=60, calls=200)
        kind = "sync loads" if sync else "async loads only"
        print(
            f"execute_model FULL step, 64 decodes, {kind}: unpatched {a * 1e6:.1f} us, "
            f"patched {b * 1e6:.1f} us (+{(b - a) * 1e6:.1f} us), ratio {ratio:.3f} (goal <= 1.02)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
