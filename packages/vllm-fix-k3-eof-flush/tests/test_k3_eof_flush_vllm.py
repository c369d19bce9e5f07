"""k3-eof-flush on real vLLM, through vLLM's real OpenAI chat server: requests go through
``OpenAIServingChat.create_chat_completion`` (rendering, sampling parameters, the stream
generator's server-sent events or the full generator's response), built by vLLM's own
``init_app_state`` from ``vllm serve`` arguments, with only the engine replaced by a stand-in
that replays a scripted token sequence (``vllm_fix_testing.kimi_k3``). Tokenizer: an
in-memory K3 tokenizer.

Oracle: each streamed channel equals what the non-streaming request returns for the same
model output.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

import pytest

from vllm_fix_core import Answer, PatchSet, Settings, UnknownShape, evaluate, layers_of, original_of, runtime
from vllm_fix_k3_eof_flush import FIX
from vllm_fix_k3_eof_flush import patch as fix_patch
from vllm_fix_testing import assert_hostile_wrapper_fails, vllm_version
from vllm_fix_testing.kimi_k3 import (
    RESPONSE_CLOSE,
    RESPONSE_OPEN,
    THINK_CLOSE,
    TOOLS_OPEN,
    K3Chat,
    Setup,
    call_block,
    chunks_of,
    decode,
    encode,
    k3_tokenizer,
)

PLAIN = Setup()
TOOL_PARSER = Setup(tool_parser=True)  # server with --enable-auto-tool-choice --tool-call-parser kimi_k3
SPEC_22 = ("Plan.", THINK_CLOSE, RESPONSE_OPEN, "List", "<")
KNOWN_SHAPE = "kimi-k3-0.27-0.30" if vllm_version().release < (0, 31) else "kimi-k3-0.31-0.33"


@dataclass(frozen=True)
class Case:
    name: str
    pieces: tuple[str, ...]
    setup: Setup = PLAIN
    eos: bool = False
    # channel -> (value streamed by unpatched vLLM, value after the fix == non-streaming)
    expect: dict[str, tuple[str, str]] = field(default_factory=dict)


def _both(setup: Setup) -> list[Setup]:
    return [setup, Setup(**{**setup.__dict__, "tool_parser": True})]


# The README's failing scenario and its variants (negative controls), without and with the tool parser.
FAILING = [
    *(
        Case(
            f"failing-scenario{'-tool-parser' if s.tool_parser else ''}",
            SPEC_22,
            s,
            expect={"content": ("List", "List<")},
        )
        for s in _both(PLAIN)
    ),
    *(
        Case(
            f"reasoning-phase{'-tool-parser' if s.tool_parser else ''}",
            ("Compare x ", "<"),
            s,
            expect={"reasoning": ("Compare x ", "Compare x <")},
        )
        for s in _both(PLAIN)
    ),
    *(
        Case(
            f"whole-content-held{'-tool-parser' if s.tool_parser else ''}",
            ("Plan.", THINK_CLOSE, RESPONSE_OPEN, "<|"),
            s,
            expect={"content": ("", "<|")},
        )
        for s in _both(PLAIN)
    ),
    *(
        Case(
            f"empty-eos-delta{'-tool-parser' if s.tool_parser else ''}",
            SPEC_22,
            s,
            eos=True,
            expect={"content": ("List", "List<")},
        )
        for s in _both(PLAIN)
    ),
    *(
        Case(
            f"reasoning-hidden{'-tool-parser' if s.tool_parser else ''}",
            SPEC_22,
            s,
            expect={"content": ("List", "List<"), "reasoning": ("", "")},
        )
        for s in _both(Setup(include_reasoning=False))
    ),
    *(
        Case(
            f"instruct{'-tool-parser' if s.tool_parser else ''}",
            ("Use List", "<"),
            s,
            expect={"content": ("Use List", "Use List<")},
        )
        for s in _both(Setup(thinking=False))
    ),
    Case(
        "tools-request", SPEC_22, Setup(tool_parser=True, tools=True), expect={"content": ("List", "List<")}
    ),
    # Markup residue (README, markup-residue policy): the cut falls inside real markup;
    # non-streaming returns it raw.
    Case(
        "residue-content",
        ("Plan.", THINK_CLOSE, RESPONSE_OPEN, "Hi", "<|close|>"),
        expect={"content": ("Hi", "Hi<|close|>")},
    ),
    Case(
        "residue-reasoning", ("Compare", "<|close|>"), expect={"reasoning": ("Compare", "Compare<|close|>")}
    ),
    Case(
        "residue-tools-open",
        ("Plan.", THINK_CLOSE, RESPONSE_OPEN, "Hi", "<|open|>tools"),
        Setup(tool_parser=True, tools=True),
        expect={"content": ("Hi", "Hi<|open|>tools")},
    ),
]

UNCLOSED_CALL = (
    '<|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city" type="string"<|sep|>Par<'
)
# Controls: correct before the fix and after it.
CONTROLS = [
    *(
        Case(f"nothing-held-{i}", ("Plan.", THINK_CLOSE, RESPONSE_OPEN, "a < b"), s)
        for i, s in enumerate(_both(PLAIN))
    ),
    *(
        Case(
            f"held-text-completes-markers-{i}",
            (
                "Plan.",
                THINK_CLOSE,
                RESPONSE_OPEN,
                "Hi",
                "<|close|>",
                "response<|sep|>",
                "<|close|>message",
                "<|sep|>",
            ),
            s,
            expect={"content": ("Hi", "Hi")},
        )
        for i, s in enumerate(_both(PLAIN))
    ),
    Case(
        "unclosed-tool-call",
        ("Plan.", THINK_CLOSE, RESPONSE_OPEN, "Hi", RESPONSE_CLOSE, TOOLS_OPEN, UNCLOSED_CALL),
        Setup(tool_parser=True, tools=True),
        expect={"content": ("Hi", "Hi")},
    ),
    Case(
        "closed-call-argument-ends-with-lt",
        (
            "Plan.",
            THINK_CLOSE,
            RESPONSE_OPEN,
            "Hi",
            RESPONSE_CLOSE,
            TOOLS_OPEN,
            call_block("get_weather", {"q": "ab<"}),
        ),
        Setup(tool_parser=True, tools=True),
        expect={"content": ("Hi", "Hi")},
    ),
]


def think_body_called_content(case: Case) -> bool:
    """vLLM 0.27.1-0.30: non-streaming calls output with thinking on and no complete think
    marker (the opener was the generation prefix) content, streaming reasoning; 0.31 made
    non-streaming agree. Not an end-of-stream difference: there the flush completes the
    streamed reasoning, and the non-streaming oracle is the text as content."""
    text = "".join(case.pieces)
    return vllm_version().release < (0, 31) and case.setup.thinking and "think<|sep|>" not in text


def _check(chat: K3Chat, case: Case, fixed: bool) -> None:
    streamed = chat.stream(case.setup, chunks_of(case.pieces), eos=case.eos)
    oracle = chat.complete(case.setup, "".join(case.pieces))
    for channel, (bug, good) in case.expect.items():
        assert getattr(streamed, channel) == (good if fixed else bug), channel
        if think_body_called_content(case):
            assert (oracle.reasoning, oracle.content) == ("", good)
        else:
            assert getattr(oracle, channel) == good, f"oracle {channel}"
    if fixed and not think_body_called_content(case):
        assert streamed.as_tuple() == oracle.as_tuple()


def test_requests_run_through_vllms_chat_server(chat: K3Chat) -> None:
    server = chat.server(False)
    try:
        importlib.import_module("vllm.entrypoints.openai.chat_completion.serving")
    except ImportError:
        # Only where this environment cannot import vLLM's chat serving module (the shared
        # 0.33.0 venv lacks orjson): vLLM's per-output calls of OpenAIServingChat instead.
        assert vllm_version().release >= (0, 33)
        assert server.mode.startswith("ChatStreamProcessor.step")
    else:
        assert server.mode == "OpenAIServingChat.create_chat_completion"
        assert type(server.chat).__name__ == "OpenAIServingChat"
    assert server.parser_cls.__name__ == "_KimiK3Parser"  # composed by vLLM's ParserManager
    chat.stream(PLAIN, chunks_of(SPEC_22))
    # The prompt vLLM rendered with the model's chat template ends with the think opener.
    assert decode(chat.prompt_ids()).endswith("<|open|>assistant<|sep|><|open|>think<|sep|>")


@pytest.mark.parametrize("case", FAILING, ids=lambda c: c.name)
def test_negative_control_unpatched_loses_the_tail(chat: K3Chat, case: Case, unpatched: None) -> None:
    _check(chat, case, fixed=False)
    streamed = chat.stream(case.setup, chunks_of(case.pieces), eos=case.eos)
    assert streamed.as_tuple() != chat.complete(case.setup, "".join(case.pieces)).as_tuple()
    if think_body_called_content(case):
        return  # the two paths differ there anyway (see think_body_called_content)


@pytest.mark.parametrize("case", FAILING, ids=lambda c: c.name)
def test_fixed_streams_match_non_streaming(chat: K3Chat, case: Case, patched: object) -> None:
    _check(chat, case, fixed=True)


@pytest.mark.parametrize("case", CONTROLS, ids=lambda c: c.name)
def test_controls_hold_both_ways(chat: K3Chat, case: Case, unpatched: None) -> None:
    for fixed in (False, True):
        if fixed:
            decision = runtime.apply(FIX, Settings(disabled=frozenset(), strict=True))
            assert decision.answer is Answer.AFFECTED_FIXED
        try:
            streamed = chat.stream(case.setup, chunks_of(case.pieces))
            assert streamed.as_tuple() == chat.complete(case.setup, "".join(case.pieces)).as_tuple()
            for channel, (_, good) in case.expect.items():
                assert getattr(streamed, channel) == good
        finally:
            runtime.revert(FIX)


@pytest.mark.parametrize("setup", _both(PLAIN), ids=["plain", "tool-parser"])
def test_nothing_released_before_the_end(setup: Setup, chat: K3Chat, patched: object) -> None:
    # vLLM's parser entry point as the serving layer calls it, the stream not yet finished.
    parser = _parser(chat, setup)
    prompt = encode("<|open|>assistant<|sep|><|open|>think<|sep|>")
    content = ""
    for piece in SPEC_22:
        delta = parser.parse_delta(piece, encode(piece), _request(), prompt, finished=False)
        content += (delta.content or "") if delta else ""
    assert content == "List"  # still held: "<" may start a marker


def test_closed_call_arguments_survive(chat: K3Chat, patched: object) -> None:
    setup = Setup(tool_parser=True, tools=True)
    pieces = (
        "Plan.",
        THINK_CLOSE,
        RESPONSE_OPEN,
        "Hi",
        RESPONSE_CLOSE,
        TOOLS_OPEN,
        call_block("get_weather", {"q": "ab<"}),
    )
    streamed = chat.stream(setup, chunks_of(pieces))
    assert streamed.tool_calls == [("get_weather", '{"q": "ab<"}')]
    assert streamed.as_tuple() == chat.complete(setup, "".join(pieces)).as_tuple()


def _request() -> Any:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest(model="k3", messages=[{"role": "user", "content": "hi"}], stream=True)


def _parser(chat: K3Chat, setup: Setup) -> Any:
    """A parser of the class the server composed (vLLM's ParserManager), one per stream."""
    cls = chat.server(setup.tool_parser).parser_cls
    return cls(k3_tokenizer(), None, chat_template_kwargs={"thinking": True}, model_config=None)


def test_released_exactly_once(chat: K3Chat, patched: object) -> None:
    parser = _parser(chat, PLAIN)
    request = _request()
    prompt = encode("<|open|>assistant<|sep|><|open|>think<|sep|>")
    content = ""
    for i, piece in enumerate(SPEC_22):
        delta = parser.parse_delta(piece, encode(piece), request, prompt, finished=i == len(SPEC_22) - 1)
        content += (delta.content or "") if delta else ""
    again = parser.parse_delta("", [], request, prompt, finished=True)
    assert content == "List<"
    assert again is None or not again.content


def test_pre_existing_non_eof_difference_is_untouched(chat: K3Chat, unpatched: None) -> None:
    """README, pre-existing difference 1: without a tool parser, text after
    <|close|>response<|sep|> streams but is not returned by non-streaming. Not caused by EOF;
    the fix leaves it exactly as it is."""
    pieces = ("Plan.", THINK_CLOSE, RESPONSE_OPEN, "Hi", RESPONSE_CLOSE, "X")
    oracle = chat.complete(PLAIN, "".join(pieces))
    before = chat.stream(PLAIN, chunks_of(pieces))
    with_fix = runtime.apply(FIX, Settings(disabled=frozenset(), strict=True))
    try:
        after = chat.stream(PLAIN, chunks_of(pieces))
        # Held residue after a closed response channel: non-streaming drops it, so does the flush.
        residue = chat.stream(PLAIN, chunks_of((*pieces[:-1], "<|close|>mess")))
    finally:
        runtime.revert(FIX)
    assert with_fix.answer is Answer.AFFECTED_FIXED
    assert (before.content, after.content, oracle.content) == ("HiX", "HiX", "Hi")
    assert residue.content == "Hi"


def test_probe_says_affected(unpatched: None) -> None:
    report = FIX.run_probe()
    assert report.affected
    assert report.names(True) == [
        "content-tail-lost",
        "content-tail-lost-with-tool-parser",
        "reasoning-tail-lost",
    ]


def test_probe_after_fix_and_revert(k3: object) -> None:
    decision = runtime.apply(FIX, Settings(disabled=frozenset(), strict=True))
    try:
        assert decision.answer is Answer.AFFECTED_FIXED, decision.message
        assert decision.shape == KNOWN_SHAPE
        assert decision.after is not None and not decision.after.affected
    finally:
        runtime.revert(FIX)
    assert FIX.run_probe().affected


def test_hostile_wrapper_fails_verification(unpatched: None) -> None:
    """The probe observes vLLM's installed parse_delta: a layer calling vLLM's original over
    the fix must make the ladder say "failed to fix" and revert exactly."""
    decision = assert_hostile_wrapper_fails(FIX)
    assert "content-tail-lost=affected" in decision.reason


def test_recognized_shape_is_the_known_one(k3: object) -> None:
    # Upstream-drift guard: 0.27.1-0.30 share one K3 shape, 0.31-0.33 the other.
    assert fix_patch.recognize() == KNOWN_SHAPE


def test_idempotent_and_exact_revert(k3: object, unpatched: None) -> None:
    cls = k3.KimiK3Parser  # type: ignore[attr-defined]
    original = cls.__dict__["parse_delta"]
    patch = PatchSet(FIX.id)
    fix_patch.apply(patch, KNOWN_SHAPE)
    installed = cls.__dict__["parse_delta"]
    fix_patch.apply(patch, KNOWN_SHAPE)
    assert cls.__dict__["parse_delta"] is installed
    assert layers_of(cls, "parse_delta") == [FIX.id]
    assert original_of(cls, "parse_delta") is original
    patch.revert()
    assert cls.__dict__["parse_delta"] is original
    assert layers_of(cls, "parse_delta") == []


def test_runtime_apply_twice_is_a_no_op(k3: object) -> None:
    settings = Settings(disabled=frozenset(), strict=True)
    first = runtime.apply(FIX, settings)
    try:
        assert runtime.apply(FIX, settings) is first
        assert layers_of(k3.KimiK3Parser, "parse_delta") == [FIX.id]  # type: ignore[attr-defined]
    finally:
        runtime.revert(FIX)


def test_stands_down_when_k3_reasoning_is_engine_based(k3: object, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.reasoning.kimi_k3_reasoning_parser import KimiK3ReasoningParser

    monkeypatch.setattr(KimiK3ReasoningParser, "engine_based_streaming", True)
    with pytest.raises(UnknownShape, match="parser engine"):
        fix_patch.recognize()
    decision = evaluate(FIX, Settings(disabled=frozenset(), strict=False), apply=True)
    assert decision.answer is Answer.REFUSED
    assert "standing down" in decision.reason
    assert layers_of(k3.KimiK3Parser, "parse_delta") == []  # type: ignore[attr-defined]


def test_stands_down_when_k3_parser_moved_to_the_engine(k3: object, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.parser.abstract_parser import Parser

    class EngineKimiK3Parser(Parser):  # simulated: K3 served by the parser engine
        engine_based = True

        def is_reasoning_end(self, input_ids: list[int]) -> bool:
            return False

        def parse(self, *args: object, **kwargs: object) -> tuple[None, None, None]:
            return None, None, None

        def parse_delta(self, *args: object, finished: bool, **kwargs: object) -> None:
            return None

    monkeypatch.setattr(k3, "KimiK3Parser", EngineKimiK3Parser)
    with pytest.raises(UnknownShape, match="no longer a DelegatingParser"):
        fix_patch.recognize()


def test_refuses_when_a_helper_is_missing(k3: object, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.tool_parsers.kimi_k3_tool_parser import KimiK3ToolParser

    monkeypatch.delattr(KimiK3ToolParser, "_extract_response_content")
    with pytest.raises(UnknownShape, match="_extract_response_content"):
        fix_patch.recognize()


def test_a_failing_flush_never_harms_the_stream(
    chat: K3Chat, patched: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object, **kwargs: object) -> str:
        raise RuntimeError("boom")

    monkeypatch.setattr(fix_patch, "held_tail", broken)
    streamed = chat.stream(PLAIN, chunks_of(SPEC_22))
    assert streamed.content == "List"  # vLLM's own final delta, unchanged


def test_plugin_entry_point_registers(chat: K3Chat, k3: object) -> None:
    from importlib.metadata import entry_points

    names = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert names.get("vllm_fix_k3_eof_flush") == "vllm_fix_k3_eof_flush.plugin:register"
    from vllm_fix_k3_eof_flush.plugin import register

    try:
        register()
        assert runtime.decisions()[FIX.id].answer is Answer.AFFECTED_FIXED
        assert chat.stream(PLAIN, chunks_of(SPEC_22)).content == "List<"
    finally:
        runtime.revert(FIX)


def test_fingerprinted_shape_gets_a_plain_delegate(k3: object, patched: object) -> None:
    installed = k3.KimiK3Parser.__dict__["parse_delta"]  # type: ignore[attr-defined]
    assert type(installed).__name__ == "function"
    assert installed.__wrapped__ is original_of(k3.KimiK3Parser, "parse_delta")  # type: ignore[attr-defined]


def test_unfingerprinted_shape_is_wrapped_and_fixed(
    chat: K3Chat, k3: object, unpatched: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fix_patch, "KNOWN_SHAPES", {})
    assert fix_patch.recognize() == "structural"
    decision = runtime.apply(FIX, Settings(disabled=frozenset(), strict=True))
    try:
        assert (decision.answer, decision.shape) == (Answer.AFFECTED_FIXED, "structural")
        installed = k3.KimiK3Parser.__dict__["parse_delta"]  # type: ignore[attr-defined]
        assert type(installed).__name__ == "FunctionWrapper"
        for case in FAILING:
            _check(chat, case, fixed=True)
    finally:
        runtime.revert(FIX)


def test_pre_existing_whitespace_content_with_tool_calls_is_untouched(chat: K3Chat, unpatched: None) -> None:
    """Not EOF: with tool calls, non-streaming turns whitespace-only content into None while
    streaming has already sent it (KimiK3Parser._extract_tool_calls). Same with the fix."""
    setup = Setup(tool_parser=True, tools=True)
    pieces = (
        "Plan.",
        THINK_CLOSE,
        RESPONSE_OPEN,
        " ",
        TOOLS_OPEN,
        call_block("get_weather", {"city": "Paris"}),
    )
    oracle = chat.complete(setup, "".join(pieces))
    before = chat.stream(setup, chunks_of(pieces))
    runtime.apply(FIX, Settings(disabled=frozenset(), strict=True))
    try:
        after = chat.stream(setup, chunks_of(pieces))
    finally:
        runtime.revert(FIX)
    assert (before.content, after.content, oracle.content) == (" ", " ", "")
    assert (
        before.tool_calls == after.tool_calls == oracle.tool_calls == [("get_weather", '{"city": "Paris"}')]
    )
