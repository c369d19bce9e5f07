"""Hybrid READ (vLLM 0.34.0's rules): the fix never refuses a READ vLLM loads correctly, and
never claims a token no READ loads.

vLLM 0.34.0's MoRIIO hybrid READ reads several attention groups, trims each sliding-window
group to its window, and reads the state groups (a circular-buffer attention group, every
Mamba group's running-state slot) even when the attention prefix is a full local hit
(``split_block_groups``; the wire payload holds every attention group, then every Mamba
group). The tests build real ``MoRIIOConnectorScheduler`` pairs with the installed
``__init__`` (a prefill producer and a decode READ consumer, on vLLM's own ``KVCacheConfig``
and a ``VllmConfig`` built with ``vllm_fix_core.guest.build``):

* the prefill's own ``request_finished`` (``request_finished_all_groups`` for a hybrid
  model) hands out the params a router forwards; the decode's patched
  ``get_num_new_matched_tokens`` must give vLLM's own claim for them, for any prompt and any
  block-aligned local hit, leave ``do_remote_prefill`` set, and the READ vLLM's
  ``update_state_after_alloc`` then queues must write every decode block a claimed token
  (or a state group) lives in;
* for those params mutated (a group dropped, added, emptied or cut short), whatever the
  patched method claims is written by the READ vLLM queues, and the scheduler hook never
  raises for params the fix accepts.

Which blocks a claim needs is computed here from the engine's groups alone, never from the
fix's or vLLM's code: a full-attention group every block holding a token of ``[c, N-1)``; a
sliding-window group of window W the blocks holding ``[max(c, N-W), N-1)``, the tokens the
next position attends to; a circular-buffer group its one block and a Mamba group its
state slot, always. A layout the installed connector does not support (one attention group
before 0.34.0; no circular buffers) is skipped there, never on 0.34.0.

The rule alone (``rule.blocks_reason``) is held to the same two properties over any per-group
block counts at the end.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from packaging.version import Version

from vllm_fix_core import original_of
from vllm_fix_read_eligibility import FIX, patch
from vllm_fix_read_eligibility.probe import request
from vllm_fix_read_eligibility.rule import BlockLayout, blocks_reason
from vllm_fix_testing import MORIIO_EXTRA_CONFIG, applied, vllm_version

B = 16  # attention block size
RING = 8  # a circular buffer's capacity (one block per request)
NEWEST = Version("0.34.0")
FAST = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))


@dataclasses.dataclass(frozen=True)
class Group:
    kind: str  # "full", "swa", "ring", "mamba"
    window: int = 0


LAYOUTS: dict[str, tuple[Group, ...]] = {
    "full": (Group("full"),),
    "full+swa": (Group("full"), Group("swa", 32)),
    "full+mamba": (Group("full"), Group("mamba")),
    "full+swa+2mamba": (Group("full"), Group("swa", 40), Group("mamba"), Group("mamba")),
    "2full+swa+mamba": (Group("full"), Group("full"), Group("swa", 32), Group("mamba")),
    "full+ring+mamba": (Group("full"), Group("ring"), Group("mamba")),
    "swa+full+ring+2mamba": (Group("swa", 64), Group("full"), Group("ring"), Group("mamba"), Group("mamba")),
}


def _spec(group: Group) -> Any:
    import torch
    from vllm.v1 import kv_cache_interface as kci

    common = {"num_kv_heads": 1, "head_size": 1, "dtype": torch.float32}
    if group.kind == "full":
        return kci.FullAttentionSpec(block_size=B, **common)
    if group.kind == "swa":
        return kci.SlidingWindowSpec(block_size=B, sliding_window=group.window, **common)
    if group.kind == "ring":
        ring = getattr(kci, "CircularBufferSpec", None)
        if ring is None:
            pytest.skip("this vLLM has no circular-buffer KV cache groups")
        return ring(block_size=RING, **common)
    return kci.MambaSpec(block_size=2048, shapes=((2, 3), (4, 5)), dtypes=(torch.float32, torch.float32))


def _kv_cache_config(layout: tuple[Group, ...]) -> Any:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [KVCacheGroupSpec([f"layer{i}"], _spec(g)) for i, g in enumerate(layout)]
    return KVCacheConfig(num_blocks=4096, kv_cache_tensors=[], kv_cache_groups=groups)


def _vllm_config(role: str) -> Any:
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    from vllm_fix_core.guest import build

    extra = {**MORIIO_EXTRA_CONFIG, "read_mode": True, "host_ip": "127.0.0.1"}
    return build(
        VllmConfig,
        kv_transfer_config=KVTransferConfig(
            kv_connector="MoRIIOConnector", kv_role=role, kv_connector_extra_config=extra
        ),
        cache_config=build(CacheConfig, block_size=B),
        parallel_config=build(ParallelConfig),
        scheduler_config=build(SchedulerConfig),
        device_config=build(DeviceConfig, device="cpu"),
    )


@contextlib.contextmanager
def _role_kept() -> Iterator[None]:
    """The schedulers' __init__ sets MoRIIO's process-wide role; put it back."""
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_common

    role = moriio_common.get_role()
    try:
        yield
    finally:
        moriio_common.set_role(role)


@dataclasses.dataclass
class Pair:
    layout: tuple[Group, ...]
    producer: Any
    consumer: Any

    @property
    def payload_order(self) -> list[int]:
        """The wire payload's group order: attention groups, then Mamba groups (hybrid); the
        groups in order otherwise."""
        if not any(g.kind == "mamba" for g in self.layout):
            return list(range(len(self.layout)))
        attn = [i for i, g in enumerate(self.layout) if g.kind != "mamba"]
        return attn + [i for i, g in enumerate(self.layout) if g.kind == "mamba"]


def _pair(layout: tuple[Group, ...]) -> Pair:
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector as mc

    config = _kv_cache_config(layout)
    with _role_kept():
        try:
            producer = mc.MoRIIOConnectorScheduler(_vllm_config("kv_producer"), "p0", config)
            consumer = mc.MoRIIOConnectorScheduler(_vllm_config("kv_consumer"), "d0", config)
        except Exception as exc:
            if vllm_version() >= NEWEST:
                raise
            pytest.skip(f"this vLLM's MoRIIO does not run this layout: {type(exc).__name__}: {exc}")
    return Pair(layout, producer, consumer)


@pytest.fixture(params=sorted(LAYOUTS))
def pair(request: pytest.FixtureRequest) -> Pair:
    return _pair(LAYOUTS[request.param])


def _allocation(layout: tuple[Group, ...], num_tokens: int, first_id: int) -> list[list[int]]:
    """A request's block ids for tokens [0, num_tokens) in each group, as vLLM's KV cache
    manager holds them: one per block of tokens (0, the null block, for the sliding-window
    blocks wholly below the window), one for a circular buffer or a Mamba state."""
    next_id = first_id
    groups: list[list[int]] = []
    for group in layout:
        count = 1 if group.kind in ("ring", "mamba") else -(-num_tokens // B)
        ids = list(range(next_id, next_id + count))
        next_id += count
        if group.kind == "swa":
            ids = [0 if (i + 1) * B <= num_tokens - group.window else b for i, b in enumerate(ids)]
        groups.append(ids)
    return groups


def _blocks(ids: list[list[int]]) -> Any:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    return KVCacheBlocks(tuple(tuple(KVCacheBlock(b) for b in group) for group in ids))


def prefill_params(pair: Pair, num_tokens: int, rid: str) -> dict[str, Any]:
    """What the prefill's own request_finished hands out for a prompt of num_tokens tokens."""
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector as mc
    from vllm.v1.request import RequestStatus

    req = request({"do_remote_decode": True, "transfer_id": f"tx-{rid}"}, rid, num_tokens)
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    held = tuple(_allocation(pair.layout, num_tokens, 5000))
    connector = mc.MoRIIOConnector.__new__(mc.MoRIIOConnector)
    connector.connector_scheduler = pair.producer
    finished = getattr(mc.MoRIIOConnector, "request_finished_all_groups", None)
    if finished is None:
        pytest.skip("this vLLM's MoRIIO hands out no per-group block lists")
    delay, params = finished(connector, req, held)
    assert delay and params is not None and params["do_remote_prefill"] is True
    return dict(params)


