"""Overhead of vllm-fix-handshake-port on the paths it wraps: patched / unpatched, one process.

    python benchmarks/bench_handshake_port.py [--reps 15] [--calls 20000]

Interleaved repetitions (unpatched, patched, unpatched, ...); the median of each is
printed with the ratio. No assertions on time.

* offset, explicit TP size: get_port_offset(dp, tp, tp_size) as _moriio_handshake and
  the READ release call it;
* offset, sender site: get_port_offset(dp, tp) inside the listening-TP context, as the
  scheduler's notify senders and the WRITE notify sender call it (the context set by
  the wrapper of the enclosing function is included);
* MoRIIOConfig.from_vllm_config: the whole call (two get_open_port probes included), with
  the TP getters answering for rank 1 of 4, as they would in a worker.

First, the cost of one decision (probe, recognize, apply, probe again: what a vLLM process
pays when it imports MoRIIO), measured once in this fresh process (wrapt and vLLM's
modules already imported) and then as the median of 5 more.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from vllm_fix_core import Settings, evaluate, runtime
from vllm_fix_handshake_port import FIX
from vllm_fix_handshake_port.rule import listening_tp_size
from vllm_fix_testing import STRICT

PACKAGE = "vllm.distributed.kv_transfer.kv_connector.v1.moriio"


def _config() -> Any:
    extra = {"handshake_port": "16301", "notify_port": "26005", "http_port": "8000", "host_ip": "127.0.0.1"}
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra),
        parallel_config=SimpleNamespace(
            data_parallel_rank=1, data_parallel_size_local=2, data_parallel_size=2
        ),
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--calls", type=int, default=20000)
    opts = parser.parse_args()
    common = importlib.import_module(f"{PACKAGE}.moriio_common")
    connector = importlib.import_module(f"{PACKAGE}.moriio_connector")
    importlib.import_module("wrapt")
    importlib.import_module("vllm.config")
    decisions = []
    for _ in range(6):
        start = time.perf_counter()
        decision = evaluate(FIX, Settings(disabled=frozenset(), strict=True), apply=True)
        decisions.append(time.perf_counter() - start)
        if decision.patch is not None:
            decision.patch.revert()
    print(
        f"decision ({decision.answer.value}): first {decisions[0] * 1e3:.1f} ms, "
        f"then median {statistics.median(decisions[1:]) * 1e3:.1f} ms"
    )
    common.get_tensor_model_parallel_rank = lambda: 1
    common.get_tensor_model_parallel_world_size = lambda: 4
    cfg = _config()

    def explicit(n: int) -> None:
        fn = connector.get_port_offset
        for i in range(n):
            fn(i & 3, i & 3, 4)

    def sender(n: int) -> None:
        fn = connector.get_port_offset
        with listening_tp_size(lambda: 4):
            for i in range(n):
                fn(i & 3, i & 3)

    def config(n: int) -> None:
        for _ in range(n):
            common.MoRIIOConfig.from_vllm_config(cfg)

    cases: list[tuple[str, Callable[[int], None], int]] = [
        ("get_port_offset(dp, tp, tp_size)", explicit, opts.calls),
        ("get_port_offset(dp, tp) at a sender site", sender, opts.calls),
        ("MoRIIOConfig.from_vllm_config", config, max(opts.calls // 100, 50)),
    ]
    times: dict[tuple[str, bool], list[float]] = {}
    for _ in range(opts.reps):
        for patched in (False, True):
            if patched:
                runtime.apply(FIX, STRICT)
            for name, fn, n in cases:
                start = time.perf_counter()
                fn(n)
                times.setdefault((name, patched), []).append((time.perf_counter() - start) / n)
            if patched:
                runtime.revert(FIX)
    print(f"vllm-fix-handshake-port overhead ({opts.reps} interleaved reps, median per call)")
    print(f"{'path':44} {'unpatched':>12} {'patched':>12} {'ratio':>7}")
    for name, _, _ in cases:
        off = statistics.median(times[(name, False)])
        on = statistics.median(times[(name, True)])
        print(f"{name:44} {off * 1e6:10.3f}us {on * 1e6:10.3f}us {on / off:7.2f}")


if __name__ == "__main__":
    main()
