"""The registration rule alone (no vLLM, no torch): examples and properties."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from vllm_fix_mr_extent.rule import (
    PAGE_SIZE,
    Region,
    SharedMRError,
    Storage,
    align_down,
    plan_shared_mr,
    registration_problems,
)

GPU0 = "cuda:0"


def storage(start: int, nbytes: int, device: str = GPU0) -> Storage:
    return Storage(start=start, nbytes=nbytes, device=device)


def region(layer: str, ptr: int, nbytes: int, on: Storage, index: int = 0) -> Region:
    return Region(layer=layer, index=index, ptr=ptr, nbytes=nbytes, storage=on)


# ---- the §2.3 table, as pure inputs -------------------------------------------------------------

START = 0x7F00_0000_0000


def test_unaligned_storage_tail_layer() -> None:
    s = storage(START + 128, 8192)
    ptr = s.end - 64
    plan = plan_shared_mr([region("kda", ptr, 64, s)], {"kda": ptr})
    assert plan.base == align_down(ptr) and plan.base % PAGE_SIZE == 0
    assert plan.end == s.end
    assert plan.offsets == {"kda": ptr - plan.base}
    assert plan.storage_offset == plan.base - s.start >= 0


def test_unaligned_storage_layer_on_page_boundary() -> None:
    s = storage(START + 128, 8192)
    ptr = START + PAGE_SIZE
    plan = plan_shared_mr([region("kda", ptr, 64, s)], {"kda": ptr})
    assert plan.base == ptr
    assert plan.offsets == {"kda": 0}
    assert plan.length == 64


def test_unpadded_aligned_storage_ends_exactly() -> None:
    s = storage(START, 8256)
    plan = plan_shared_mr(
        [region("a", START, 64, s), region("b", s.end - 64, 64, s)], {"a": START, "b": s.end - 64}
    )
    assert (plan.base, plan.end) == (START, START + 8256)
    assert plan.offsets == {"a": 0, "b": 8192}


def test_aligned_control() -> None:
    s = storage(START, 8192)
    plan = plan_shared_mr(
        [region("a", START, 4096, s), region("b", START + 4096, 4096, s)],
        {"a": START, "b": START + 4096},
    )
    assert (plan.base, plan.length, plan.storage_offset) == (START, 8192, 0)


def test_every_region_counts_not_only_the_first() -> None:
    s = storage(START, 8192)
    plan = plan_shared_mr(
        [region("attn", START, 4096, s, 0), region("attn", START + 4096, 4096, s, 1)], {"attn": START}
    )
    assert plan.end == START + 8192


# ---- refusals ----------------------------------------------------------------------------------


def test_other_storage_is_refused_naming_both_layers() -> None:
    s1, s2 = storage(START, 8192), storage(START + 1 << 20, 8192)
    with pytest.raises(SharedMRError) as err:
        plan_shared_mr(
            [region("layer.0", START, 64, s1), region("layer.7", s2.start, 64, s2)],
            {"layer.0": START, "layer.7": s2.start},
        )
    assert "'layer.0'" in str(err.value) and "'layer.7'" in str(err.value)
    assert isinstance(err.value, ValueError)


def test_other_device_is_refused_naming_both_layers() -> None:
    s1, s2 = storage(START, 8192), storage(START, 8192, "cuda:1")
    with pytest.raises(SharedMRError, match=r"'x'.*cuda:1.*'y'|'y'.*'x'"):
        plan_shared_mr([region("y", START, 64, s1), region("x", START, 64, s2)], {"x": START, "y": START})


def test_region_in_first_partial_page_is_refused() -> None:
    s = storage(START + 128, 8192)
    with pytest.raises(SharedMRError, match="partial 4096-byte page"):
        plan_shared_mr([region("kda", s.start, 64, s)], {"kda": s.start})


@pytest.mark.parametrize(("ptr", "nbytes"), [(START - 1, 64), (START + 8192 - 63, 64), (START + 10, -1)])
def test_region_outside_storage_or_negative_is_refused(ptr: int, nbytes: int) -> None:
    s = storage(START, 8192)
    with pytest.raises(SharedMRError):
        plan_shared_mr([region("l", ptr, nbytes, s)], {"l": ptr})


def test_layer_without_region_and_empty_input_are_refused() -> None:
    s = storage(START, 8192)
    with pytest.raises(SharedMRError, match="no registration region"):
        plan_shared_mr([region("a", START, 64, s)], {"a": START, "b": START})
    with pytest.raises(SharedMRError, match="no registration regions"):
        plan_shared_mr([], {})


def test_problems_checker_sees_the_original_defects() -> None:
    s = storage(START + 128, 8192)
    regions = [region("a", START + 4096, 64, s)]
    # The 0.32/0.33 builder's choice on this input: storage start aligned down.
    assert registration_problems(START, 8192, {"a": 4096}, regions, {"a": START + 4096})
    assert not registration_problems(START + 4096, 64, {"a": 0}, regions, {"a": START + 4096})


# ---- properties --------------------------------------------------------------------------------


@st.composite
def layouts(draw: st.DrawFn) -> tuple[Storage, list[Region], dict[str, int]]:
    start = START + draw(st.integers(0, 3 * PAGE_SIZE))
    nbytes = draw(st.integers(1, 64 * 1024))
    s = storage(start, nbytes)
    n_layers = draw(st.integers(1, 8))
    regions: list[Region] = []
    ptrs: dict[str, int] = {}
    for i in range(n_layers):
        n_regions = draw(st.integers(1, 3))
        layer_regions = []
        for j in range(n_regions):
            off = draw(st.integers(0, nbytes - 1))
            length = draw(st.integers(0, nbytes - off))
            layer_regions.append(region(f"l{i}", start + off, length, s, j))
        ptrs[f"l{i}"] = layer_regions[0].ptr
        regions += layer_regions
    order = draw(st.permutations(regions))
    return s, list(order), ptrs


@settings(max_examples=400, deadline=None)
@given(layouts())
def test_plan_invariants(layout: tuple[Storage, list[Region], dict[str, int]]) -> None:
    s, regions, ptrs = layout
    lowest = min(r.ptr for r in regions)
    if align_down(lowest) < s.start:
        with pytest.raises(SharedMRError):
            plan_shared_mr(regions, ptrs)
        return
    plan = plan_shared_mr(regions, ptrs)
    assert plan.base % PAGE_SIZE == 0
    assert s.start <= plan.base <= lowest < plan.base + PAGE_SIZE
    assert plan.end == max(r.end for r in regions) <= s.end
    assert plan.storage_offset >= 0
    assert all(plan.base <= r.ptr and r.end <= plan.end for r in regions)
    assert plan.offsets == {layer: ptr - plan.base for layer, ptr in ptrs.items()}
    assert list(plan.offsets) == list(ptrs)
    assert not registration_problems(plan.base, plan.length, plan.offsets, regions, ptrs)


@settings(max_examples=200, deadline=None)
@given(layouts(), st.integers(0, 7), st.sampled_from(["other-storage", "other-device"]))
def test_foreign_region_is_always_refused(
    layout: tuple[Storage, list[Region], dict[str, int]], pick: int, how: str
) -> None:
    s, regions, ptrs = layout
    victim = regions[pick % len(regions)]
    if how == "other-device":
        foreign = storage(s.start, s.nbytes, "cuda:7")
    else:
        foreign = storage(s.start + (1 << 30), s.nbytes)
    moved = region(victim.layer, victim.ptr - s.start + foreign.start, victim.nbytes, foreign, victim.index)
    changed = [moved if r is victim else r for r in regions]
    others = [r for r in changed if r.storage == s]
    assume(others)  # one region alone cannot disagree with anything
    with pytest.raises(SharedMRError) as err:
        plan_shared_mr(changed, ptrs)
    message = str(err.value)
    assert f"{victim.layer!r}" in message
    assert any(f"{r.layer!r}" in message for r in others)  # and a layer it disagrees with
