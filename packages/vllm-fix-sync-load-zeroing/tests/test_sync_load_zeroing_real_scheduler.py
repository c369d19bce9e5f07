"""The rule on a MoRIIOConnectorScheduler built by vLLM's own constructor for a hybrid model, its
READ queued by vLLM's own update_state_after_alloc: the attributes the fix reads are the ones a
real engine core has, and the tail block vLLM trims from the READ is never excluded. On vLLM
0.34.0, whose hybrid READ carries every attention group, the model has two (full and
sliding-window attention) and every READ destination of both skips zeroing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from packaging.version import Version

from vllm_fix_sync_load_zeroing import FIX
from vllm_fix_sync_load_zeroing.facts import second_group_spec
from vllm_fix_sync_load_zeroing.probe import require_feature, step_output
from vllm_fix_testing import (
    MORIIO_EXTRA_CONFIG,
    applied,
    real_request,
    real_scheduler,
    tiny_model_dir,
    vllm_version,
)

HAS_EXCLUSION = vllm_version() >= Version("0.32.0")
SEVERAL_GROUPS = vllm_version() >= Version("0.34.0")


@pytest.fixture(scope="module")
def consumer_config(tmp_path_factory: pytest.TempPathFactory) -> Any:
    model = tiny_model_dir(tmp_path_factory.mktemp("tiny-opt"))
    sched = real_scheduler(
        model,
        kv_connector="MoRIIOConnector",
        kv_role="kv_consumer",
        extra_config={**MORIIO_EXTRA_CONFIG, "read_mode": True},
    )
    return sched.vllm_config


def hybrid_connector(vllm_config: Any, layout: str, attention_groups: int = 1) -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

    attention = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16)
    mamba = MambaSpec(block_size=16, shapes=((3, 8), (2, 8, 8)), dtypes=(torch.float16, torch.float16))
    groups = [KVCacheGroupSpec(["attn"], attention)]
    if attention_groups == 2:
        groups.append(KVCacheGroupSpec(["swa"], second_group_spec(attention)))
    config = KVCacheConfig(
        num_blocks=128,
        kv_cache_tensors=[],
        kv_cache_groups=[*groups, KVCacheGroupSpec(["mamba"], mamba)],
    )
    config.kv_cache_layout = layout
    mc = require_feature()
    return mc.MoRIIOConnectorScheduler(vllm_config, "127.0.0.1:6301", config)


def queue_read(connector: Any, rid: str) -> None:
    """A remote prefill of a 40-token prompt: the prefill holds attention blocks [10, 11] and
    Mamba slot [50]; the decode allocated [7, 8, 9] and [90]. vLLM's own _align_read_blocks
    pairs the READ with 7 and 8 and leaves 9 to the locally recomputed last token."""
    params = {
        "do_remote_prefill": True,
        "remote_block_ids": [[10, 11], [50]],
        "remote_engine_id": "prefill-0",
        "transfer_id": f"tx-{rid}",
        "remote_host": "127.0.0.1",
        "remote_handshake_port": 6301,
        "remote_notify_port": 61005,
    }
    request = real_request(rid, 40, kv_transfer_params=params)
    connector.update_state_after_alloc(request, allocated([7, 8, 9], [90]), 39)
    assert connector._reqs_need_recv[rid][1] == [[7, 8], [90]]


def allocated(*groups: list[int]) -> Any:
    """vLLM's KVCacheBlocks holding these block ids, one list per KV cache group."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    return KVCacheBlocks(tuple([KVCacheBlock(b) for b in group] for group in groups))


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "BLHNC", "BLNHC"])
def test_real_hybrid_consumer_step(consumer_config: Path, layout: str) -> None:
    def step(rid: str) -> list[int]:
        connector = hybrid_connector(consumer_config, layout)
        assert connector._has_mamba is True and connector.is_producer is False
        queue_read(connector, rid)
        out = step_output((7, 8, 9, 90))
        meta = connector.build_connector_meta(out)
        assert rid in meta.reqs_to_recv
        return list(out.new_block_ids_to_zero or [])

    unpatched = step("unpatched")
    assert unpatched == ([9, 90] if HAS_EXCLUSION else [7, 8, 9, 90])  # 0.31.0: the race
    if not HAS_EXCLUSION:
        with applied(FIX):
            assert step("patched") == [9, 90]


@pytest.mark.skipif(not SEVERAL_GROUPS, reason="this vLLM's hybrid READ carries one attention group")
@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "BLHNC", "BLNHC"])
def test_real_hybrid_consumer_with_two_attention_groups(consumer_config: Path, layout: str) -> None:
    """The prefill holds [10, 11] (full attention), [20, 21] (sliding window) and Mamba slot
    [50]; the decode allocated [7, 8, 9], [12, 13, 14] and [90]. vLLM pairs each attention group
    with its remote suffix and leaves 9 and 14 to the recomputed last token; the step then zeroes
    only 9, 14 and 90."""
    connector = hybrid_connector(consumer_config, layout, attention_groups=2)
    assert connector._attn_group_ids == [0, 1] and connector._mamba_group_ids == [2]
    params = {
        "do_remote_prefill": True,
        "remote_block_ids": [[10, 11], [20, 21], [50]],
        "remote_engine_id": "prefill-0",
        "transfer_id": "tx-two-groups",
        "remote_host": "127.0.0.1",
        "remote_handshake_port": 6301,
        "remote_notify_port": 61005,
    }
    request = real_request("two-groups", 40, kv_transfer_params=params)
    connector.update_state_after_alloc(request, allocated([7, 8, 9], [12, 13, 14], [90]), 39)
    assert connector._reqs_need_recv["two-groups"][1] == [[7, 8], [12, 13], [90]]
    out = step_output((7, 8, 9, 12, 13, 14, 90))
    meta = connector.build_connector_meta(out)
    assert "two-groups" in meta.reqs_to_recv
    assert list(out.new_block_ids_to_zero or []) == [9, 14, 90]
