"""The rule alone (no vLLM): injective offsets, layout checks, the listening-TP context."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_fix_handshake_port.rule import (
    PortLayoutError,
    check_layout,
    current_listening_tp_size,
    listening_tp_size,
    port_offset,
    rank_of_offset,
)


@given(st.integers(1, 16), st.integers(1, 64))
def test_offsets_are_injective_and_dense(dp_size: int, tp_size: int) -> None:
    offsets = [port_offset(dp, tp, tp_size) for dp in range(dp_size) for tp in range(tp_size)]
    assert sorted(offsets) == list(range(dp_size * tp_size))


@given(st.integers(0, 100), st.integers(1, 64), st.data())
def test_rank_of_offset_inverts(dp: int, tp_size: int, data: st.DataObject) -> None:
    tp = data.draw(st.integers(0, tp_size - 1))
    assert rank_of_offset(port_offset(dp, tp, tp_size), tp_size) == (dp, tp)


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ((0, 2, 2), ValueError),  # tp_rank outside the engine: would be the next DP rank's port
        ((0, 0, 0), ValueError),
        ((-1, 0, 2), ValueError),
        ((0, -1, 2), ValueError),
        ((0.5, 0, 2), TypeError),
        ((True, 0, 2), TypeError),
    ],
)
def test_port_offset_rejects_bad_input(args: tuple[int, int, int], error: type[Exception]) -> None:
    with pytest.raises(error):
        port_offset(*args)


def test_layout_accepts_disjoint_blocks() -> None:
    check_layout(6301, 61005, 4, 8)
    check_layout(6301, 6333, 4, 8)  # adjacent blocks touch but do not overlap
    check_layout(6301, 6302, 0, 1)  # external-DP sentinel counts as one rank


@pytest.mark.parametrize(
    ("handshake", "notify", "dp", "tp", "text"),
    [
        (6301, 6332, 4, 8, "overlap"),
        (6332, 6301, 4, 8, "overlap"),
        (6301, 6301, 1, 1, "overlap"),
        (65530, 40000, 2, 4, "handshake_port=65530"),
        (6301, 65535, 1, 2, "notify_port=65535"),
        (0, 40000, 1, 1, "handshake_port=0"),
    ],
)
def test_layout_rejects_overlap_and_overflow(
    handshake: int, notify: int, dp: int, tp: int, text: str
) -> None:
    with pytest.raises(PortLayoutError, match=text):
        check_layout(handshake, notify, dp, tp)


def test_listening_context_nests_and_resets() -> None:
    assert current_listening_tp_size() is None
    with listening_tp_size(4):
        assert current_listening_tp_size() == 4
        with listening_tp_size(lambda: 8):
            assert current_listening_tp_size() == 8
        assert current_listening_tp_size() == 4
    assert current_listening_tp_size() is None


def test_listening_context_is_per_thread() -> None:
    seen: list[int | None] = []
    with listening_tp_size(4):
        t = threading.Thread(target=lambda: seen.append(current_listening_tp_size()))
        t.start()
        t.join()
    assert seen == [None]
