"""k3-eof-flush: per-token cost of the Kimi K3 streaming step, patched / unpatched.

One process, interleaved repetitions (the fix is applied and reverted between them, the
order alternates). Each repetition streams a long K3 output one token per delta through
the step vLLM's chat serving uses (0.33.0: ChatStreamProcessor.step; 0.32.0:
parser.parse_delta as chat_completion/serving.py calls it); only the step loop is timed.
The stream ends on a held "<", so the patched run also pays its one end-of-stream flush.
Time is this thread's CPU time (time.thread_time_ns), so other load on the machine does not
count; the figure is the median over repetitions (the minimum is printed too).
Goal: patched / unpatched <= 1.02. No assertions on time; it prints the figures.

    HF_HUB_OFFLINE=1 [VLLM_TARGET_DEVICE=cpu] python benchmarks/bench_k3_eof_flush.py [--tokens N] [--reps R]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any

from vllm_fix_core import runtime
from vllm_fix_core.settings import Settings
from vllm_fix_k3_eof_flush import FIX
from vllm_fix_k3_eof_flush import patch as fix_patch
from vllm_fix_k3_eof_flush.harness import (
    RESPONSE_OPEN,
    THINK_CLOSE,
    Setup,
    decode,
    encode,
    make_parser,
    vllm_has_stream_processor,
)

STRICT = Settings(disabled=frozenset(), strict=True)
WORDS = "the quick brown fox jumps over a < b and x|y > z "


def model_text(tokens: int) -> str:
    half = max(1, tokens // 2)
    body = (WORDS * (half // len(WORDS) + 1))[:half]
    return body + THINK_CLOSE + RESPONSE_OPEN + body + "<"


def one_run(setup: Setup, deltas: list[tuple[str, list[int]]]) -> int:
    """Nanoseconds for the step loop of one stream (parser built outside the timing)."""
    cls, parser, request = make_parser(setup)
    prompt = encode(setup.prompt())
    if vllm_has_stream_processor():
        from vllm.entrypoints.openai.chat_completion.stream_processor import ChatStreamProcessor

        processor = ChatStreamProcessor(request, parser, enable_auto_tools=setup.tool_parser, parser_cls=cls)
        step: Any = processor.step
        last = len(deltas) - 1
        gc.disable()
        t0 = time.thread_time_ns()
        for i, (text, ids) in enumerate(deltas):
            step(text, ids, "length" if i == last else None, prompt)
        t1 = time.thread_time_ns()
        gc.enable()
        return t1 - t0
    parse_delta = parser.parse_delta
    last = len(deltas) - 1
    gc.disable()
    t0 = time.thread_time_ns()
    for i, (text, ids) in enumerate(deltas):
        parse_delta(
            delta_text=text,
            delta_token_ids=ids,
            request=request,
            prompt_token_ids=prompt,
            finished=i == last,
        )
    t1 = time.thread_time_ns()
    gc.enable()
    return t1 - t0


def bench(setup: Setup, tokens: int, reps: int) -> tuple[list[float], list[float]]:
    ids = encode(model_text(tokens))
    deltas = [(decode([t]), [t]) for t in ids]
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

    step = "ChatStreamProcessor.step" if vllm_has_stream_processor() else "parser.parse_delta"
    print(f"k3-eof-flush benchmark: {step}, one token per delta, {args.reps} interleaved reps")
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
