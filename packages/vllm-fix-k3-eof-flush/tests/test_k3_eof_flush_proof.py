"""Issue 22 for k3-eof-flush, on real vLLM: every patched target observed, an oracle that is
not the fix's own rule, and patched ``parse_delta`` never raising where vLLM's did not."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_fix_core import Answer, Settings, evaluate, layers_of
from vllm_fix_core.patching import original_of
from vllm_fix_k3_eof_flush import FIX, probe
from vllm_fix_k3_eof_flush import patch as fix_patch
from vllm_fix_testing import assert_every_target_observed
from vllm_fix_testing.hostile import patched_targets


def test_every_patched_target_is_observed(unpatched: None) -> None:
    """vLLM's own parse_delta layered over the fix's one target: "failed to fix", exact revert."""
    assert patched_targets(FIX) == ["KimiK3Parser.parse_delta"]
    decisions = assert_every_target_observed(FIX)
    assert "content-tail-lost=affected" in decisions["KimiK3Parser.parse_delta"].reason


# -- the oracle is the spec, not the rule ---------------------------------------------------------
#
# The probe's expected answers are the README's failing scenario written out ('List<',
# 'Compare x <', no marker at EOF, nothing released before it): literals, never a call into
# rule.py. Break the rule the patch uses, at the reference patch.py holds, and the ladder must
# answer "failed to fix".


def _never_released(*args: object, **kwargs: object) -> str:
    return ""  # the rule broken: nothing is ever held back "only because it might start a marker"


def _released_twice(real: Callable[..., str]) -> Callable[..., str]:
    def twice(*args: Any, **kwargs: Any) -> str:
        return real(*args, **kwargs) * 2  # the rule broken: the tail released as two copies

    return twice


BREAKS = {
    # the content tail without a tool parser and the reasoning tail come from held_tail;
    # the content tail with the K3 tool parser from next_chunk_tail
    "held_tail-never": ("held_tail", _never_released, {"content-tail-lost", "reasoning-tail-lost"}),
    "held_tail-twice": ("held_tail", None, {"content-tail-lost", "reasoning-tail-lost"}),
    "next_chunk_tail-never": ("next_chunk_tail", _never_released, {"content-tail-lost-with-tool-parser"}),
    "next_chunk_tail-twice": ("next_chunk_tail", None, {"content-tail-lost-with-tool-parser"}),
}


@pytest.mark.parametrize("name", list(BREAKS))
def test_broken_rule_fails_verification(
    name: str, k3: Any, unpatched: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    attr, broken, expected = BREAKS[name]
    monkeypatch.setattr(fix_patch, attr, broken or _released_twice(getattr(fix_patch, attr)))
    decision = evaluate(FIX, Settings(disabled=frozenset(), strict=False), apply=True, honour_disable=False)
    assert decision.answer is Answer.FAILED_TO_FIX, decision.reason
    assert decision.after is not None
    assert set(decision.after.names(True)) == expected
    # The ladder reverted: vLLM's own parse_delta is back, nothing of the fix is left.
    assert layers_of(k3.KimiK3Parser, "parse_delta") == []


# -- patched never raises where vLLM did not ------------------------------------------------------
#
# KimiK3Parser.parse_delta(delta_text: str, delta_token_ids: list[int], request,
# prompt_token_ids: list[int] | None = None, *, finished: bool), driven the way vLLM's types
# allow: any text (markers, marker prefixes, plain text, empty), token ids that match the text,
# are empty or are arbitrary ids, prompt ids or None, finished on any delta (also more than
# once, also mid-text), reasoning shown or hidden, thinking on / off / not given, with or
# without the K3 tool parser. vLLM's own parse_delta (original_of) on one parser, the installed
# (patched) one on an identical second parser.

PIECES = [
    "<|open|>",
    "<|close|>",
    "<|sep|>",
    "<|end_of_msg|>",
    "think",
    "response",
    "tools",
    "message",
    "call",
    "<",
    "<|",
    "<|clo",
    "<|close|>resp",
    "a",
    " ",
    "List",
    '{"q": 1}',
    "",
]


@st.composite
def streams(draw: st.DrawFn) -> dict[str, Any]:
    deltas = []
    for _ in range(draw(st.integers(1, 8))):
        text = "".join(draw(st.lists(st.sampled_from(PIECES), max_size=3)))
        ids = draw(st.sampled_from(["encoded", "empty", "arbitrary"]))
        token_ids = (
            probe._TOKENIZER.encode(text)
            if ids == "encoded"
            else []
            if ids == "empty"
            else draw(st.lists(st.integers(0, 2**31), max_size=3))
        )
        deltas.append((text, token_ids, draw(st.booleans())))
    return {
        "with_tools": draw(st.booleans()),
        "include_reasoning": draw(st.booleans()),
        "kwargs": draw(st.sampled_from([None, {"thinking": True}, {"thinking": False}])),
        "prompt": draw(st.sampled_from([None, probe.PROMPT, "<|open|>user<|sep|>hi"])),
        "deltas": deltas,
    }


def _feed(parse: Callable[..., Any], stream: dict[str, Any]) -> list[tuple[str, Any]]:
    """Each delta's result (a dump of the DeltaMessage, or None), or the exception it raised."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    request = ChatCompletionRequest(
        model="probe",
        messages=[{"role": "user", "content": "hi"}],
        include_reasoning=stream["include_reasoning"],
    )
    prompt = None if stream["prompt"] is None else probe._TOKENIZER.encode(stream["prompt"])
    results: list[tuple[str, Any]] = []
    for text, ids, finished in stream["deltas"]:
        try:
            delta = parse(text, list(ids), request, prompt, finished=finished)
        except Exception as exc:
            results.append(("raised", type(exc)))
            break
        results.append(("ok", None if delta is None else delta.model_dump()))
    return results


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=streams())
def test_patched_never_raises_where_vllm_does_not(
    k3: Any, patched_module: object, stream: dict[str, Any]
) -> None:
    cls = probe._parser_class(stream["with_tools"])
    original = original_of(k3.KimiK3Parser, "parse_delta")
    assert cls.parse_delta is not original  # the fix is installed
    kwargs = stream["kwargs"]
    extra = {} if kwargs is None else {"chat_template_kwargs": kwargs}
    vllm_parser = cls(probe._TOKENIZER, None, model_config=None, **extra)
    fixed_parser = cls(probe._TOKENIZER, None, model_config=None, **extra)
    before = _feed(functools.partial(original, vllm_parser), stream)
    after = _feed(fixed_parser.parse_delta, stream)
    for i, ((kind_b, out_b), (kind_a, out_a)) in enumerate(zip(before, after, strict=False)):
        if kind_b == "ok":
            assert kind_a == "ok", f"delta {i}: patched raised {out_a} where vLLM returned"
        if kind_b == "raised" or kind_a == "raised":
            assert (kind_a, out_a) == (kind_b, out_b), f"delta {i}: {before[i]} vs {after[i]}"
            break
        _, _, finished = stream["deltas"][i]
        if not finished:
            assert out_a == out_b, f"delta {i} (not final): the fix changed it"
            continue
        # The first final delta: vLLM's delta, with at most a tail appended to one channel.
        got = out_a or {}
        want = out_b or {}
        for key in set(got) | set(want):
            if key in ("content", "reasoning"):
                assert (got.get(key) or "").startswith(want.get(key) or ""), (key, want, got)
            elif out_b is not None:
                assert got.get(key) == want.get(key), (key, want, got)
        break  # after a final delta, the two parsers' states legitimately differ
