"""On the installed vLLM (0.32.0 and 0.33.0): negative controls, the fix, properties, lifecycle.

The probe's inputs are attention layers (every release with a shared MR); the KDA inputs
(vLLM 0.31.0+) and the property layouts come from vllm_fix_testing.kv_storage.

The KV storage is host memory placed at chosen addresses; the builder under test is vLLM's
real MoRIIOConnectorWorker._build_shared_kv_mr, unpatched and patched.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector as mc

from vllm_fix_core import Answer, PatchSet, UnknownShape, ast_fingerprint, runtime
from vllm_fix_core.ladder import evaluate
from vllm_fix_core.patching import original_of
from vllm_fix_core.settings import Settings
from vllm_fix_mr_extent import FIX, patch, probe
from vllm_fix_mr_extent.rule import PAGE_SIZE, SharedMRError, align_down, registration_problems
from vllm_fix_testing import applied, assert_hostile_wrapper_fails, vllm_version
from vllm_fix_testing import kv_storage as kv
from vllm_fix_testing.stress import scaled

WORKER = mc.MoRIIOConnectorWorker
ORIGINAL = original_of(WORKER, "_build_shared_kv_mr")
KNOWN = "9d889e36e282c898"


def kda_tail_unaligned() -> probe.Scenario:
    """Storage at 128 mod 4096, one KDA layer ending at the storage end."""
    storage = kv.backing(128, 8192)
    caches = {"kda": kv.kda_cache(storage, 8192 - 2 * kv.KDA_PAGE)}
    return probe.Scenario("kda-tail-unaligned", "", storage, caches, {"kda": kv.kda_spec()})


def kda_unpadded_tail() -> probe.Scenario:
    """Aligned storage of 8256 bytes, the last KDA layer ending at its end."""
    storage = kv.backing(0, 8256)
    caches = {"kda0": kv.kda_cache(storage, 0), "kda1": kv.kda_cache(storage, 8256 - 2 * kv.KDA_PAGE)}
    return probe.Scenario("kda-unpadded-tail", "", storage, caches, {n: kv.kda_spec() for n in caches})


FAILING = (*probe.FAILING, kda_tail_unaligned, kda_unpadded_tail)

# Unpatched outcome per failing input, the same in both releases.
TOO_SMALL = r"ValueError: shared KV backing too small for page-aligned MR: "
UNPATCHED = {
    "kda-tail-unaligned": TOO_SMALL + "need 12288, have 8192",
    "kda-unpadded-tail": TOO_SMALL + "need 12288, have 8256",
    "page-boundary-unaligned": r"RuntimeError: .*invalid storage offset -128",
    "unpadded-tail": TOO_SMALL + "need 20480, have 16448",
    "split-kv-later-region": r"layer 'attn' region 1 .* is not inside the registration",
}


@pytest.fixture(autouse=True)
def unpatched_at_start() -> None:
    """Every test starts from vLLM's own body, even if a plugin load installed the fix earlier."""
    runtime.revert(FIX)
    assert WORKER.__dict__["_build_shared_kv_mr"] is ORIGINAL


@pytest.fixture
def fixed() -> Iterator[None]:
    with applied(FIX):
        yield


def build(scenario: probe.Scenario) -> tuple[torch.Tensor, dict[str, int]]:
    result: tuple[torch.Tensor, dict[str, int]] = scenario.worker()._build_shared_kv_mr(scenario.kv_caches)
    return result


def test_releases_under_test() -> None:
    assert str(vllm_version()) in {"0.32.0", "0.33.0", "0.34.0"}


# ---- negative controls and the fix on the §2.3 inputs ------------------------------------------


@pytest.mark.parametrize("make", FAILING, ids=[f.__name__ for f in FAILING])
def test_failing_input_unpatched(make: Any) -> None:
    scenario = make()
    found = probe.problems(scenario)
    assert found, f"{scenario.name}: unpatched vLLM {vllm_version()} registered it correctly"
    assert re.search(UNPATCHED[scenario.name], found[0]), found


def test_later_region_outside_unpatched_registration() -> None:
    scenario = probe.split_kv_later_region()
    reg, _ = build(scenario)
    v_plane = scenario.kv_caches["attn"][1]
    lo, hi = v_plane.data_ptr(), v_plane.data_ptr() + v_plane.numel() * v_plane.element_size()
    assert not (reg.data_ptr() <= lo and hi <= reg.data_ptr() + reg.numel())
    assert reg.data_ptr() + reg.numel() == hi - 4096  # the MR ends 4 KiB before the V plane ends


