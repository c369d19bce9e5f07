"""The forward context a FULL-replay step's synchronous load must see.

Built the way vLLM's own set_forward_context builds one, minus anything that could run a
collective: under FULL every DP rank runs the padded token count they all agreed on in
dispatch (vLLM captures FULL graphs with exactly that count on every rank), so the per-rank
counts are known without asking the other ranks.
"""

from __future__ import annotations

import functools
import inspect
from types import ModuleType
from typing import Any

_modules: tuple[ModuleType, ...] | None = None


def _vllm() -> tuple[ModuleType, ...]:
    """(torch, vllm.config, vllm.forward_context, vllm.platforms), imported once.

    Modules, not their functions, are kept: a name looked up on the module at call time is
    whatever is installed then (another fix may wrap it)."""
    global _modules
    if _modules is None:
        import torch
        import vllm.config
        import vllm.forward_context
        import vllm.platforms

        _modules = (torch, vllm.config, vllm.forward_context, vllm.platforms)
    return _modules


@functools.lru_cache(maxsize=8)
def _takes_padding(create_forward_context: Any) -> bool:
    return "is_padding" in inspect.signature(create_forward_context).parameters


@functools.lru_cache(maxsize=8)
def _descriptor_fields(cls: Any) -> frozenset[str]:
    return frozenset(inspect.signature(cls).parameters)


@functools.lru_cache(maxsize=1024)
def _batch_descriptor(cls: Any, num_tokens: int, num_reqs: int | None, has_lora: bool) -> Any:
    """The installed BatchDescriptor of the padded batch, with the fields it has (``has_lora``
    until 0.33; 0.34 dropped it); every other field at vLLM's default, as the runner's own
    other branch leaves them."""
    # Frozen and hashable; a FULL graph is one of a few captured sizes, so one per size is kept.
    values = {"num_tokens": num_tokens, "num_reqs": num_reqs, "has_lora": has_lora}
    fields = _descriptor_fields(cls)
    return cls(**{name: value for name, value in values.items() if name in fields})


def full_step_context(vllm_config: Any, attn_metadata: Any, input_batch: Any) -> Any:
    """A ForwardContext for the FULL replay of `input_batch` (vLLM's own ForwardContext type)."""
    torch, config, fc, platforms = _modules or _vllm()
    num_tokens = int(input_batch.num_tokens_after_padding)
    parallel = vllm_config.parallel_config
    dp_size = int(parallel.data_parallel_size)
    dp_metadata = None
    num_tokens_across_dp = None
    if (dp_size > 1 or getattr(parallel, "use_sequence_parallel_moe", False)) and (
        parallel.is_moe_model is not False
    ):
        num_tokens_across_dp = torch.full((dp_size,), num_tokens, dtype=torch.int32)
        dp_metadata = fc.DPMetadata.make(parallel, num_tokens, num_tokens_across_dp)
    batch_descriptor = _batch_descriptor(
        fc.BatchDescriptor,
        num_tokens,
        getattr(input_batch, "num_reqs_after_padding", None),
        vllm_config.lora_config is not None,
    )
    mode = config.CUDAGraphMode.FULL
    additional = platforms.current_platform.set_additional_forward_context(
        attn_metadata=attn_metadata,
        vllm_config=vllm_config,
        dp_metadata=dp_metadata,
        num_tokens=num_tokens,
        num_tokens_across_dp=num_tokens_across_dp,
        cudagraph_runtime_mode=mode,
        batch_descriptor=batch_descriptor,
        ubatch_slices=None,
    )
    # Releases before 0.28 have no padding mask in the forward context.
    padding = (
        {"is_padding": getattr(input_batch, "is_padding", None)}
        if _takes_padding(fc.create_forward_context)
        else {}
    )
    return fc.create_forward_context(
        attn_metadata,
        vllm_config,
        dp_metadata=dp_metadata,
        cudagraph_runtime_mode=mode,
        batch_descriptor=batch_descriptor,
        additional_kwargs=additional,
        **padding,
    )
