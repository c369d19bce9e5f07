"""Property-based: over layouts x attention specs x attention groups x pending READ shapes x roles
x modes, the step zeroes exactly what it must. The oracle is a byte simulation (zero then READ
must leave what the READ alone leaves, for the group owning the block, with every attention
group's layers zeroed), not the rule module.

On 0.31.0 the patched build_connector_meta is checked; on 0.32.0 - 0.34.0 vLLM's own exclusion
is (the regression guard), over the configurations vLLM can reach: a hybrid model only resolves
to the layouts vLLM's resolver accepts, a producer never has READs pending, and only a hybrid
READ that carries every attention group (0.34.0) has two.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from packaging.version import Version

from vllm_fix_sync_load_zeroing import FIX
from vllm_fix_sync_load_zeroing.facts import second_group_spec
from vllm_fix_sync_load_zeroing.oracle import hybrid_layouts, zeroing_is_overwritten
from vllm_fix_sync_load_zeroing.probe import Case, require_feature, scheduler, step_output
from vllm_fix_testing import applied, vllm_version

PATCHED = vllm_version() < Version("0.32.0")
SEVERAL_GROUPS = vllm_version() >= Version("0.34.0")  # the hybrid READ carries every attention group
# The oracle: zeroing a block and then READing it must leave the memory the READ alone leaves,
# simulated on CPU bytes from vLLM's zeroer segments and MoRIIO's worker READ offsets (the
# probe's oracle module, which shares no code with the patch).


@functools.cache
def zero_then_read_equals_read(layout: str, spec: Any, groups: int = 1) -> bool:
    try:
        return zeroing_is_overwritten(layout, spec, *[second_group_spec(spec)] * (groups - 1))
    except Exception:
        return False  # vLLM cannot build it: nothing may be excluded


ALL_LAYOUTS = ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"]


def spec(heads: int, head_size: int, pad: int) -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    base = FullAttentionSpec(block_size=16, num_kv_heads=heads, head_size=head_size, dtype=torch.float16)
    if not pad:
        return base
    return FullAttentionSpec(
        block_size=16,
        num_kv_heads=heads,
        head_size=head_size,
        dtype=torch.float16,
        page_size_padded=base.page_size_bytes + pad,
    )


blocks = st.lists(st.integers(0, 24), max_size=5, unique=True)
entry = st.tuples(
    st.lists(blocks, min_size=2, max_size=2), st.lists(st.integers(90, 99), min_size=1, max_size=1)
)


@st.composite
def situations(draw: st.DrawFn) -> tuple[Case, str, Any, tuple[int, ...]]:
    hybrid = draw(st.booleans())
    read = draw(st.booleans()) if not hybrid else draw(st.booleans()) if PATCHED else True
    consumer = draw(st.booleans())
    if hybrid and not PATCHED:
        layout = draw(st.sampled_from(sorted(hybrid_layouts())))
    else:
        layout = draw(st.sampled_from([*ALL_LAYOUTS, "NHD", "XYZ"]))
    attention_groups = draw(st.sampled_from([1, 2])) if SEVERAL_GROUPS else 1
    drawn = draw(st.lists(entry, max_size=4)) if consumer else []
    groups = tuple(
        (*(tuple(a) for a in attention[:attention_groups]), *((tuple(m),) if hybrid else ()))
        for attention, m in drawn
    )
    zero = tuple(draw(st.lists(st.one_of(st.integers(0, 30), st.integers(90, 99)), max_size=12)))
    kv_spec = spec(
        draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([8, 16])), draw(st.sampled_from([0, 64]))
    )
    case = Case(
        "prop", read=read, consumer=consumer, hybrid=hybrid, pending=groups, attention_groups=attention_groups
    )
    return case, layout, kv_spec, zero


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(situations())
def test_step_zeroes_exactly_what_the_bytes_require(
    situation: tuple[Case, str, Any, tuple[int, ...]],
) -> None:
    case, layout, kv_spec, zero = situation
    # The READ writes the aligned destinations of every attention group (the metadata's first).
    destinations = {b for groups in case.pending for group in groups[: case.attention_groups] for b in group}
    may_exclude = (
        case.read
        and case.consumer
        and case.hybrid
        and zero_then_read_equals_read(layout, kv_spec, case.attention_groups)
    )
    expected = [b for b in zero if not (may_exclude and b in destinations)]

    sched = scheduler(require_feature(), case, layout, kv_spec)
    out = step_output(zero)
    with applied(FIX) if PATCHED else contextlib.nullcontext():
        sched.build_connector_meta(out)
    assert list(out.new_block_ids_to_zero or []) == expected