@pytest.mark.parametrize("make", FAILING, ids=[f.__name__ for f in FAILING])
def test_failing_input_patched(make: Any, fixed: None) -> None:
    scenario = make()
    assert probe.problems(scenario) == []
    reg, offsets = build(scenario)
    storage = scenario.storage.untyped_storage()
    lowest = min(r.ptr for r in patch.collect_regions(scenario.kv_caches, scenario.layer_to_spec))
    assert reg.data_ptr() == align_down(lowest) >= storage.data_ptr()
    assert reg.data_ptr() + reg.numel() <= storage.data_ptr() + storage.nbytes()
    assert reg.untyped_storage().data_ptr() == storage.data_ptr()  # zero-copy view of the backing
    assert offsets == {n: c.data_ptr() - reg.data_ptr() for n, c in scenario.kv_caches.items()}


def test_spec_table_results(fixed: None) -> None:
    tail = kda_tail_unaligned()
    reg, offsets = build(tail)
    ptr = tail.kv_caches["kda"].data_ptr()
    end = tail.storage.untyped_storage().data_ptr() + 8192
    assert (reg.data_ptr(), reg.data_ptr() + reg.numel(), offsets["kda"]) == (
        align_down(ptr),
        end,
        ptr - align_down(ptr),
    )
    boundary = probe.page_boundary_unaligned()
    reg, offsets = build(boundary)
    assert reg.data_ptr() == boundary.kv_caches["attn"].data_ptr() and offsets == {"attn": 0}
    unpadded = kda_unpadded_tail()
    reg, _ = build(unpadded)
    assert reg.numel() == 8256
    reg, _ = build(probe.unpadded_tail())
    assert reg.numel() == 2 * probe.LAYER_BYTES + 64


@pytest.mark.parametrize("patched", [False, True], ids=["unpatched", "patched"])
def test_aligned_control_both_ways(patched: bool) -> None:
    scenario = probe.aligned_control()
    if patched:
        with applied(FIX):
            reg, offsets = build(scenario)
            found = probe.problems(scenario)
    else:
        reg, offsets = build(scenario)
        found = probe.problems(scenario)
    assert found == []
    start = scenario.storage.data_ptr()
    # Both ways: the whole backing (the second layer ends exactly at the padded storage end).
    length = 2 * probe.LAYER_BYTES
    assert (reg.data_ptr(), reg.numel(), reg.dtype, reg.is_contiguous()) == (start, length, torch.uint8, True)
    assert offsets == {"attn0": 0, "attn1": probe.LAYER_BYTES}


def test_kda_control_exact_extent(fixed: None) -> None:
    """Aligned KDA layers: patched, the MR ends exactly at kda1's SSM region end."""
    storage = kv.backing(0, 8192)
    caches = {"kda0": kv.kda_cache(storage, 0), "kda1": kv.kda_cache(storage, PAGE_SIZE)}
    scenario = probe.Scenario("kda-control", "", storage, caches, {n: kv.kda_spec() for n in caches})
    reg, offsets = build(scenario)
    assert (reg.data_ptr(), reg.numel()) == (storage.data_ptr(), 4096 + 16 + 2 * kv.KDA_PAGE)
    assert offsets == {"kda0": 0, "kda1": PAGE_SIZE}


def test_probe_verdict_per_release() -> None:
    before = FIX.run_probe()
    assert before.affected, before.summary()  # both releases carry the bug
    assert set(before.names(True)) == {
        "unaligned-storage-base",
        "unpadded-storage-extent",
        "later-region-extent",
    }
    assert not before.broken_guards
    with applied(FIX) as decision:
        assert decision.after is not None and not decision.after.affected
        assert not FIX.run_probe().affected


# ---- refusals ----------------------------------------------------------------------------------


def two_storages() -> probe.Scenario:
    first, second = kv.backing(0, 8192), kv.backing(0, 8192)
    caches = {
        "model.layers.0.attn": kv.kda_cache(first, 0),
        "model.layers.9.attn": kv.kda_cache(second, 0),
    }
    specs = {n: kv.kda_spec() for n in caches}
    return probe.Scenario("two-storages", "", first, caches, specs, (second,))


def test_other_storage_not_refused_unpatched() -> None:
    scenario = two_storages()
    try:
        build(scenario)
    except Exception as exc:
        names = [n for n in scenario.kv_caches if n in str(exc)]
        assert len(names) < 2, "unpatched vLLM already names both layers"
    # else: it built a registration from a foreign storage without a word: the bug


