"""read-eligibility: patched / unpatched time of get_num_new_matched_tokens, in one process.

Two levels, both interleaved (unpatched round, patched round, ...) with medians:
 1. the method alone on a READ consumer, over a realistic request mix (remote prefills with
    1k-32k-token prompts, plain requests, resumed requests);
 2. what the engine pays: admitting those requests through a real Scheduler.schedule() with a
    real MoRIIO READ consumer connector.

    python benchmarks/bench_read_eligibility.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import interleaved

from vllm_fix_core import runtime
from vllm_fix_read_eligibility import FIX
from vllm_fix_read_eligibility.probe import consumer
from vllm_fix_testing import MORIIO_EXTRA_CONFIG, STRICT, real_request, real_scheduler, tiny_model_dir


def mix() -> list[Any]:
    reqs = []
    for i, tokens in enumerate((1024, 4096, 8192, 32768)):
        blocks = [list(range(tokens // 16))]
        params = {"do_remote_prefill": True, "remote_block_ids": blocks, "remote_engine_id": "prefill-0"}
        reqs.append(SimpleNamespace(request_id=f"r{i}", num_prompt_tokens=tokens, kv_transfer_params=params))
    reqs.append(SimpleNamespace(request_id="plain", num_prompt_tokens=512, kv_transfer_params=None))
    reqs.append(
        SimpleNamespace(
            request_id="resumed", num_prompt_tokens=512, kv_transfer_params={"do_remote_prefill": False}
        )
    )
    return reqs


def apply() -> None:
    runtime.apply(FIX, STRICT)


def revert() -> None:
    runtime.revert(FIX)


def main() -> int:
    import logging

    logging.getLogger("vllm").setLevel(logging.ERROR)
    sched = consumer()
    reqs = mix()

    def call_all() -> None:
        for r in reqs:
            sched.get_num_new_matched_tokens(r, 0)

    a, b = interleaved(call_all, call_all, apply=apply, revert=revert, rounds=30, calls=500)
    n = len(reqs)
    print(
        f"get_num_new_matched_tokens, request mix of {n}: unpatched {a / n * 1e6:.2f} us/call, "
        f"patched {b / n * 1e6:.2f} us/call, ratio {b / a:.3f}"
    )

    model = tiny_model_dir(Path(tempfile.mkdtemp()) / "tiny")
    scheduler = real_scheduler(
        model,
        kv_connector="MoRIIOConnector",
        kv_role="kv_consumer",
        extra_config={**MORIIO_EXTRA_CONFIG, "read_mode": True},
        num_blocks=4096,
    )
    from vllm.v1.request import RequestStatus

    counter = iter(range(10**9))

    def admit_step() -> None:
        ids = []
        for _ in range(4):
            k = next(counter)
            req = real_request(f"s{k}", 48, first_token=10 + (k % 900))
            scheduler.add_request(req)
            ids.append(req.request_id)
        scheduler.schedule()
        scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)

    a, b = interleaved(admit_step, admit_step, apply=apply, revert=revert, rounds=20, calls=50)
    print(
        f"Scheduler.schedule() admitting 4 plain requests via MoRIIO READ consumer: unpatched "
        f"{a * 1e6:.0f} us/step, patched {b * 1e6:.0f} us/step, ratio {b / a:.3f} (goal <= 1.02)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
