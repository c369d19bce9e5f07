"""Drive the real Kimi K3 parsers the way vLLM's chat serving does (tests, benchmark).

* Composition: the real `ParserManager.get_parser(...)` (what `OpenAIServingChat`
  does at startup), one parser instance per stream, `adjust_request` as the
  renderer applies it.
* Streaming: vLLM 0.33.0's `ChatStreamProcessor.step` (the shared chat stream
  step); on 0.32.0, which has no stream processor, `parser.parse_delta(...)`
  with exactly the keywords `chat_completion/serving.py` passes.
* Non-streaming (the oracle): a fresh parser's `parse(...)` as the serving
  layer calls it, then the serving layer's field assembly (0.33.0's
  `assemble_chat_message_fields`; 0.32.0's branch on tool_choice mirrored).

Nothing here replaces vLLM code: every parser call is the installed vLLM's.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from vllm_fix_k3_eof_flush.k3vocab import hf_tokenizer

THINK_OPEN = "<|open|>think<|sep|>"
THINK_CLOSE = "<|close|>think<|sep|>"
RESPONSE_OPEN = "<|open|>response<|sep|>"
RESPONSE_CLOSE = "<|close|>response<|sep|>"
MESSAGE_CLOSE = "<|close|>message<|sep|>"
TOOLS_OPEN = "<|open|>tools<|sep|>"
TOOLS_CLOSE = "<|close|>tools<|sep|>"
CALL_CLOSE = "<|close|>call<|sep|>"
ARG_CLOSE = "<|close|>argument<|sep|>"

PROMPT_HEAD = "<|open|>user<|sep|>hi<|close|>user<|sep|><|open|>assistant<|sep|>"

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def call_block(name: str, args: dict[str, str], index: int = 1) -> str:
    """One complete K3 `call` element with string arguments."""
    body = "".join(f'<|open|>argument key="{k}" type="string"<|sep|>{v}{ARG_CLOSE}' for k, v in args.items())
    return f'<|open|>call tool="{name}" index="{index}"<|sep|>{body}{CALL_CLOSE}'


@dataclass(frozen=True)
class Setup:
    """Server flags + request options of one stream."""

    thinking: bool = True  # chat_template_kwargs thinking (prompt ends in the think opener)
    tool_parser: bool = False  # --enable-auto-tool-choice --tool-call-parser kimi_k3
    tools: bool = False  # the request carries tools (tool_choice="auto")
    include_reasoning: bool = True
    prompt_opener: bool = True  # the prompt ends with the channel opener (generation prefix)

    def prompt(self) -> str:
        if not self.prompt_opener:
            return PROMPT_HEAD
        return PROMPT_HEAD + (THINK_OPEN if self.thinking else RESPONSE_OPEN)


@dataclass
class Channels:
    """What one path produced: reasoning, content, tool calls as (name, arguments)."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[tuple[str, str]] = field(default_factory=list)

    def as_tuple(self) -> tuple[str, str, tuple[tuple[str, str], ...]]:
        return self.reasoning, self.content, tuple(self.tool_calls)


def vllm_has_stream_processor() -> bool:
    try:
        import vllm.entrypoints.openai.chat_completion.stream_processor  # noqa: F401
    except ImportError:
        return False
    return True


@lru_cache(maxsize=4)
def parser_class(tool_parser: bool) -> Any:
    """The server's parser class, composed by the real ParserManager."""
    from vllm.parser.parser_manager import ParserManager

    return ParserManager.get_parser(
        tool_parser_name="kimi_k3" if tool_parser else None,
        reasoning_parser_name="kimi_k3",
        enable_auto_tools=tool_parser,
        model_name="moonshotai/Kimi-K3",
        tokenizer=hf_tokenizer(),
    )


def make_request(setup: Setup) -> Any:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    kwargs: dict[str, Any] = {
        "model": "moonshotai/Kimi-K3",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "include_reasoning": setup.include_reasoning,
        "chat_template_kwargs": {"thinking": setup.thinking},
    }
    if setup.tools:
        kwargs["tools"] = TOOLS
        kwargs["tool_choice"] = "auto"
    return ChatCompletionRequest(**kwargs)


def make_parser(setup: Setup) -> tuple[Any, Any, Any]:
    """(parser class, parser instance, adjusted request) for one stream."""
    cls = parser_class(setup.tool_parser)
    request = make_request(setup)
    parser = cls(
        hf_tokenizer(),
        request.tools,
        chat_template_kwargs=request.chat_template_kwargs,
        model_config=None,
    )
    parser.set_prompt_token_ids(encode(setup.prompt()))
    request = parser.adjust_request(request=request)
    return cls, parser, request


