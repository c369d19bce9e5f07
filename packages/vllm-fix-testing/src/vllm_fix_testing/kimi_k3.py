"""Kimi K3 behind vLLM's real OpenAI chat server, on CPU (tests only).

The real Kimi K3 tokenizer and chat template come from the hub; this machine is offline. What
stands in for them:

* :func:`k3_tokenizer`: a real ``transformers.PreTrainedTokenizerFast`` over a byte-level BPE
  with the K3 special tokens (``<|open|>``, ``<|close|>``, ``<|sep|>``, ``<|end_of_msg|>``),
  built in memory;
* :data:`CHAT_TEMPLATE`: a K3-shaped chat template (``<|open|>role<|sep|>...<|close|>role<|sep|>``)
  whose generation prompt ends with the think opener (``thinking`` on, the default), the
  response opener (``thinking`` off), or no channel opener (``prefix`` off);
* :func:`k3_model_dir`: a model folder (a tiny architecture config, that tokenizer and the
  template) that vLLM loads itself.

:class:`K3Chat` then runs requests through vLLM's real ``OpenAIServingChat`` (see
:mod:`vllm_fix_testing.openai_server`), the server started with ``--reasoning-parser kimi_k3``
and optionally ``--enable-auto-tool-choice --tool-call-parser kimi_k3``, and reads what a
client reads: the streamed channels from the server-sent events, or the non-streaming
response's message. The model output is scripted as token-id deltas.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from vllm_fix_testing.openai_server import ChatStepServer, Server, Step, openai_server
from vllm_fix_testing.real import TINY_MODEL_CONFIG

OPEN, CLOSE, SEP, EOM = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
SPECIAL = (OPEN, CLOSE, SEP, EOM)

THINK_OPEN = "<|open|>think<|sep|>"
THINK_CLOSE = "<|close|>think<|sep|>"
RESPONSE_OPEN = "<|open|>response<|sep|>"
RESPONSE_CLOSE = "<|close|>response<|sep|>"
MESSAGE_CLOSE = "<|close|>message<|sep|>"
TOOLS_OPEN = "<|open|>tools<|sep|>"
TOOLS_CLOSE = "<|close|>tools<|sep|>"
CALL_CLOSE = "<|close|>call<|sep|>"
ARG_CLOSE = "<|close|>argument<|sep|>"

CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "<|open|>{{ m['role'] }}<|sep|>{{ m['content'] }}<|close|>{{ m['role'] }}<|sep|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|open|>assistant<|sep|>"
    "{%- if prefix is not defined or prefix -%}"
    "{%- if thinking is defined and not thinking -%}<|open|>response<|sep|>"
    "{%- else -%}<|open|>think<|sep|>{%- endif -%}"
    "{%- endif -%}"
    "{%- endif -%}"
)
MODEL_NAME = "kimi-k3-standin"

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


@lru_cache(maxsize=1)
def k3_tokenizer() -> Any:
    """A real PreTrainedTokenizerFast whose special tokens are the K3 markers'."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: i for i, symbol in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOM, chat_template=CHAT_TEMPLATE)


def k3_model_dir(root: Path) -> Path:
    """A model folder vLLM loads itself: tiny architecture config, K3 tokenizer, K3 template."""
    root.mkdir(parents=True, exist_ok=True)
    k3_tokenizer().save_pretrained(str(root))
    (root / "config.json").write_text(json.dumps(TINY_MODEL_CONFIG))
    return root


def encode(text: str) -> list[int]:
    return list(k3_tokenizer().encode(text, add_special_tokens=False))


def decode(ids: Sequence[int]) -> str:
    return str(k3_tokenizer().decode(list(ids), skip_special_tokens=False))


def split_ids(ids: Sequence[int], cuts: Sequence[int]) -> list[list[int]]:
    """Split `ids` at the given token offsets (sorted, deduplicated, in range)."""
    bounds = [0, *sorted({c for c in cuts if 0 < c < len(ids)}), len(ids)]
    return [list(ids[a:b]) for a, b in itertools.pairwise(bounds) if b > a] or [[]]


def chunks_of(pieces: Sequence[str]) -> list[list[int]]:
    """Token-id deltas for text pieces (each piece encoded on its own)."""
    return [encode(p) for p in pieces]


def call_block(name: str, args: dict[str, str], index: int = 1) -> str:
    """One complete K3 `call` element with string arguments."""
    body = "".join(f'<|open|>argument key="{k}" type="string"<|sep|>{v}{ARG_CLOSE}' for k, v in args.items())
    return f'<|open|>call tool="{name}" index="{index}"<|sep|>{body}{CALL_CLOSE}'


