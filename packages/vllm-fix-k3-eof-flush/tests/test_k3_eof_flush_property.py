"""Property-based oracle: for any split of K3 model text into deltas, each channel a streaming
client of vLLM's real OpenAI chat server receives (reasoning, content, tool calls as name +
arguments) equals what the non-streaming request returns (vllm_fix_testing.kimi_k3).

Texts follow the K3 XTML channel grammar (optional think opener, think body, think close,
optional response opener, response body, optional response close, optional tools channel
with complete string-argument calls, optional message close). Bodies mix plain text with
marker prefixes ("<", "<|", "<|clo", "<|close|>resp", ...) and lone special tokens. The
output then ends anywhere: inside any body (free to end on a marker prefix) or at a random
token (a length cut inside any marker), optionally followed by an empty EOS delta; thinking
on/off, reasoning shown/hidden, with/without the tool parser, with/without tools.

Kept out of the EOF oracle (pre-existing, not caused by EOF; see README):
* a body is never followed by structure while it ends on a marker prefix, and holds no
  complete marker: mid-stream, vLLM's no-tool content helper re-sends text when a
  completed close marker exposes a new held prefix ("x<" + "<|close|>response<|sep|>");
* text after <|close|>response<|sep|> (other than the message close, and the tools
  channel with a tool parser): streamed but not returned without a tool parser when the
  output opened the response channel (README, pre-existing difference 1), returned but
  not streamed with one when it did not. `pre_existing_difference` names exactly these texts;
* with tool calls, whitespace-only content: non-streaming returns None, streaming has
  already sent the whitespace (KimiK3Parser._extract_tool_calls); response bodies of
  requests with tools are never whitespace-only.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from vllm_fix_testing import vllm_version
from vllm_fix_testing.kimi_k3 import (
    ARG_CLOSE,
    CALL_CLOSE,
    MESSAGE_CLOSE,
    RESPONSE_CLOSE,
    RESPONSE_OPEN,
    THINK_CLOSE,
    THINK_OPEN,
    TOOLS_CLOSE,
    TOOLS_OPEN,
    K3Chat,
    Setup,
    call_block,
    decode,
    describe,
    encode,
    split_ids,
)
from vllm_fix_testing.stress import scaled

CALL_OPEN = '<|open|>call tool="get_weather" index="1"<|sep|>'
ARG_OPEN = '<|open|>argument key="city" type="string"<|sep|>'
MARKERS = (
    THINK_OPEN,
    THINK_CLOSE,
    RESPONSE_OPEN,
    RESPONSE_CLOSE,
    MESSAGE_CLOSE,
    TOOLS_OPEN,
    TOOLS_CLOSE,
    CALL_OPEN,
    CALL_CLOSE,
    ARG_OPEN,
    ARG_CLOSE,
)
PREFIXES = sorted({m[:n] for m in MARKERS for n in range(1, len(m)) if "<|sep|>" not in m[:n]})
WORDS = ("a", "List", " ", "x y", "Hi", "=", "|", ">", "<>", "think", "response", "1", "\n", "{}")
LONE = ("<|open|>", "<|close|>")

fragment = st.one_of(st.sampled_from(WORDS), st.sampled_from(PREFIXES), st.sampled_from(LONE))


def ends_on_prefix(text: str) -> bool:
    return any(text.endswith(p) for p in PREFIXES)


@st.composite
def body(draw: Any, last: bool = False, solid: bool = False) -> str:
    text = "".join(draw(st.lists(fragment, max_size=5))).replace("<|sep|>", "<|sep|")
    if not last and ends_on_prefix(text):
        text += "."
    if solid and text.isspace():
        text = "a" + text
    return text


@st.composite
def k3_streams(draw: Any) -> tuple[Setup, list[list[int]], bool]:
    thinking = draw(st.booleans())
    tool_parser = draw(st.booleans())
    tools = tool_parser and draw(st.booleans())
    opener = True
    parts: list[tuple[str, bool]] = []  # (text, is a body)
    if thinking:
        if draw(st.booleans()):  # the prompt did not supply the think opener
            parts.append((THINK_OPEN, False))
            opener = False
        parts += [(draw(body()), True), (THINK_CLOSE, False)]
        if draw(st.booleans()):
            parts.append((RESPONSE_OPEN, False))
    solid = tools  # see the module docstring: whitespace-only content next to tool calls
    parts.append((draw(body(solid=solid)), True))
    response_body = len(parts) - 1
    closed = draw(st.booleans())
    if closed:
        parts.append((RESPONSE_CLOSE, False))
    tools_block = draw(st.booleans()) and (tool_parser or not closed)
    if tools_block:
        parts.append((TOOLS_OPEN, False))
        for i in range(draw(st.integers(0, 2))):
            head, tail = call_block("get_weather", {"city": "\x01"}, i + 1).split("\x01")
            parts += [(head, False), (draw(body()), True), (tail, False)]
        if draw(st.booleans()):
            parts.append((TOOLS_CLOSE, False))
    if (closed or tools_block) and draw(st.booleans()):
        parts.append((MESSAGE_CLOSE, False))
    end = draw(st.sampled_from([None, *(i for i, (_, is_body) in enumerate(parts) if is_body)]))
    if end is not None:  # the output ends inside this body
        parts = [*parts[:end], (draw(body(last=True, solid=solid and end == response_body)), True)]
    setup = Setup(
        thinking=thinking,
        tool_parser=tool_parser,
        tools=tools,
        include_reasoning=draw(st.booleans()),
        prompt_opener=opener,
    )
    ids = encode("".join(text for text, _ in parts))
    ids = ids[: draw(st.one_of(st.just(len(ids)), st.integers(0, len(ids))))]
    cuts = draw(st.lists(st.integers(1, max(1, len(ids) - 1)), max_size=12))
    return setup, split_ids(ids, cuts), draw(st.booleans())


def pre_existing_difference(setup: Setup, text: str) -> bool:
    """Texts where the two paths already disagree (not EOF): text after
    <|close|>response<|sep|> (see the module docstring); on vLLM 0.27.1-0.30, output with
    thinking on and no complete think marker, which non-streaming calls content and
    streaming reasoning (0.31 made non-streaming agree)."""
    if (
        vllm_version().release < (0, 31)
        and setup.thinking
        and THINK_CLOSE not in text
        and THINK_OPEN not in text
    ):
        return True
    i = text.find(RESPONSE_CLOSE)
    if i < 0:
        return False
    rest = text[i + len(RESPONSE_CLOSE) :].replace(MESSAGE_CLOSE, "")
    if setup.tool_parser and TOOLS_OPEN in rest:
        rest = rest[: rest.index(TOOLS_OPEN)]
    return bool(rest) and ((RESPONSE_OPEN in text[:i]) != setup.tool_parser)


def mismatch(chat: K3Chat, setup: Setup, deltas: list[list[int]], eos: bool) -> str | None:
    text = "".join(decode(d) for d in deltas)
    streamed = chat.stream(setup, deltas, eos=eos).as_tuple()
    oracle = chat.complete(setup, text).as_tuple()
    if streamed == oracle:
        return None
    return f"{describe(setup, deltas)} eos={eos}: streamed {streamed!r} != non-streaming {oracle!r}"


@settings(
    max_examples=300,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
@given(k3_streams())
def test_every_chunking_streams_what_non_streaming_returns(
    chat: K3Chat, patched_module: object, example: tuple[Setup, list[list[int]], bool]
) -> None:
    setup, deltas, eos = example
    assume(not pre_existing_difference(setup, "".join(decode(d) for d in deltas)))
    problem = mismatch(chat, setup, deltas, eos)
    assert problem is None, problem


@pytest.mark.stress
def test_stress_ten_thousand_streams(chat: K3Chat, capsys: pytest.CaptureFixture[str]) -> None:
    """>= 10,000 generated streams (2,000 in the focused form): 0 mismatches patched; unpatched,
    the bug shows at least once (the count is printed: hypothesis draws differ per run, so
    never an exact number)."""
    from vllm_fix_core import runtime
    from vllm_fix_core.settings import Settings
    from vllm_fix_k3_eof_flush import FIX

    generated: list[tuple[Setup, list[list[int]], bool]] = []
    excluded = 0
    problems: list[str] = []

    wanted = scaled(10_000, 2_000)

    @settings(
        max_examples=wanted + wanted // 50,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(k3_streams())
    def run(example: tuple[Setup, list[list[int]], bool]) -> None:
        nonlocal excluded
        setup, deltas, eos = example
        if pre_existing_difference(setup, "".join(decode(d) for d in deltas)):
            excluded += 1
            return
        generated.append(example)
        problem = mismatch(chat, setup, deltas, eos)
        if problem:
            problems.append(problem)

    runtime.revert(FIX)
    runtime.apply(FIX, Settings(disabled=frozenset(), strict=True))
    try:
        run()
    finally:
        runtime.revert(FIX)
    unpatched = sum(mismatch(chat, *example) is not None for example in generated)
    with capsys.disabled():
        print(
            f"\nk3-eof-flush stress: {len(generated)} streams (+{excluded} pre-existing "
            f"non-EOF texts kept out): mismatches unpatched {unpatched}, patched {len(problems)}"
        )
    assert len(generated) >= wanted
    assert not problems, "\n".join(problems[:5])
    assert unpatched >= 1, "the negative control: unpatched vLLM must lose a tail at least once"
