"""vLLM's real OpenAI API server state over a stand-in engine (tests only).

This machine cannot run a model, so the one piece replaced is the engine behind the API
server: :class:`ScriptedEngineClient` stands in for vLLM's ``EngineClient`` (``AsyncLLM``)
and, for each request, yields the ``RequestOutput`` objects of a scripted token sequence, as
the engine's output processor would (deltas for streaming requests, one final output for
non-streaming ones).

Everything else is vLLM's own code, built the way ``vllm serve`` builds it: vLLM's CLI parser
(``make_arg_parser``), ``AsyncEngineArgs.from_cli_args(...).create_engine_config()``, the real
renderer (``renderer_from_config``, so the chat template and the tokenizer are loaded from the
model folder by vLLM) and ``init_app_state``, which constructs ``OpenAIServingChat`` and the
other serving objects with their parsers. A request then runs through
``OpenAIServingChat.create_chat_completion``: rendering, sampling parameters, the stream
generator (server-sent events) or the full generator, exactly where users see them.

Where the installed vLLM's chat serving module cannot be imported in this environment (the
shared vLLM 0.33.0 test venv lacks ``orjson``, which ``vllm.entrypoints.serve.utils.api_utils``
imports), :func:`openai_server` builds a :class:`ChatStepServer` instead: the same vLLM
configuration, renderer and parser composition, the chat request rendered by vLLM's real
``OnlineRenderer``, then the calls ``OpenAIServingChat`` makes per engine output: 0.33.0's
``ChatStreamProcessor.step`` for a stream, ``parser.parse`` + ``assemble_chat_message_fields``
for a full response. ``Server.mode`` says which one ran.
"""

from __future__ import annotations

import asyncio
import importlib
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Step:
    """One engine step of the script: the detokenized text and the token ids it adds."""

    text: str
    token_ids: tuple[int, ...]


class ScriptedEngineClient:
    """Stand-in for vLLM's ``EngineClient``: what the API server calls on it.

    ``script`` (a list of :class:`Step`) and ``finish_reason`` are set before each request;
    ``generate`` replays them as ``RequestOutput`` objects for the prompt vLLM rendered.
    """

    errored = False
    is_running = True
    is_stopped = False
    dead_error: BaseException | None = None

    def __init__(self, vllm_config: Any, renderer: Any) -> None:
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.renderer = renderer
        self.input_processor = None  # the chat path renders through the renderer
        self.script: list[Step] = []
        self.finish_reason = "length"
        self.prompts: list[list[int]] = []  # the prompt token ids of every request, in order

    def check_admission(self, n: int) -> None:
        return None

    async def is_tracing_enabled(self) -> bool:
        return False

    async def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    async def do_log_stats(self) -> None:
        return None

    async def abort(self, request_id: Any, *args: Any, **kwargs: Any) -> None:
        return None

    async def generate(
        self, prompt: Any, sampling_params: Any, request_id: str, *args: Any, **kwargs: Any
    ) -> AsyncIterator[Any]:
        from vllm.outputs import CompletionOutput, RequestOutput
        from vllm.sampling_params import RequestOutputKind

        prompt_ids = list(prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt.prompt_token_ids)
        self.prompts.append(prompt_ids)
        script = list(self.script) or [Step("", ())]
        kind = getattr(sampling_params, "output_kind", RequestOutputKind.CUMULATIVE)
        if kind is RequestOutputKind.FINAL_ONLY:
            text = "".join(s.text for s in script)
            ids = [i for s in script for i in s.token_ids]
            script = [Step(text, tuple(ids))]
        text_so_far, ids_so_far = "", list[int]()
        for n, step in enumerate(script):
            last = n == len(script) - 1
            text_so_far += step.text
            ids_so_far += step.token_ids
            cumulative = kind is RequestOutputKind.CUMULATIVE
            out = CompletionOutput(
                index=0,
                text=text_so_far if cumulative else step.text,
                token_ids=list(ids_so_far if cumulative else step.token_ids),
                cumulative_logprob=None,
                logprobs=None,
                finish_reason=self.finish_reason if last else None,
            )
            yield RequestOutput(
                request_id=request_id,
                prompt=None,
                prompt_token_ids=prompt_ids,
                prompt_logprobs=None,
                outputs=[out],
                finished=last,
            )


def _first(*names: str) -> Any:
    for name in names:
        module, _, attr = name.rpartition(".")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError):
            continue
    raise ImportError("none of " + ", ".join(names) + " is part of this vLLM")


@dataclass
class Server:
    """One API server: its engine stand-in and the app state ``init_app_state`` filled."""

    engine: ScriptedEngineClient
    state: Any
    args: Any
    mode = "OpenAIServingChat.create_chat_completion"

    @property
    def chat(self) -> Any:
        """The server's ``OpenAIServingChat``."""
        return self.state.openai_serving_chat

    @property
    def parser_cls(self) -> Any:
        """The parser class the server composed (``ParserManager.get_parser``)."""
        return self.chat.parser_cls

    def chat_completion(self, request: Any, script: Sequence[Step], *, finish_reason: str = "length") -> Any:
        """Run one chat completion: the SSE events (a list of parsed JSON chunks) when
        ``request.stream``, else the ``ChatCompletionResponse``."""
        self.engine.script = list(script)
        self.engine.finish_reason = finish_reason
        return asyncio.run(self._run(request))

    async def _run(self, request: Any) -> Any:
        result = await self.chat.create_chat_completion(request)
        if not getattr(request, "stream", False):
            return result
        if not hasattr(result, "__aiter__"):
            raise AssertionError(f"streaming request answered {result!r}")
        events: list[Any] = []
        async for line in result:
            for part in line.split("\n\n"):
                if not part.startswith("data: "):
                    continue
                data = part[len("data: ") :]
                if data != "[DONE]":
                    events.append(json.loads(data))
        return events


