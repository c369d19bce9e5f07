"""The rule on a MoRIIOConnectorScheduler built by vLLM's own constructor for a hybrid model, its
READ queued by vLLM's own update_state_after_alloc: the attributes the fix reads are the ones a
real engine core has, and the tail block vLLM trims from the READ is never excluded."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from packaging.version import Version

from vllm_fix_sync_load_zeroing import FIX
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


def hybrid_connector(vllm_config: Any, layout: str) -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

    attention = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16)
    mamba = MambaSpec(block_size=16, shapes=((3, 8), (2, 8, 8)), dtypes=(torch.float16, torch.float16))
    config = KVCacheConfig(
        num_blocks=128,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["attn"], attention), KVCacheGroupSpec(["mamba"], mamba)],
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
    blocks = SimpleNamespace(get_block_ids=lambda: ([7, 8, 9], [90]))
    connector.update_state_after_alloc(request, blocks, 39)
    assert connector._reqs_need_recv[rid][1] == [[7, 8], [90]]


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
