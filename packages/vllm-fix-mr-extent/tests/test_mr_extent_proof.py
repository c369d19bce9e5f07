"""Issue 22 for mr-extent, on real vLLM: every patched target observed, an oracle that is not
the fix's own rule, and the patched builder never raising where vLLM's did not."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector as mc

from vllm_fix_core import runtime
from vllm_fix_core.patching import original_of
from vllm_fix_mr_extent import FIX, patch, probe
from vllm_fix_mr_extent.rule import PAGE_SIZE, Region, SharedMRError, SharedMRPlan
from vllm_fix_testing import applied, assert_every_target_observed, assert_verification_fails
from vllm_fix_testing import kv_storage as kv
from vllm_fix_testing.hostile import patched_targets

WORKER = mc.MoRIIOConnectorWorker
ORIGINAL = original_of(WORKER, "_build_shared_kv_mr")


@pytest.fixture(autouse=True)
def unpatched_at_start() -> None:
    runtime.revert(FIX)
    assert WORKER.__dict__["_build_shared_kv_mr"] is ORIGINAL


def test_every_patched_target_is_observed() -> None:
    """vLLM's own builder layered over the fix's one target: "failed to fix", exact revert."""
    assert patched_targets(FIX) == ["MoRIIOConnectorWorker._build_shared_kv_mr"]
    decisions = assert_every_target_observed(FIX)
    assert "unaligned-storage-base=affected" in decisions["MoRIIOConnectorWorker._build_shared_kv_mr"].reason


# -- the oracle is vLLM's enumeration and the tensors themselves, not the rule --------------------
#
# probe.problems checks the installed builder against every region vLLM's own
# iter_layer_registration_regions names and every layer tensor's bytes, on the scenario's own
# storage; it calls nothing in patch.py or rule.py. Break the rule the patch uses, at the
# reference patch.py holds, and the ladder must answer "failed to fix".


def _first_region_only(real: Callable[..., list[Region]]) -> Callable[..., list[Region]]:
    def broken(*args: Any, **kwargs: Any) -> list[Region]:
        return [r for r in real(*args, **kwargs) if r.index == 0]  # vLLM's own bug, in the rule

    return broken


def _end_rounded_up(real: Callable[..., SharedMRPlan]) -> Callable[..., SharedMRPlan]:
    def broken(*args: Any, **kwargs: Any) -> SharedMRPlan:
        plan = real(*args, **kwargs)
        end = -(-plan.end // PAGE_SIZE) * PAGE_SIZE  # padded past the storage end
        return dataclasses.replace(plan, end=min(end, plan.storage.end + PAGE_SIZE))

    return broken


def _base_one_page_lower(real: Callable[..., SharedMRPlan]) -> Callable[..., SharedMRPlan]:
    def broken(*args: Any, **kwargs: Any) -> SharedMRPlan:
        plan = real(*args, **kwargs)
        base = max(plan.base - PAGE_SIZE, plan.storage.start)
        return dataclasses.replace(plan, base=base)  # offsets no longer data_ptr - base

    return broken


BREAKS = {
    "collect_regions-first-only": ("collect_regions", _first_region_only, {"later-region-extent"}),
    "plan-end-rounded-up": ("plan_shared_mr", _end_rounded_up, {"unpadded-storage-extent"}),
    "plan-base-lowered": ("plan_shared_mr", _base_one_page_lower, {"unaligned-storage-base"}),
}


@pytest.mark.parametrize("name", list(BREAKS))
def test_broken_rule_fails_verification(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    attr, breaker, expected = BREAKS[name]
    monkeypatch.setattr(patch, attr, breaker(getattr(patch, attr)))
    assert_verification_fails(FIX, expected)
    assert WORKER.__dict__["_build_shared_kv_mr"] is ORIGINAL  # the ladder reverted exactly


# -- patched never raises where vLLM did not ------------------------------------------------------
#
# The shapes vLLM's types allow for _build_shared_kv_mr(kv_caches: dict[str, Tensor]) with
# layer_to_spec: dict[str, KVCacheSpec]: any number of layers (none included), attention layers
# block-first or split K/V and KDA (Mamba-spec) layers, on one or two allocations, the allocation
# at any 16-byte alignment and padded or not, the layers in any order.


@st.composite
def layouts(draw: st.DrawFn) -> probe.Scenario:
    start_mod = draw(st.sampled_from([0, 16, 128, 2048, 4032]) | st.integers(0, 255).map(lambda x: x * 16))
    kinds = draw(st.lists(st.sampled_from(["block-first", "split-kv", "kda"]), min_size=0, max_size=4))
    per_layer = {"block-first": 2 * kv.ATTN_PLANE, "split-kv": 2 * kv.ATTN_PLANE, "kda": kv.KDA_PAGE}
    placed: list[tuple[str, int, int]] = []
    cursor = draw(st.integers(0, 8).map(lambda x: x * 64))
    for kind in kinds:
        count = draw(st.integers(1, 2))
        placed.append((kind, count, cursor))
        cursor += per_layer[kind] * count + draw(st.integers(0, 4).map(lambda x: x * 64))
    storage = kv.backing(start_mod, max(cursor + draw(st.integers(0, 256).map(lambda x: x * 16)), 16))
    other = kv.backing(draw(st.sampled_from([0, 128])), max(cursor, 16) + 2 * PAGE_SIZE)
    foreign = draw(st.sets(st.integers(0, 3), max_size=1)) if len(placed) > 1 else set()
    caches: dict[str, Any] = {}
    specs: dict[str, Any] = {}
    for i, (kind, count, offset) in enumerate(placed):
        name = f"model.layers.{i}.{kind}"
        on = other if i in foreign else storage
        if kind == "kda":
            caches[name], specs[name] = kv.kda_cache(on, offset, count), kv.kda_spec()
        elif kind == "split-kv":
            caches[name], specs[name] = kv.split_kv_cache(on, offset, count), kv.attention_spec()
        else:
            caches[name], specs[name] = kv.block_first_cache(on, offset, count), kv.attention_spec()
    order = draw(st.permutations(list(caches)))
    return probe.Scenario("drawn", "", storage, {n: caches[n] for n in order}, specs, (other,))


def _outcome(scenario: probe.Scenario) -> tuple[BaseException | None, list[str]]:
    try:
        scenario.worker()._build_shared_kv_mr(scenario.kv_caches)
    except Exception as exc:
        return exc, []
    return None, probe.problems(scenario)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts())
def test_patched_never_raises_where_vllm_does_not(scenario: probe.Scenario) -> None:
    unpatched, unpatched_problems = _outcome(scenario)
    with applied(FIX):
        patched, patched_problems = _outcome(scenario)
    outside = [p for p in unpatched_problems if "is not inside the registration" in p]
    if unpatched is None and outside:
        # vLLM's registration leaves a layer outside (offsets outside registered memory): the
        # fix never hands that on: it registers a region covering every layer, or stops with a
        # ValueError naming the layers.
        assert isinstance(patched, SharedMRError) or (patched is None and not patched_problems), (
            patched,
            outside,
        )
    elif unpatched is None:
        assert patched is None, f"patched raised {patched!r} where vLLM returned a registration"
        if not unpatched_problems:
            assert not patched_problems, "vLLM's registration was right, the patched one is not"
    elif patched is not None:
        # Both refuse: the patched refusal is a ValueError (vLLM's own kind of refusal here) or
        # exactly vLLM's exception.
        assert isinstance(patched, ValueError) or type(patched) is type(unpatched), repr(patched)
