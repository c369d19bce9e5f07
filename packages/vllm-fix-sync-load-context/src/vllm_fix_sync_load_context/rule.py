"""The forward context a FULL-replay step's synchronous load must see.

Built the way vLLM's own set_forward_context builds one, minus anything that could run a
collective: under FULL every DP rank runs the padded token count they all agreed on in
dispatch (vLLM captures FULL graphs with exactly that count on every rank), so the per-rank
counts are known without asking the other ranks.
"""

from __future__ import annotations

from typing import Any


def full_step_context(vllm_config: Any, attn_metadata: Any, input_batch: Any) -> Any:
    """A ForwardContext for the FULL replay of `input_batch` (vLLM's own ForwardContext type)."""
    import torch
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor, DPMetadata, create_forward_context
    from vllm.platforms import current_platform

    num_tokens = int(input_batch.num_tokens_after_padding)
    parallel = vllm_config.parallel_config
    dp_size = int(parallel.data_parallel_size)
    dp_metadata = None
    num_tokens_across_dp = None
    if (dp_size > 1 or getattr(parallel, "use_sequence_parallel_moe", False)) and (
        parallel.is_moe_model is not False
    ):
        num_tokens_across_dp = torch.full((dp_size,), num_tokens, dtype=torch.int32)
        dp_metadata = DPMetadata.make(parallel, num_tokens, num_tokens_across_dp)
    batch_descriptor = BatchDescriptor(
        num_tokens=num_tokens,
        num_reqs=getattr(input_batch, "num_reqs_after_padding", None),
        has_lora=vllm_config.lora_config is not None,
    )
    mode = CUDAGraphMode.FULL
    additional = current_platform.set_additional_forward_context(
        attn_metadata=attn_metadata,
        vllm_config=vllm_config,
        dp_metadata=dp_metadata,
        num_tokens=num_tokens,
        num_tokens_across_dp=num_tokens_across_dp,
        cudagraph_runtime_mode=mode,
        batch_descriptor=batch_descriptor,
        ubatch_slices=None,
    )
    return create_forward_context(
        attn_metadata,
        vllm_config,
        dp_metadata=dp_metadata,
        cudagraph_runtime_mode=mode,
        batch_descriptor=batch_descriptor,
        additional_kwargs=additional,
        is_padding=getattr(input_batch, "is_padding", None),
    )
