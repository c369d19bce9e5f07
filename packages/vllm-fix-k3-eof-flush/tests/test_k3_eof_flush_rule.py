"""The fix's own rule (rule.py), without vLLM: toy readiness helpers built from a marker table."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from vllm_fix_k3_eof_flush.rule import MAX_TAIL, TERMINATOR, held_tail, next_chunk_tail

MARKS = ("<|close|>x<|sep|>", "<|open|>y<|sep|>")


def ready(text: str) -> str:
    """Toy helper: drop complete markers, hold back a proper marker prefix at the end."""
    for m in MARKS:
        text = text.replace(m, "")
    hold = max((n for m in MARKS for n in range(1, len(m)) if text.endswith(m[:n])), default=0)
    return text[: len(text) - hold]


class Cursor:
    """Toy stateful helper: remembers what it sent, like the K3 tool parser's."""

    def __init__(self) -> None:
        self.sent = 0

    def __call__(self, text: str) -> str | None:
        end = len(ready(text))
        if end <= self.sent:
            return None
        chunk, self.sent = ready(text)[self.sent : end], end
        return chunk


def test_releases_the_held_prefix() -> None:
    assert held_tail(ready, "List<") == "<"
    assert held_tail(ready, "a<|close|>x<|se") == "<|close|>x<|se"
    assert held_tail(ready, "<|") == "<|"


def test_nothing_held_nothing_released() -> None:
    assert held_tail(ready, "a < b") == ""
    assert held_tail(ready, "") == ""
    assert held_tail(ready, "Hi<|close|>x<|sep|>") == ""  # a complete marker is never released


def test_confirmation_by_the_non_streaming_result() -> None:
    assert held_tail(ready, "List<", whole="List<") == "<"
    assert held_tail(ready, "List<", whole="List") == ""  # non-streaming drops it: release nothing


def test_a_helper_that_keeps_the_terminator_back_releases_nothing() -> None:
    assert held_tail(lambda t: t[:-1], "abc<") == ""
    assert held_tail(lambda t: t.replace(TERMINATOR, ""), "abc<") == ""


def test_implausible_tails_are_refused() -> None:
    def greedy(text: str) -> str:
        return text if text.endswith(TERMINATOR) else ""

    assert held_tail(greedy, "x" * MAX_TAIL) == ""  # longer than any marker
    assert held_tail(greedy, "a<|sep|>") == ""  # holds a complete separator


def test_stateful_helper_releases_once() -> None:
    cursor = Cursor()
    assert cursor("Hi<|cl") == "Hi"
    assert next_chunk_tail(cursor, "Hi<|cl") == "<|cl"
    assert next_chunk_tail(cursor, "Hi<|cl") == ""


@given(
    st.lists(st.sampled_from(["a", " ", "<", "<|", "<|close|>", "x", "<|sep|>", "<|open|>y"]), max_size=12)
)
def test_sent_plus_tail_is_everything_but_complete_markers(parts: list[str]) -> None:
    text = "".join(parts)
    tail = held_tail(ready, text)
    final = ready(text + TERMINATOR)[:-1]
    assert ready(text) + tail == final
    assert "<|sep|>" not in tail