def required(pair: Pair, local: list[list[int]], num_tokens: int, computed: int) -> list[set[int]]:
    """Per payload group, the decode blocks the READ must write for a claim of tokens
    [computed, N-1): from the engine's groups alone."""
    claimed_end = num_tokens - 1
    needs: list[set[int]] = []
    for index in pair.payload_order:
        group, ids = pair.layout[index], local[index]
        if group.kind in ("ring", "mamba"):
            needs.append({ids[-1]})
            continue
        start = computed if group.kind == "full" else max(computed, num_tokens - group.window)
        if start >= claimed_end:
            needs.append(set())
            continue
        needs.append({ids[i] for i in range(start // B, -(-claimed_end // B))} - {0})
    return needs


def loaded(pair: Pair, rid: str) -> list[set[int]] | None:
    """Per payload group, the decode blocks the READ vLLM queued writes (the worker pairs
    each group's decode blocks with the prefill's blocks in order and fails a group with
    more decode than prefill blocks); None where no READ was queued."""
    queued = pair.consumer._reqs_need_recv.get(rid)
    if queued is None:
        return None
    local = queued[1]
    remote = pair.consumer._req_kv_params[rid]["remote_block_ids"]
    assert len(local) == len(remote), (
        f"READ pairs {len(local)} decode groups with {len(remote)} prefill groups"
    )
    for mine, theirs in zip(local, remote, strict=True):
        assert len(mine) <= len(theirs), (
            f"the worker fails this READ: {len(mine)} decode > {len(theirs)} prefill"
        )
    return [set(group) for group in local]


def claim_and_load(
    pair: Pair, params: dict[str, Any], rid: str, num_tokens: int, computed: int, method: Callable[..., Any]
) -> tuple[tuple[int, bool], bool, list[set[int]] | None, list[list[int]]]:
    """Ask `method` (the installed or vLLM's original get_num_new_matched_tokens), then run
    vLLM's update_state_after_alloc as the scheduler does for what was claimed: the claim,
    whether the request still asks for its READ after the claim, what the READ loads, and
    the decode blocks."""
    req = request(params, rid, num_tokens)
    answer = method(pair.consumer, req, computed)
    asks = req.kv_transfer_params.get("do_remote_prefill") is True
    local = _allocation(pair.layout, num_tokens, 100)
    pair.consumer.update_state_after_alloc(req, _blocks(local), int(answer[0]))
    result = loaded(pair, rid)
    pair.consumer._reqs_need_recv.pop(rid, None)
    pair.consumer._req_kv_params.pop(rid, None)
    return (int(answer[0]), bool(answer[1])), asks, result, local


def _vllm_original() -> Callable[..., Any]:
    cls = patch._mc().MoRIIOConnectorScheduler
    return original_of(cls, patch.TARGET)  # type: ignore[no-any-return]


@st.composite
def prompts(draw: st.DrawFn) -> tuple[int, int]:
    """A prompt length and a block-aligned local hit the scheduler can pass (up to N-1)."""
    num_tokens = draw(st.integers(2, 150))
    computed = draw(st.integers(0, (num_tokens - 1) // B)) * B
    return num_tokens, computed


def test_a_real_prefill_read_is_never_refused_and_loads_every_claimed_token(pair: Pair) -> None:
    original = _vllm_original()
    cls = patch._mc().MoRIIOConnectorScheduler
    with applied(FIX):

        @FAST
        @given(prompts())
        def check(prompt: tuple[int, int]) -> None:
            num_tokens, computed = prompt
            rid = f"real-{num_tokens}-{computed}"
            params = prefill_params(pair, num_tokens, rid)
            vllm_answer, _, _, _ = claim_and_load(pair, params, rid, num_tokens, computed, original)
            answer, asks, result, local = claim_and_load(
                pair, params, rid, num_tokens, computed, cls.get_num_new_matched_tokens
            )
            assert answer == vllm_answer == (max(num_tokens - computed - 1, 0), False)
            assert asks, "the fix cleared do_remote_prefill: the READ vLLM would do is dropped"
            assert result is not None, f"the fix refused a READ vLLM loads: {params['remote_block_ids']}"
            needed = required(pair, local, num_tokens, computed)
            for index, (need, got) in enumerate(zip(needed, result, strict=True)):
                assert need <= got, f"payload group {index}: blocks {sorted(need - got)} claimed, never read"

        check()


def test_state_groups_are_read_on_a_full_local_hit(pair: Pair) -> None:
    """A prompt whose attention prefix is all local (c = N-1, claim 0): vLLM still reads the
    state groups; the fix must leave the request's READ to vLLM."""
    if not any(g.kind in ("ring", "mamba") for g in pair.layout):
        pytest.skip("no state groups in this layout")
    num_tokens, computed = 4 * B + 1, 4 * B
    cls = patch._mc().MoRIIOConnectorScheduler
    with applied(FIX):
        params = prefill_params(pair, num_tokens, "full-hit")
        answer, after, result, local = claim_and_load(
            pair, params, "full-hit", num_tokens, computed, cls.get_num_new_matched_tokens
        )
    assert answer == (0, False)
    assert result is not None and after is True
    needed = required(pair, local, num_tokens, computed)
    assert any(needed)
    for need, got in zip(needed, result, strict=True):
        assert need <= got


MUTATIONS = ("drop-last", "extra-group", "empty-group", "cut-group", "one-block")


@st.composite
def mutated(draw: st.DrawFn, groups: int) -> tuple[str, int]:
    return draw(st.sampled_from(MUTATIONS)), draw(st.integers(0, groups - 1))


def mutate(blocks: list[list[int]], how: str, index: int) -> list[list[int]]:
    out = [list(g) for g in blocks]
    if how == "drop-last":
        out.pop()
    elif how == "extra-group":
        out.append([9001, 9002])
    elif how == "empty-group":
        out[index] = []
    elif how == "cut-group":
        out[index] = out[index][: len(out[index]) // 2]
    else:
        out[index] = out[index][-1:]
    return out


def test_whatever_the_fix_claims_is_loaded_for_any_mutated_payload(pair: Pair) -> None:
    cls = patch._mc().MoRIIOConnectorScheduler
    with applied(FIX):

        @FAST
        @given(prompts(), mutated(len(pair.layout)))
        def check(prompt: tuple[int, int], mutation: tuple[str, int]) -> None:
            num_tokens, computed = prompt
            rid = f"mut-{num_tokens}-{computed}"
            params = prefill_params(pair, num_tokens, rid)
            params["remote_block_ids"] = mutate(params["remote_block_ids"], *mutation)
            answer, after, result, local = claim_and_load(
                pair, params, rid, num_tokens, computed, cls.get_num_new_matched_tokens
            )
            if not after:  # refused: nothing claimed, nothing queued
                assert answer == (0, False) and result is None
                return
            assert result is not None
            needed = required(pair, local, num_tokens, computed)
            for index, (need, got) in enumerate(zip(needed, result, strict=True)):
                assert need <= got, f"payload group {index}: blocks {sorted(need - got)} claimed, never read"

        check()


def test_unpatched_vllm_claims_tokens_a_cut_short_group_never_loads() -> None:
    """The negative control on the newest hybrid layout: a payload whose first attention
    group was cut to one block, as a mutation above may make it. vLLM 0.34.0 claims the
    prompt and its scheduler hook fails the step (more decode than prefill blocks);
    patched, nothing is claimed and nothing raises."""
    if vllm_version() < NEWEST:
        pytest.skip("several attention groups in a hybrid READ: vLLM 0.34.0 on")
    pair = _pair(LAYOUTS["2full+swa+mamba"])
    num_tokens = 6 * B
    params = prefill_params(pair, num_tokens, "cut")
    params["remote_block_ids"] = mutate(params["remote_block_ids"], "one-block", 0)
    with pytest.raises(ValueError, match="exceed prefill block ids"):
        claim_and_load(pair, dict(params), "cut", num_tokens, 0, _vllm_original())
    cls = patch._mc().MoRIIOConnectorScheduler
    with applied(FIX):
        answer, after, result, _ = claim_and_load(
            pair, dict(params), "cut", num_tokens, 0, cls.get_num_new_matched_tokens
        )
    assert answer == (0, False) and after is False and result is None


def test_needed_blocks_reads_every_attention_group_on_the_newest_release() -> None:
    """What the fix asks of the connector for the several-attention-group layout: one count
    per payload group, each sliding-window group trimmed to its window (2 blocks + 1 for a
    32-token window), one block per state slot. The fix of 0.2.0 read one attention group
    here and refused every such READ (the group count differed)."""
    if vllm_version() < NEWEST:
        pytest.skip("several attention groups in a hybrid READ: vLLM 0.34.0 on")
    pair = _pair(LAYOUTS["2full+swa+mamba"])
    assert patch.needed_blocks(pair.consumer, BlockLayout.PER_GROUP, 6 * B) == (6, 6, 3, 1)
    ring = _pair(LAYOUTS["full+ring+mamba"])
    assert patch.needed_blocks(ring.consumer, BlockLayout.PER_GROUP, 6 * B) == (6, 1, 1)


# --------------------------------------------------------------------------- the rule alone
@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 8), min_size=1, max_size=6), st.integers(0, 500), st.data())
def test_rule_accepts_any_payload_covering_every_group(
    needed: list[int], claimed: int, data: st.DataObject
) -> None:
    """One list per group, each at least as long as that group needs (several attention
    groups, window-trimmed counts, one-block state slots) and never empty, distinct ids:
    never refused, whatever is claimed."""
    blocks = [
        data.draw(st.lists(st.integers(1, 10_000), unique=True, min_size=max(n, 1), max_size=max(n, 1) + 3))
        for n in needed
    ]
    assert blocks_reason(blocks, BlockLayout.PER_GROUP, tuple(needed), claimed) is None


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 8), min_size=1, max_size=6),
    st.integers(1, 500),
    st.lists(st.lists(st.integers(0, 10_000), max_size=10), max_size=7),
)
def test_rule_never_accepts_a_payload_that_leaves_a_claimed_block_unread(
    needed: list[int], claimed: int, blocks: list[list[int]]
) -> None:
    """Accepted with tokens claimed: one list per group, none shorter than its group needs."""
    if blocks_reason(blocks, BlockLayout.PER_GROUP, tuple(needed), claimed) is None:
        assert len(blocks) == len(needed)
        assert all(len(group) >= max(n, 1) for group, n in zip(blocks, needed, strict=True))