@dataclass(frozen=True)
class Setup:
    """Server flags + request options of one chat completion."""

    thinking: bool = True  # chat_template_kwargs thinking
    tool_parser: bool = False  # --enable-auto-tool-choice --tool-call-parser kimi_k3
    tools: bool = False  # the request carries tools (tool_choice="auto")
    include_reasoning: bool = True
    prompt_opener: bool = True  # the generation prompt ends with the channel opener


@dataclass
class Channels:
    """What a client received: reasoning, content, tool calls as (name, arguments)."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[tuple[str, str]] = field(default_factory=list)
    finish_reason: str | None = None

    def as_tuple(self) -> tuple[str, str, tuple[tuple[str, str], ...]]:
        return self.reasoning, self.content, tuple(self.tool_calls)


class K3Chat:
    """Chat completions against vLLM's real OpenAI chat server, one per server flag set."""

    def __init__(self, root: Path) -> None:
        self.model = str(k3_model_dir(root))
        self._servers: dict[bool, Server | ChatStepServer] = {}

    def server(self, tool_parser: bool) -> Server | ChatStepServer:
        if tool_parser not in self._servers:
            cli = ["--model", self.model, "--served-model-name", MODEL_NAME, "--reasoning-parser", "kimi_k3"]
            if tool_parser:
                cli += ["--enable-auto-tool-choice", "--tool-call-parser", "kimi_k3"]
            self._servers[tool_parser] = openai_server(cli)
        return self._servers[tool_parser]

    def request(self, setup: Setup, *, stream: bool) -> Any:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        kwargs: dict[str, Any] = {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": "hi"}],
            "stream": stream,
            "include_reasoning": setup.include_reasoning,
            "chat_template_kwargs": {"thinking": setup.thinking, "prefix": setup.prompt_opener},
        }
        if setup.tools:
            kwargs["tools"] = TOOLS
            kwargs["tool_choice"] = "auto"
        return ChatCompletionRequest(**kwargs)

    def stream(
        self,
        setup: Setup,
        deltas: Sequence[Sequence[int]],
        *,
        finish_reason: str = "length",
        eos: bool = False,
    ) -> Channels:
        """What a streaming client receives when the model emits these token-id deltas.

        `eos`: one more empty-text step carrying the EOS id ends the stream ("stop")."""
        script = [Step(decode(d), tuple(d)) for d in deltas]
        if eos:
            script.append(Step("", (int(k3_tokenizer().eos_token_id),)))
            finish_reason = "stop"
        events = self.server(setup.tool_parser).chat_completion(
            self.request(setup, stream=True), script, finish_reason=finish_reason
        )
        out = Channels()
        calls: dict[int, list[str]] = {}
        for event in events:
            if "error" in event or event.get("object") == "error":
                raise AssertionError(f"the stream reported an error: {event}")
            for choice in event.get("choices", []):
                delta = choice.get("delta") or {}
                out.reasoning += delta.get("reasoning") or delta.get("reasoning_content") or ""
                out.content += delta.get("content") or ""
                for tc in delta.get("tool_calls") or []:
                    slot = calls.setdefault(tc.get("index", 0), ["", ""])
                    fn = tc.get("function") or {}
                    slot[0] = fn.get("name") or slot[0]
                    slot[1] += fn.get("arguments") or ""
                out.finish_reason = choice.get("finish_reason") or out.finish_reason
        out.tool_calls = [(calls[k][0], calls[k][1]) for k in sorted(calls)]
        return out

    def complete(self, setup: Setup, text: str, *, finish_reason: str = "length") -> Channels:
        """What a non-streaming client receives for the same model output (the oracle)."""
        ids = encode(text)
        response = self.server(setup.tool_parser).chat_completion(
            self.request(setup, stream=False), [Step(text, tuple(ids))], finish_reason=finish_reason
        )
        if not hasattr(response, "choices"):
            raise AssertionError(f"the request failed: {response!r}")
        message = response.choices[0].message
        reasoning = getattr(message, "reasoning", None) or getattr(message, "reasoning_content", None)
        return Channels(
            reasoning or "",
            message.content or "",
            [(tc.function.name, tc.function.arguments) for tc in message.tool_calls or []],
            response.choices[0].finish_reason,
        )

    def prompt_ids(self, tool_parser: bool = False) -> list[int]:
        """The prompt token ids vLLM rendered for the last request on that server."""
        return self.server(tool_parser).engine.prompts[-1]


def describe(setup: Setup, deltas: Sequence[Sequence[int]]) -> str:
    return json.dumps({"setup": setup.__dict__, "deltas": [decode(d) for d in deltas]})
