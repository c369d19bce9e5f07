"""Overhead of vllm-fix-listener-port on MoRIIOConfig.from_vllm_config (patched / unpatched).

One process, the real installed vLLM, interleaved repetitions: each round times a
batch of calls to vLLM's own function (unpatched) and a batch through the installed
fix (patched). Prints the medians and their ratio; asserts nothing about time.

    python benchmarks/bench_listener_port.py [--rounds 30] [--calls 200] [--mori VERSION]

``--mori 0.0.1`` puts a MORI stand-in of that version in place (vllm_fix_testing.mori_io),
so the fix takes its held-reservation strategy (one extra bind per call, released when the
config is dropped); without it the fix asks for port 0.

Runs on CPU without MORI. The TP group is a stand-in (rank 0 of 1): from_vllm_config
reads it, and a real one needs GPUs. VLLM_PORT is unset, so each call makes vLLM's
two get_open_port() probes (one bind + close each) in both variants.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from types import SimpleNamespace
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--mori", default=None, help="version of a MORI stand-in (held-reservation path)")
    args = parser.parse_args()
    os.environ.pop("VLLM_PORT", None)

    from vllm.distributed import parallel_state
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_common, moriio_connector

    from vllm_fix_core import Answer, runtime
    from vllm_fix_core.patching import original_of
    from vllm_fix_listener_port import probe
    from vllm_fix_listener_port.declaration import FIX
    from vllm_fix_testing import STRICT

    del moriio_connector  # imported for the trigger
    if args.mori is not None:
        from vllm_fix_testing.mori_io import put_mori

        put_mori(args.mori)
    parallel_state._TP = SimpleNamespace(rank_in_group=0, world_size=1)
    config_cls = moriio_common.MoRIIOConfig
    unpatched = functools.partial(original_of(config_cls, "from_vllm_config").__func__, config_cls)
    decision = runtime.apply(FIX, STRICT)
    if decision.answer is not Answer.AFFECTED_FIXED:
        raise SystemExit(decision.message)
    patched = config_cls.from_vllm_config
    vllm_config = probe.vllm_config()
    assert (patched(vllm_config).local_kv_port == 0) is (args.mori is None)
    assert unpatched(vllm_config).local_kv_port != 0

    def batch(fn: Any) -> float:
        start = time.perf_counter()
        for _ in range(args.calls):
            fn(vllm_config)
        return (time.perf_counter() - start) / args.calls

    for fn in (unpatched, patched):  # warm up
        batch(fn)
    times: dict[str, list[float]] = {"unpatched": [], "patched": []}
    for round_ in range(args.rounds):
        order = [("unpatched", unpatched), ("patched", patched)]
        if round_ % 2:
            order.reverse()
        for name, fn in order:
            times[name].append(batch(fn))
    runtime.revert(FIX)

    med = {name: statistics.median(values) for name, values in times.items()}
    print(f"MoRIIOConfig.from_vllm_config, {args.rounds} rounds x {args.calls} calls (medians)")
    for name in ("unpatched", "patched"):
        print(f"  {name:9s}: {med[name] * 1e6:8.2f} us/call")
    print(f"  ratio patched/unpatched: {med['patched'] / med['unpatched']:.3f}")


if __name__ == "__main__":
    main()
