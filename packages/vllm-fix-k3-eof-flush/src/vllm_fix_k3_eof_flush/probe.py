"""Does this vLLM's streaming Kimi K3 parser lose the text it holds back at end of stream?

Runs the README's failing scenario through the real, installed ``KimiK3Parser.parse_delta``
(the single K3 streaming entry) with an in-memory K3 vocabulary: no model, no hub,
no files, a few milliseconds.

The parser class is composed the way ``ParserManager._compose_parser`` composes it
(a ``KimiK3Parser`` subclass naming the reasoning / tool parser classes), built here
directly so the probe logs nothing. Its only addition forwards
``extract_tool_calls_streaming`` straight to the K3 tool parser, so probing a live
API server never bumps vLLM's tool-parser Prometheus counter.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from vllm_fix_core import Check, ProbeReport
from vllm_fix_k3_eof_flush.k3vocab import FakeK3Tokenizer

THINK_OPEN = "<|open|>think<|sep|>"
THINK_CLOSE = "<|close|>think<|sep|>"
RESPONSE_OPEN = "<|open|>response<|sep|>"
PROMPT = "<|open|>user<|sep|>hi<|close|>user<|sep|>" + THINK_OPEN

# The failing scenario: streamed content must end "List<" (the "<" arrives with finish_reason="length").
SEQUENCE = ("Plan.", THINK_CLOSE, RESPONSE_OPEN, "List", "<")
# Held text that completes into markers: no marker may leak at EOF.
MARKERS = (
    "Plan.",
    THINK_CLOSE,
    RESPONSE_OPEN,
    "Hi",
    "<|close|>",
    "response<|sep|>",
    "<|close|>message",
    "<|sep|>",
)
REASONING = ("Compare x ", "<")

_TOKENIZER = FakeK3Tokenizer()


@lru_cache(maxsize=2)
def _parser_class(with_tools: bool) -> Any:
    from vllm.parser.kimi_k3 import KimiK3Parser
    from vllm.reasoning.kimi_k3_reasoning_parser import KimiK3ReasoningParser

    tool_cls: Any = None
    if with_tools:
        from vllm.tool_parsers.kimi_k3_tool_parser import KimiK3ToolParser

        tool_cls = KimiK3ToolParser

    def extract_tool_calls_streaming(self: Any, *args: Any, **kwargs: Any) -> Any:
        return self._tool_parser.extract_tool_calls_streaming(*args, **kwargs)

    return type(
        "_ProbeKimiK3Parser",
        (KimiK3Parser,),
        {
            "reasoning_parser_cls": KimiK3ReasoningParser,
            "tool_parser_cls": tool_cls,
            "extract_tool_calls_streaming": extract_tool_calls_streaming,
        },
    )


@lru_cache(maxsize=1)
def _request() -> Any:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest(model="probe", messages=[{"role": "user", "content": "hi"}])


def streamed(pieces: Sequence[str], *, with_tools: bool = False, finished: bool = True) -> tuple[str, str]:
    """(reasoning, content) streamed for `pieces`; the last piece ends the stream if `finished`."""
    parser = _parser_class(with_tools)(_TOKENIZER, None, model_config=None)
    request = _request()
    prompt_ids = _TOKENIZER.encode(PROMPT)
    reasoning, content = "", ""
    for i, piece in enumerate(pieces):
        delta = parser.parse_delta(
            delta_text=piece,
            delta_token_ids=_TOKENIZER.encode(piece),
            request=request,
            prompt_token_ids=prompt_ids,
            finished=finished and i == len(pieces) - 1,
        )
        if delta is not None:
            reasoning += delta.reasoning or ""
            content += delta.content or ""
    return reasoning, content


def probe() -> ProbeReport:
    plain = streamed(SEQUENCE)
    tools = streamed(SEQUENCE, with_tools=True)
    think = streamed(REASONING)
    markers = streamed(MARKERS)
    held = streamed(SEQUENCE, finished=False)
    return ProbeReport(
        (
            Check(
                "content-tail-lost", plain[1] != "List<", f"streamed content {plain[1]!r}, expected 'List<'"
            ),
            Check(
                "content-tail-lost-with-tool-parser",
                tools[1] != "List<",
                f"streamed content {tools[1]!r}, expected 'List<'",
            ),
            Check(
                "reasoning-tail-lost",
                think[0] != "Compare x <",
                f"streamed reasoning {think[0]!r}, expected 'Compare x <'",
            ),
            # Guards: a flush must not leak markers nor release anything before the end.
            Check("marker-leaks-at-eof", markers != ("Plan.", "Hi"), f"streamed {markers!r}", guard=True),
            Check(
                "released-before-eof", held != ("Plan.", "List"), f"streamed {held!r} mid-stream", guard=True
            ),
        )
    )