class ChatStepServer:
    """vLLM's chat serving calls without ``OpenAIServingChat`` (see the module docstring)."""

    mode = "ChatStreamProcessor.step / assemble_chat_message_fields"

    def __init__(self, engine: ScriptedEngineClient, args: Any) -> None:
        from vllm.parser.parser_manager import ParserManager
        from vllm.renderers.online_renderer import OnlineRenderer

        self.engine = engine
        self.args = args
        reasoning_parser = engine.vllm_config.structured_outputs_config.reasoning_parser
        self.enable_auto_tools = bool(args.enable_auto_tool_choice)
        self.online_renderer = OnlineRenderer(
            model_config=engine.model_config,
            renderer=engine.renderer,
            request_logger=None,
            chat_template=None,
            chat_template_content_format=args.chat_template_content_format,
            enable_auto_tools=self.enable_auto_tools,
            tool_parser=args.tool_call_parser,
            reasoning_parser=reasoning_parser,
        )
        # As OpenAIServingChat.__init__ composes it.
        self.parser_cls = ParserManager.get_parser(
            tool_parser_name=args.tool_call_parser,
            reasoning_parser_name=reasoning_parser,
            enable_auto_tools=self.enable_auto_tools,
            model_name=engine.model_config.model,
            tokenizer=engine.renderer.tokenizer,
        )

    def chat_completion(self, request: Any, script: Sequence[Step], *, finish_reason: str = "length") -> Any:
        self.engine.script = list(script)
        self.engine.finish_reason = finish_reason
        return asyncio.run(self._run(request))

    def _make_parser(self, request: Any) -> Any:
        # As OpenAIServingChat._make_parser does.
        kwargs = request.build_chat_params(None, self.args.chat_template_content_format).chat_template_kwargs
        return self.parser_cls(
            self.engine.renderer.tokenizer,
            request.tools,
            chat_template_kwargs=kwargs,
            model_config=self.engine.model_config,
        )

    async def _run(self, request: Any) -> Any:
        from types import SimpleNamespace

        from vllm.entrypoints.openai.chat_completion.message_assembly import assemble_chat_message_fields
        from vllm.entrypoints.openai.chat_completion.stream_processor import ChatStreamProcessor

        parser = self._make_parser(request)
        _, engine_inputs = await self.online_renderer.render_chat(request)
        (engine_input,) = engine_inputs
        params = request.to_sampling_params(64, {})
        outputs = self.engine.generate(engine_input, params, "chatcmpl-step")
        if getattr(request, "stream", False):
            processor = ChatStreamProcessor(
                request, parser, enable_auto_tools=self.enable_auto_tools, parser_cls=self.parser_cls
            )
            events: list[Any] = []
            async for res in outputs:
                for out in res.outputs:
                    delta, reason = processor.step(
                        out.text, list(out.token_ids), out.finish_reason, res.prompt_token_ids
                    )
                    if delta is None and reason is None:
                        continue
                    body = delta.model_dump(exclude_none=True) if delta is not None else {}
                    events.append({"choices": [{"index": 0, "delta": body, "finish_reason": reason}]})
            return events
        final = [res async for res in outputs][-1]
        out = final.outputs[0]
        parser.set_prompt_token_ids(final.prompt_token_ids)
        reasoning, content, tool_calls = parser.parse(
            out.text, request, enable_auto_tools=self.enable_auto_tools, model_output_token_ids=out.token_ids
        )
        fields = assemble_chat_message_fields(
            request,
            reasoning,
            content,
            tool_calls,
            enable_auto_tools=self.enable_auto_tools,
            parser_cls=self.parser_cls,
        )
        message = SimpleNamespace(
            reasoning=fields.reasoning, content=fields.content, tool_calls=fields.tool_calls
        )
        return SimpleNamespace(choices=[SimpleNamespace(message=message, finish_reason=out.finish_reason)])


def openai_server(cli: Sequence[str]) -> Server | ChatStepServer:
    """Build the API server state for ``vllm serve`` with these CLI arguments (``--model`` first)."""
    from starlette.datastructures import State
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.renderers.registry import renderer_from_config
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    make_arg_parser = _first(
        "vllm.entrypoints.common.cli_args.make_arg_parser",
        "vllm.entrypoints.launchers.cli_args.make_arg_parser",
        "vllm.entrypoints.openai.cli_args.make_arg_parser",
    )
    validate = _first(
        "vllm.entrypoints.common.cli_args.validate_parsed_serve_args",
        "vllm.entrypoints.launchers.cli_args.validate_parsed_serve_args",
        "vllm.entrypoints.openai.cli_args.validate_parsed_serve_args",
    )
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(list(cli))
    validate(args)
    vllm_config = AsyncEngineArgs.from_cli_args(args).create_engine_config(
        usage_context=UsageContext.OPENAI_API_SERVER
    )
    engine = ScriptedEngineClient(vllm_config, renderer_from_config(vllm_config))
    try:
        importlib.import_module("vllm.entrypoints.openai.chat_completion.serving")
        init_app_state = _first(
            "vllm.entrypoints.launchers.api_server.app_state.init_app_state",
            "vllm.entrypoints.openai.api_server.init_app_state",
        )
    except ImportError:
        return ChatStepServer(engine, args)
    state = State()
    asyncio.run(init_app_state(engine, state, args, supported_tasks=("generate",)))
    return Server(engine, state, args)