def encode(text: str) -> list[int]:
    return list(hf_tokenizer().encode(text, add_special_tokens=False))


def decode(ids: Sequence[int]) -> str:
    return str(hf_tokenizer().decode(list(ids), skip_special_tokens=False))


def split_ids(ids: Sequence[int], cuts: Sequence[int]) -> list[list[int]]:
    """Split `ids` at the given token offsets (sorted, deduplicated, in range)."""
    bounds = [0, *sorted({c for c in cuts if 0 < c < len(ids)}), len(ids)]
    return [list(ids[a:b]) for a, b in itertools.pairwise(bounds) if b > a] or [[]]


def chunks_of(pieces: Sequence[str]) -> list[list[int]]:
    """Token-id deltas for text pieces (each piece encoded on its own)."""
    return [encode(p) for p in pieces]


def _collect(out: Channels, calls: dict[int, list[str]], delta: Any) -> None:
    if delta is None:
        return
    if delta.reasoning:
        out.reasoning += delta.reasoning
    if delta.content:
        out.content += delta.content
    for tc in delta.tool_calls or []:
        slot = calls.setdefault(tc.index, ["", ""])
        fn = tc.function
        if fn is None:
            continue
        if isinstance(fn, dict):
            name, args = fn.get("name"), fn.get("arguments")
        else:
            name, args = fn.name, fn.arguments
        if name:
            slot[0] = name
        if args:
            slot[1] += args


def stream(
    setup: Setup,
    deltas: Sequence[Sequence[int]],
    *,
    finish_reason: str = "length",
    eos: bool = False,
    finished: bool = True,
) -> Channels:
    """Stream the token-id deltas through the real serving step.

    `eos`: after the deltas, one more empty-text delta carrying the EOS id ends
    the stream (finish_reason "stop"). `finished=False`: the stream is cut off
    without a final delta (what a client sees mid-stream).
    """
    cls, parser, request = make_parser(setup)
    steps: list[tuple[str, list[int]]] = [(decode(d), list(d)) for d in deltas]
    if eos:
        steps.append(("", [hf_tokenizer().eos_token_id]))
        finish_reason = "stop"
    prompt_ids = encode(setup.prompt())
    out = Channels()
    calls: dict[int, list[str]] = {}
    processor = None
    if vllm_has_stream_processor():
        from vllm.entrypoints.openai.chat_completion.stream_processor import ChatStreamProcessor

        processor = ChatStreamProcessor(request, parser, enable_auto_tools=setup.tool_parser, parser_cls=cls)
    for i, (text, ids) in enumerate(steps):
        last = finished and i == len(steps) - 1
        reason = finish_reason if last else None
        if processor is not None:
            delta = processor.step(text, ids, reason, prompt_ids).delta
        else:  # vLLM 0.32.0: chat_completion/serving.py calls parse_delta like this
            delta = parser.parse_delta(
                delta_text=text,
                delta_token_ids=ids,
                request=request,
                prompt_token_ids=prompt_ids,
                finished=reason is not None,
            )
        _collect(out, calls, delta)
    out.tool_calls = [(calls[k][0], calls[k][1]) for k in sorted(calls)]
    return out


def non_streaming(setup: Setup, text: str) -> Channels:
    """What `stream=false` returns for the same model text (the oracle)."""
    cls, parser, request = make_parser(setup)
    reasoning, content, tool_calls = parser.parse(
        text, request, enable_auto_tools=setup.tool_parser, model_output_token_ids=encode(text)
    )
    calls: list[Any]
    try:
        from vllm.entrypoints.openai.chat_completion.message_assembly import (
            assemble_chat_message_fields,
        )
    except ImportError:  # vLLM 0.32.0: chat_completion_full_generator's branches
        if not request.include_reasoning:
            reasoning = None
        keep = (
            request.tools
            and request.tool_choice in ("auto", None)
            and setup.tool_parser
            and cls.tool_parser_cls is not None
        )
        calls = list(tool_calls or []) if keep else []
    else:
        fields = assemble_chat_message_fields(
            request, reasoning, content, tool_calls, enable_auto_tools=setup.tool_parser, parser_cls=cls
        )
        reasoning, content = fields.reasoning, fields.content
        calls = [tc.function for tc in fields.tool_calls]
    return Channels(
        reasoning or "",
        content or "",
        [(c.name, c.arguments) for c in calls],
    )


def describe(setup: Setup, deltas: Sequence[Sequence[int]]) -> str:
    return json.dumps({"setup": setup.__dict__, "deltas": [decode(d) for d in deltas]})
