"""spec-kv-readiness: patched / unpatched per-step cost, in one process.

Two levels, both interleaved (unpatched round, patched round, ...), the median of every
call timed on its own:
 1. the patched hot path alone, per speculative step: ActiveKVConnector.post_forward
    (+ finalize_step on 0.33.0) and AsyncOutput.get_output, the real methods over a recording
    connector, for a connector that publishes blocks for READ (the one that waits) and one
    that does not;
 2. a whole model-runner step: vLLM's real GPUModelRunner.sample_tokens with the real
    ActiveKVConnector and AsyncOutput.get_output, the model, sampler, drafter and connector
    replaying the calls a speculative step makes (vllm_fix_testing.spec_runner), no device
    work. That is the worst case for the ratio: on a GPU the step also holds the target and
    draft forwards (milliseconds), which the fix does not touch.

On a CPU the "device" events are recorded in call order; on a GPU the readiness wait itself
is the point of the fix (the output becomes visible once the draft KV is on the device) and
is not an overhead this script can measure.

    python benchmarks/bench_spec_kv_readiness.py
"""

from __future__ import annotations

import gc
import logging
import statistics
import time
from types import SimpleNamespace
from typing import Any

from vllm_fix_core import runtime
from vllm_fix_spec_kv_readiness import FIX, readiness
from vllm_fix_testing import STRICT
from vllm_fix_testing.spec_runner import TARGET_LAYER, Event, SpecRunner, StepLog, cpu_async_output


def apply() -> None:
    runtime.apply(FIX, STRICT)
    gc.collect()  # the ladder's probe leaves garbage; collect it outside the timed round


def revert() -> None:
    runtime.revert(FIX)
    gc.collect()


def interleaved_p50(fn: Any, *, rounds: int, calls: int) -> tuple[float, float]:
    """Median seconds per call (unpatched, patched) over every call of alternating rounds.

    Each call is timed on its own and the median taken: on a shared machine a step is now and
    then preempted for milliseconds, which a mean would charge to whichever arm it hit. The
    garbage collector is off while timing (as timeit does) and run between rounds.
    """
    a: list[float] = []
    b: list[float] = []
    gc.disable()
    try:
        for _ in range(rounds):
            for arm, switch in ((a, revert), (b, apply)):
                switch()
                for _ in range(calls):
                    start = time.perf_counter()
                    fn()
                    arm.append(time.perf_counter() - start)
    finally:
        revert()
        gc.enable()
    return statistics.median(a), statistics.median(b)


def hot_path(read_publisher: bool) -> Any:
    """One step's connector calls, as sample_tokens makes them, and get_output."""
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.worker.gpu import async_utils

    spec = SpecRunner(read_publisher=read_publisher, event_seam=readiness.override_events)
    active, connector = spec.active, spec.connector
    deferred = hasattr(type(active), "finalize_step")
    log = StepLog()
    readiness.override_events(lambda: Event("step-done", log))
    output_cls = cpu_async_output(async_utils.AsyncOutput, log)
    sampler = SimpleNamespace(sampled_token_ids=_tensor([[1], [2]]))
    num_sampled = _tensor([1, 1])
    finished: set[str] = set()

    def step() -> None:
        connector.log = log
        log.entries.clear()
        log.synced.clear()
        connector.bind_connector_metadata(object())
        connector.save_kv_layer(TARGET_LAYER, None, {})
        runner_output = ModelRunnerOutput(req_ids=["a", "b"], req_id_to_index={"a": 0, "b": 1})
        out = output_cls(runner_output, sampler, num_sampled)
        if deferred:
            runner_output.kv_connector_output = active.post_forward(finished, defer_finalize=True)
            active.finalize_step()
        else:
            runner_output.kv_connector_output = active.post_forward(finished)
        out.get_output()

    return step


def _tensor(data: Any) -> Any:
    import torch

    return torch.tensor(data)


def main() -> int:
    logging.getLogger("vllm").setLevel(logging.ERROR)
    from vllm_fix_testing import vllm_version

    print(f"vLLM {vllm_version()}")
    for read_publisher in (True, False):
        step = hot_path(read_publisher)
        a, b = interleaved_p50(step, rounds=20, calls=300)
        who = "READ publisher (waits)" if read_publisher else "other connector (overlap kept)"
        print(
            f"hot path per speculative step, {who}: unpatched {a * 1e6:.1f} us, "
            f"patched {b * 1e6:.1f} us (+{(b - a) * 1e6:.1f} us), ratio {b / a:.3f}"
        )
    readiness.override_events(None)
    for read_publisher in (True, False):
        spec = SpecRunner(read_publisher=read_publisher, event_seam=readiness.override_events)
        a, b = interleaved_p50(spec.step, rounds=20, calls=150)
        who = "READ publisher" if read_publisher else "other connector"
        print(
            f"model-runner step (real sample_tokens, recorded replay, no device work), {who}: "
            f"unpatched {a * 1e6:.1f} us, patched {b * 1e6:.1f} us (+{(b - a) * 1e6:.1f} us), "
            f"ratio {b / a:.3f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