def test_other_storage_never_gets_an_offset_outside_the_region() -> None:
    """Layers on two allocations: the rule cannot plan one region. vLLM's own body registers
    the first layer's storage and hands the second layer an offset outside it (a transfer
    outside the registered memory, silently); the fix never hands that on: start-up stops with
    a ValueError naming the layer outside and both storages."""
    scenario = two_storages()
    try:
        reg, offsets = build(scenario)
    except Exception:
        reg = None
    if reg is not None:  # vLLM's registration: the second layer's offset is outside it
        start, end = reg.data_ptr(), reg.data_ptr() + reg.numel()
        second = scenario.kv_caches["model.layers.9.attn"].data_ptr()
        assert not start <= second < end, "vLLM's registration already covers the second layer"
        assert offsets["model.layers.9.attn"] == second - start  # an offset outside the region
    with applied(FIX), pytest.raises(SharedMRError) as err:
        build(scenario)
    text = str(err.value)
    assert "'model.layers.9.attn'" in text
    assert text.count("storage [") >= 2  # the layer's own storage and the other one
    if reg is not None:  # where vLLM's body hands on the wrong offset, the fix stops start-up
        assert "start-up stops here" in text


def test_a_registration_of_vllm_that_covers_every_layer_is_used_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Where the rule cannot plan but vLLM's registration covers every layer region, it is used
    unchanged (the fix never raises where vLLM's registration is right): one WARNING."""
    storage = kv.backing(0, 16384)
    caches = {"model.layers.0.attn": kv.kda_cache(storage, 0)}
    scenario = probe.Scenario("aligned", "", storage, caches, {n: kv.kda_spec() for n in caches})
    want = build(scenario)
    with applied(FIX), pytest.MonkeyPatch.context() as mp:
        mp.setattr(patch, "plan_shared_mr", _refuse)
        with caplog.at_level(logging.WARNING, logger="vllm.fixes.mr-extent"):
            reg, offsets = build(scenario)
    assert (reg.data_ptr(), reg.numel(), offsets) == (want[0].data_ptr(), want[0].numel(), want[1])
    assert "vLLM's own registration is used unchanged" in caplog.text


def _refuse(*args: Any, **kwargs: Any) -> Any:
    raise SharedMRError("the rule refuses (test)")


def test_region_in_first_partial_page_refused_clearly(fixed: None) -> None:
    storage = kv.backing(128, 8192)
    caches = {"kda": kv.kda_cache(storage, 0)}
    scenario = probe.Scenario("head", "", storage, caches, {"kda": kv.kda_spec()})
    with pytest.raises(SharedMRError, match=r"'kda'.*partial 4096-byte page"):
        build(scenario)


# ---- properties on real vLLM layers ------------------------------------------------------------

ATTN_PLANE = kv.ATTN_PLANE


@st.composite
def vllm_layouts(draw: st.DrawFn) -> probe.Scenario:
    start_mod = draw(
        st.sampled_from([0, 16, 64, 128, 512, 2048, 4032]) | st.integers(0, 255).map(lambda x: x * 16)
    )
    kinds = draw(st.lists(st.sampled_from(["kda", "attn"]), min_size=1, max_size=6))
    sizes = []
    for kind in kinds:
        if kind == "kda":
            sizes.append(("kda", draw(st.integers(1, 8))))
        else:
            sizes.append(("attn", draw(st.integers(1, 2))))
    nbytes_of = {"kda": kv.KDA_PAGE, "attn": 2 * ATTN_PLANE}
    layers = []
    cursor = draw(st.integers(0, 64).map(lambda x: x * 64))
    for kind, count in sizes:
        layers.append((kind, count, cursor))
        cursor += nbytes_of[kind] * count + draw(st.integers(0, 8).map(lambda x: x * 64))
    tail = draw(st.integers(0, 4096).map(lambda x: x // 16 * 16))
    storage = kv.backing(start_mod, cursor + tail)
    caches: dict[str, Any] = {}
    specs: dict[str, Any] = {}
    for i, (kind, count, off) in enumerate(layers):
        name = f"layers.{i}.{kind}"
        if kind == "kda":
            caches[name], specs[name] = kv.kda_cache(storage, off, count), kv.kda_spec()
        else:
            caches[name], specs[name] = kv.split_kv_cache(storage, off, count), kv.attention_spec()
    order = draw(st.permutations(list(caches)))
    return probe.Scenario("random", "", storage, {n: caches[n] for n in order}, specs)


@settings(max_examples=60, deadline=None)
@given(vllm_layouts())
def test_patched_builder_properties(scenario: probe.Scenario) -> None:
    with applied(FIX):
        regions = patch.collect_regions(scenario.kv_caches, scenario.layer_to_spec)
        layer_ptrs = {n: c.data_ptr() for n, c in scenario.kv_caches.items()}
        s = scenario.storage.untyped_storage()
        lowest = min(r.ptr for r in regions)
        if align_down(lowest) < s.data_ptr():
            with pytest.raises(SharedMRError, match="partial 4096-byte page"):
                build(scenario)
            return
        reg, offsets = build(scenario)
    assert reg.data_ptr() % PAGE_SIZE == 0 and reg.data_ptr() >= s.data_ptr()
    assert reg.data_ptr() + reg.numel() == max(r.end for r in regions) <= s.data_ptr() + s.nbytes()
    assert reg.dtype == torch.uint8 and reg.is_contiguous()
    assert list(offsets) == list(scenario.kv_caches)
    assert registration_problems(reg.data_ptr(), reg.numel(), offsets, regions, layer_ptrs) == []


# ---- lifecycle: idempotence, revert, shape drift -----------------------------------------------


def test_known_shape_on_this_release() -> None:
    assert ast_fingerprint(ORIGINAL) == KNOWN
    assert patch.recognize() == "vllm-0.29.0..0.33.0"


def test_hostile_wrapper_over_the_builder_fails_to_fix() -> None:
    """A layer that calls vLLM's own body over the fix: the probe must see the bug again."""
    decision = assert_hostile_wrapper_fails(FIX)
    assert "unaligned-storage-base" in decision.reason
    assert WORKER.__dict__["_build_shared_kv_mr"] is ORIGINAL


def test_no_shared_mr_is_not_applicable(monkeypatch: pytest.MonkeyPatch) -> None:
    """A vLLM without _build_shared_kv_mr (before 0.29.0) has no shared MR: not applicable."""
    from vllm_fix_core import NotApplicable

    monkeypatch.delattr(WORKER, "_build_shared_kv_mr")
    with pytest.raises(NotApplicable, match="no shared KV memory region"):
        probe.probe()
    with pytest.raises(NotApplicable):
        patch.recognize()
    decision = evaluate(FIX, Settings(disabled=frozenset(), strict=True), apply=True)
    assert decision.answer is Answer.NOT_APPLICABLE, decision.message


def test_idempotent_and_exact_revert() -> None:
    with applied(FIX):
        installed = WORKER.__dict__["_build_shared_kv_mr"]
        assert installed is not ORIGINAL
        assert runtime.apply(FIX).answer is Answer.AFFECTED_FIXED
        extra = PatchSet(FIX.id)
        patch.apply(extra, patch.recognize())  # same fix, same target: a no-op
        assert WORKER.__dict__["_build_shared_kv_mr"] is installed
    assert WORKER.__dict__["_build_shared_kv_mr"] is ORIGINAL
    assert FIX.run_probe().affected


def test_drifted_shape_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    def _build_shared_kv_mr(self: Any, kv_caches: dict[str, Any]) -> Any:
        raise ValueError("a future body this fix has never read")

    monkeypatch.setattr(WORKER, "_build_shared_kv_mr", _build_shared_kv_mr)
    with pytest.raises(UnknownShape, match="not a known shape"):
        patch.recognize()
    decision = evaluate(FIX, Settings(disabled=frozenset(), strict=False), apply=True)
    assert decision.answer is Answer.REFUSED, decision.message
    assert WORKER.__dict__["_build_shared_kv_mr"] is _build_shared_kv_mr  # nothing patched


@pytest.mark.stress
@settings(max_examples=scaled(1000, 300), deadline=None)
@given(vllm_layouts())
def test_patched_builder_properties_stress(scenario: probe.Scenario) -> None:
    test_patched_builder_properties.hypothesis.inner_test(scenario)  # type: ignore[attr-defined]


def test_entry_points_point_at_this_fix() -> None:
    from importlib.metadata import entry_points

    plugins = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert plugins.get("vllm_fix_mr_extent") == "vllm_fix_mr_extent.plugin:register"
    fixes = {ep.name: ep for ep in entry_points(group="vllm_fixes")}
    assert fixes["mr-extent"].load() is FIX
    assert FIX.entry_point == "vllm_fix_mr_extent"
