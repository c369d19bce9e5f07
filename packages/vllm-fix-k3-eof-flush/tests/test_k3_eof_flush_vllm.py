"""k3-eof-flush on real vLLM (0.32.0 and 0.33.0), through the real ParserManager and the
real serving step, with an in-memory K3 tokenizer (no hub).

Oracle: each streamed channel equals the non-streaming parse of the same model text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from vllm_fix_core import Rung, UnknownShape, runtime
from vllm_fix_core.ladder import evaluate
from vllm_fix_core.patching import PatchSet, layers_of, original_of
from vllm_fix_core.settings import Settings
from vllm_fix_k3_eof_flush import FIX
from vllm_fix_k3_eof_flush import patch as fix_patch
from vllm_fix_k3_eof_flush.harness import (
    RESPONSE_CLOSE,
    RESPONSE_OPEN,
    THINK_CLOSE,
    TOOLS_OPEN,
    Setup,
    call_block,
    chunks_of,
    non_streaming,
    parser_class,
    stream,
    vllm_has_stream_processor,
)
from vllm_fix_testing import vllm_version

PLAIN = Setup()
TOOL_PARSER = Setup(tool_parser=True)  # server with --enable-auto-tool-choice --tool-call-parser kimi_k3
SPEC_22 = ("Plan.", THINK_CLOSE, RESPONSE_OPEN, "List", "<")


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


# Spec §2.2: the named failing cases (negative controls), without and with the tool parser.
FAILING = [
    *(
        Case(
            f"spec-2.2{'-tool-parser' if s.tool_parser else ''}",
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
    # Markup residue (§2.3 policy): the cut falls inside real markup; non-streaming returns it raw.
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


def _check(case: Case, fixed: bool) -> None:
    streamed = stream(case.setup, chunks_of(case.pieces), eos=case.eos)
    oracle = non_streaming(case.setup, "".join(case.pieces))
    for channel, (bug, good) in case.expect.items():
        assert getattr(oracle, channel) == good, f"oracle {channel}"
        assert getattr(streamed, channel) == (good if fixed else bug), channel
    if fixed:
        assert streamed.as_tuple() == oracle.as_tuple()


def test_streaming_step_is_the_serving_one() -> None:
    # 0.33.0 streams through ChatStreamProcessor.step; 0.32.0 has none and calls parse_delta.
    assert vllm_has_stream_processor() is (vllm_version().release >= (0, 33))
    assert parser_class(False).__name__ == "_KimiK3Parser"  # the real ParserManager composition


@pytest.mark.parametrize("case", FAILING, ids=lambda c: c.name)
def test_negative_control_unpatched_loses_the_tail(case: Case, unpatched: None) -> None:
    _check(case, fixed=False)
    streamed = stream(case.setup, chunks_of(case.pieces), eos=case.eos)
    assert streamed.as_tuple() != non_streaming(case.setup, "".join(case.pieces)).as_tuple()


@pytest.mark.parametrize("case", FAILING, ids=lambda c: c.name)
def test_fixed_streams_match_non_streaming(case: Case, patched: object) -> None:
    _check(case, fixed=True)


@pytest.mark.parametrize("case", CONTROLS, ids=lambda c: c.name)
def test_controls_hold_both_ways(case: Case, unpatched: None) -> None:
    for fixed in (False, True):
        if fixed:
            decision = runtime.apply(FIX, Settings(disabled=frozenset(), strict=True))
            assert decision.rung is Rung.APPLIED
        try:
            streamed = stream(case.setup, chunks_of(case.pieces))
            assert streamed.as_tuple() == non_streaming(case.setup, "".join(case.pieces)).as_tuple()
            for channel, (_, good) in case.expect.items():
                assert getattr(streamed, channel) == good
        finally:
            runtime.revert(FIX)


@pytest.mark.parametrize("setup", _both(PLAIN), ids=["plain", "tool-parser"])
def test_nothing_released_before_the_end(setup: Setup, patched: object) -> None:
    cut_off = stream(setup, chunks_of(SPEC_22), finished=False)
    assert cut_off.content == "List"  # still held: "<" may start a marker


def test_closed_call_arguments_survive(patched: object) -> None:
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
    streamed = stream(setup, chunks_of(pieces))
    assert streamed.tool_calls == [("get_weather", '{"q": "ab<"}')]
    assert streamed.as_tuple() == non_streaming(setup, "".join(pieces)).as_tuple()


def test_released_exactly_once(patched: object) -> None:
    from vllm_fix_k3_eof_flush.harness import encode, make_parser

    _, parser, request = make_parser(PLAIN)
    prompt = encode(PLAIN.prompt())
    content = ""
    for i, piece in enumerate(SPEC_22):
        delta = parser.parse_delta(piece, encode(piece), request, prompt, finished=i == len(SPEC_22) - 1)
        content += (delta.content or "") if delta else ""
    again = parser.parse_delta("", [], request, prompt, finished=True)
    assert content == "List<"
    assert again is None or not again.content


def test_pre_existing_non_eof_difference_is_untouched(unpatched: None) -> None:
    """§2.3: without a tool parser, text after <|close|>response<|sep|> streams but is not
    returned by non-streaming. Not caused by EOF; the fix leaves it exactly as it is."""
    pieces = ("Plan.", THINK_CLOSE, RESPONSE_OPEN, "Hi", RESPONSE_CLOSE, "X")
    oracle = non_streaming(PLAIN, "".join(pieces))
    before = stream(PLAIN, chunks_of(pieces))
    with_fix = runtime.apply(FIX, Settings(disabled=frozenset(), strict=True))
    try:
        after = stream(PLAIN, chunks_of(pieces))
        # Held residue after a closed response channel: non-streaming drops it, so does the flush.
        residue = stream(PLAIN, chunks_of((*pieces[:-1], "<|close|>mess")))
    finally:
        runtime.revert(FIX)
    assert with_fix.rung is Rung.APPLIED
    assert (before.content, after.content, oracle.content) == ("HiX", "HiX", "Hi")
    assert residue.content == "Hi"


def test_probe_says_affected_on_both_releases(unpatched: None) -> None:
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
        assert decision.rung is Rung.APPLIED, decision.message
        assert decision.shape == "kimi-k3-0.32.0/0.33.0"
        assert decision.after is not None and not decision.after.affected
    finally:
        runtime.revert(FIX)
    assert FIX.run_probe().affected


def test_recognized_shape_is_the_known_one(k3: object) -> None:
    # Upstream-drift guard: the K3 sources are byte-identical in 0.32.0 and 0.33.0.
    assert fix_patch.recognize() == "kimi-k3-0.32.0/0.33.0"


def test_idempotent_and_exact_revert(k3: object, unpatched: None) -> None:
    cls = k3.KimiK3Parser  # type: ignore[attr-defined]
    original = cls.__dict__["parse_delta"]
    patch = PatchSet(FIX.id)
    fix_patch.apply(patch, "kimi-k3-0.32.0/0.33.0")
    installed = cls.__dict__["parse_delta"]
    fix_patch.apply(patch, "kimi-k3-0.32.0/0.33.0")
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
    assert decision.rung is Rung.REFUSED
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


def test_a_failing_flush_never_harms_the_stream(patched: object, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> str:
        raise RuntimeError("boom")

    monkeypatch.setattr(fix_patch, "held_tail", broken)
    streamed = stream(PLAIN, chunks_of(SPEC_22))
    assert streamed.content == "List"  # vLLM's own final delta, unchanged


def test_plugin_entry_point_registers(k3: object) -> None:
    from importlib.metadata import entry_points

    names = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert names.get("vllm_fix_k3_eof_flush") == "vllm_fix_k3_eof_flush.plugin:register"
    from vllm_fix_k3_eof_flush.plugin import register

    try:
        register()
        assert runtime.decisions()[FIX.id].rung is Rung.APPLIED
        assert stream(PLAIN, chunks_of(SPEC_22)).content == "List<"
    finally:
        runtime.revert(FIX)


def test_fingerprinted_shape_gets_a_plain_delegate(k3: object, patched: object) -> None:
    installed = k3.KimiK3Parser.__dict__["parse_delta"]  # type: ignore[attr-defined]
    assert type(installed).__name__ == "function"
    assert installed.__wrapped__ is original_of(k3.KimiK3Parser, "parse_delta")  # type: ignore[attr-defined]


def test_unfingerprinted_shape_is_wrapped_and_fixed(
    k3: object, unpatched: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fix_patch, "KNOWN_SHAPES", {})
    assert fix_patch.recognize() == "structural"
    decision = runtime.apply(FIX, Settings(disabled=frozenset(), strict=True))
    try:
        assert (decision.rung, decision.shape) == (Rung.APPLIED, "structural")
        installed = k3.KimiK3Parser.__dict__["parse_delta"]  # type: ignore[attr-defined]
        assert type(installed).__name__ == "FunctionWrapper"
        for case in FAILING:
            _check(case, fixed=True)
    finally:
        runtime.revert(FIX)


def test_pre_existing_whitespace_content_with_tool_calls_is_untouched(unpatched: None) -> None:
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
    oracle = non_streaming(setup, "".join(pieces))
    before = stream(setup, chunks_of(pieces))
    runtime.apply(FIX, Settings(disabled=frozenset(), strict=True))
    try:
        after = stream(setup, chunks_of(pieces))
    finally:
        runtime.revert(FIX)
    assert (before.content, after.content, oracle.content) == (" ", " ", "")
    assert (
        before.tool_calls == after.tool_calls == oracle.tool_calls == [("get_weather", '{"city": "Paris"}')]
    )
