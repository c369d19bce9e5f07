"""Property: the patched entry points never raise where vLLM's own do not (issue 22, item 3).

Every draw is run twice on identical objects: through vLLM's original and through the fix's
patch, installed directly over it (on 0.32.0 / 0.33.0 too, where the ladder would not apply
it: the wrapper's code is exercised on every release). The inputs are the shapes vLLM's own types
allow: ``new_block_ids_to_zero: list[int] | None``, ``_reqs_need_recv`` entries of (request,
per-group block ids) with empty, missing or extra groups, ids vLLM's allocator hands out,
duplicates, a resolved layout name or None, a missing attention spec, either mode and role.

An exception the original raises may stay (vLLM's behaviour); the patch raising where the
original did not is a bug. Where neither raises, the patch leaves only blocks of the step's own
zeroing list (in order) and the metadata's READs as vLLM built them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_fix_core import PatchSet
from vllm_fix_sync_load_zeroing import FIX
from vllm_fix_sync_load_zeroing import patch as patch_module
from vllm_fix_sync_load_zeroing.probe import (
    PARAMS,
    Case,
    request,
    require_feature,
    scheduler,
    step_output,
    vllm_config,
)

COVERED = ["LBHNC", "LBNHC", "BLHNC", "BLNHC"]  # on every release: drawn twice as often
LAYOUTS = [*COVERED, *COVERED, "LHBNC", "BHLNC", "NHD", None]

block_ids = st.one_of(st.just([]), *[st.lists(st.integers(0, 40), min_size=1, max_size=4)] * 3)
# 1 (attention only), 2 (hybrid) or 3 groups, the attention group first; rarely none at all
groups = st.one_of(st.just([]), *[st.lists(block_ids, min_size=1, max_size=3)] * 4)


mostly = st.sampled_from([True, True, True, False])  # the exclusion's own path is drawn often


@st.composite
def situations(draw: st.DrawFn) -> dict[str, Any]:
    pending = (
        draw(st.lists(groups, max_size=3))
        if draw(st.integers(0, 4)) == 0
        else draw(st.lists(groups, min_size=1, max_size=3))
    )
    # The step zeroes what was just allocated: mostly the pending READs' own blocks, some others.
    allocated = sorted({b for ids in pending for group in ids for b in group})
    block = st.one_of(st.sampled_from(allocated), st.integers(0, 40)) if allocated else st.integers(0, 40)
    return {
        "read": draw(mostly),
        "consumer": draw(mostly),
        "hybrid": draw(mostly),
        "layout": draw(st.sampled_from(LAYOUTS)),
        "pending": pending,
        "zero": None if draw(st.integers(0, 5)) == 0 else draw(st.lists(block, min_size=1, max_size=8)),
        "no_spec": not draw(mostly),
    }


def build(draw: dict[str, Any]) -> tuple[Any, Any]:
    """A scheduler and a step output for `draw` (fresh objects every call)."""
    mc = require_feature()
    case = Case("prop", read=draw["read"], consumer=draw["consumer"], hybrid=draw["hybrid"])
    sched = scheduler(mc, case, draw["layout"])
    if draw["no_spec"]:  # a KV cache config without the attention group the scheduler names
        from vllm.v1.kv_cache_interface import KVCacheConfig

        sched.kv_cache_config = KVCacheConfig(num_blocks=128, kv_cache_tensors=[], kv_cache_groups=[])
        sched.kv_cache_config.kv_cache_layout = draw["layout"]
    for index, ids in enumerate(draw["pending"]):
        rid = f"prop-{index}"
        params = {**PARAMS, "transfer_id": f"tx-{rid}", "remote_block_ids": [list(g) for g in ids]}
        sched._reqs_need_recv[rid] = (request(rid, params), [list(g) for g in ids])
        sched._req_kv_params[rid] = dict(params)
    zero = draw["zero"]
    out = step_output(())
    out.new_block_ids_to_zero = None if zero is None else list(zero)
    return sched, out


def run(draw: dict[str, Any]) -> tuple[BaseException | None, Any, list[str]]:
    sched, out = build(draw)
    try:
        meta = sched.build_connector_meta(out)
    except Exception as exc:
        return exc, None, []
    return None, out.new_block_ids_to_zero, sorted(getattr(meta, "reqs_to_recv", {}) or {})


@contextmanager
def patched(shape: str) -> Iterator[None]:
    patch = PatchSet(FIX.id)
    patch_module.apply(patch, shape)
    try:
        yield
    finally:
        patch.revert()


def is_subsequence(small: list[int], big: list[int]) -> bool:
    items = iter(big)
    return all(any(b == s for b in items) for s in small)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(situations())
def test_patched_build_connector_meta_never_raises_where_vllm_does_not(draw: dict[str, Any]) -> None:
    error, zero, reads = run(draw)
    with patched(patch_module.BUILD_META):
        patched_error, patched_zero, patched_reads = run(draw)
    if error is not None:
        return  # vLLM's own exception may stay
    assert patched_error is None, f"the patch raised {patched_error!r} where vLLM did not"
    assert patched_reads == reads
    if zero is None:
        assert patched_zero is None
    else:
        # Only blocks of the step's own list, in order. (Not necessarily a subsequence of vLLM's
        # result: over 0.32.0's unconditional exclusion the patch keeps zeroing a block under a
        # layout the READ does not fully rewrite, LHBNC there; the ladder never installs it
        # over vLLM's own exclusion, and the probe's guard would see it.)
        assert is_subsequence(list(patched_zero), list(draw["zero"]))


# ---- the #59164 API shape ------------------------------------------------------------------


def _fork_class(module: Any) -> type:
    """get_sync_load_block_ids with the LBNHC-only guard (as in test_sync_load_zeroing_vllm)."""

    class ForkMoRIIOConnector(module.MoRIIOConnector):  # type: ignore[misc, name-defined]
        def get_sync_load_block_ids(self) -> list[int]:
            sched = self.connector_scheduler
            if (
                self.mode != module.MoRIIOMode.READ
                or not self.kv_transfer_config.is_kv_consumer
                or not sched._has_mamba
                or self._vllm_config.cache_config.get_resolved_kv_cache_layout().name != "LBNHC"
            ):
                return []
            return [b for pending in sched._reqs_need_recv.values() for b in pending[1][0]]

    return ForkMoRIIOConnector


def fork_run(module: Any, draw: dict[str, Any]) -> tuple[BaseException | None, Any]:
    from vllm.config import KVTransferConfig

    from vllm_fix_core.guest import build as guest_build

    sched, _ = build(draw)
    connector = module.MoRIIOConnector.__new__(module.MoRIIOConnector)
    connector.mode = sched.mode
    connector.kv_transfer_config = guest_build(
        KVTransferConfig,
        kv_connector="MoRIIOConnector",
        kv_role="kv_consumer" if draw["consumer"] else "kv_producer",
    )
    # vLLM's CacheConfig resolves the name as vLLM does (None: not resolved yet, raises).
    connector._vllm_config = vllm_config(draw["layout"])
    connector.connector_scheduler = sched
    connector.connector_worker = None
    try:
        return None, connector.get_sync_load_block_ids()
    except Exception as exc:
        return exc, None


@pytest.fixture(scope="module")
def fork_module() -> Iterator[Any]:
    module = require_feature()
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(module, "MoRIIOConnector", _fork_class(module))
        yield module


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(situations())
def test_patched_fork_api_never_raises_where_vllm_does_not(fork_module: Any, draw: dict[str, Any]) -> None:
    error, _ = fork_run(fork_module, draw)
    with patched(patch_module.FORK_API):
        patched_error, skipped = fork_run(fork_module, draw)
    if error is not None:
        return
    assert patched_error is None, f"the patch raised {patched_error!r} where vLLM did not"
    pending = {b for ids in draw["pending"] for b in (ids[0] if ids else [])}
    assert set(skipped) <= pending  # never skips a block no READ writes
