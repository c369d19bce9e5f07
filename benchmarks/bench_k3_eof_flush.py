"""k3-eof-flush: per-token cost of a streaming Kimi K3 chat completion, patched / unpatched.

One process, interleaved repetitions (the fix is applied and reverted between them, the
order alternates). Each repetition streams a long K3 output, one token per engine output,
through vLLM's real OpenAI chat server (``OpenAIServingChat.create_chat_completion`` and
its stream generator, built by ``init_app_state``; only the engine is a stand-in replaying
the tokens, see ``vllm_fix_testing.kimi_k3``). Where the environment cannot import vLLM's
chat serving module, the stand-in falls back to the per-output calls the serving layer makes
(``ChatStreamProcessor.step``); the header line says which ran.
The stream ends on a held "<", so the patched run also pays its one end-of-stream flush.
Time is this thread's CPU time (time.thread_time_ns) for the whole request, so other load on
the machine does not count; the figure is the median over repetitions (the minimum is
printed too). Goal: patched / unpatched <= 1.02. No assertions on time; it prints the figures.

    HF_HUB_OFFLINE=1 [VLLM_TARGET_DEVICE=cpu] python benchmarks/bench_k3_eof_flush.py [--tokens N] [--reps R]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from pathlib import Path

from vllm_fix_core import Settings, runtime
from vllm_fix_k3_eof_flush import FIX
from vllm_fix_k3_eof_flush import patch as fix_patch
from vllm_fix_testing.kimi_k3 import RESPONSE_OPEN, THINK_CLOSE, K3Chat, Setup, encode

STRICT = Settings(disabled=frozenset(), strict=True)
WORDS = "the quick brown fox jumps over a < b and x|y > z "
CHAT: K3Chat | None = None


def model_text(tokens: int) -> str:
    half = max(1, tokens // 2)
    body = (WORDS * (half // len(WORDS) + 1))[:half]
    return body + THINK_CLOSE + RESPONSE_OPEN + body + "<"


def one_run(setup: Setup, deltas: list[list[int]]) -> int:
    """Nanoseconds of this thread's CPU time for one streaming request."""
    assert CHAT is not None
    gc.disable()
    t0 = time.thread_time_ns()
    CHAT.stream(setup, deltas)
    t1 = time.thread_time_ns()
    gc.enable()
    return t1 - t0


def bench(setup: Setup, tokens: int, reps: int) -> tuple[list[float], list[float]]:
    deltas = [[t] for t in encode(model_text(tokens))]
    per_token: dict[bool, list[float]] = {False: [], True: []}
    for rep in range(reps + 1):
        for patched in (False, True) if rep % 2 else (True, False):
            runtime.revert(FIX)
            if patched:
                runtime.apply(FIX, STRICT)
            ns = one_run(setup, deltas)
            if rep:  # the first round warms up
                per_token[patched].append(ns / len(deltas))
    runtime.revert(FIX)
    return per_token[False], per_token[True]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2000, help="tokens per long stream")
    ap.add_argument("--reps", type=int, default=21, help="interleaved repetitions per mode")
    args = ap.parse_args()
    import vllm.parser.kimi_k3  # noqa: F401  (the fix's trigger module)

    global CHAT
    CHAT = K3Chat(Path(tempfile.mkdtemp(prefix="k3-bench-")))
    step = CHAT.server(False).mode
    print(f"k3-eof-flush benchmark: {step}, one token per engine output, {args.reps} interleaved reps")
    runs = [("no tool parser", Setup(), tokens) for tokens in (200, args.tokens)] + [
        ("kimi_k3 tool parser", Setup(tool_parser=True), tokens) for tokens in (200, args.tokens)
    ]
    for label, setup, tokens in runs:
        report(label, setup, tokens, args.reps)
    # For comparison: the generic wrapt wrapper an unfingerprinted K3 shape would get.
    known = fix_patch.KNOWN_SHAPES
    fix_patch.KNOWN_SHAPES = {}
    try:
        report("(wrapt, no tool p.)", Setup(), args.tokens, args.reps)
    finally:
        fix_patch.KNOWN_SHAPES = known


def report(label: str, setup: Setup, tokens: int, reps: int) -> None:
    base, fixed = bench(setup, tokens, reps)
    b, f = statistics.median(base), statistics.median(fixed)
    print(
        f"  {label:20s} {tokens:5d} tokens: unpatched {b / 1000:7.2f} us/token, "
        f"patched {f / 1000:7.2f} us/token, ratio {f / b:.4f} (median; min "
        f"{min(fixed) / min(base):.4f}), overhead {(f - b):+.0f} ns/token"
    )


if __name__ == "__main__":
    main()
