"""Stands in for a GPU KV-cache allocation: host bytes placed at a chosen address.

MoRIIO registers one memory region over the KV allocation vLLM makes on the GPU. Its
placement (page-aligned or not, padded or not) decides whether vLLM's
``_build_shared_kv_mr`` works. A CPU machine has no such allocation, so this module places
a byte storage at a chosen address modulo 4096 (``torch.frombuffer`` over a bytearray) and
carves vLLM-shaped layer views out of it: KDA packed layers (``MambaSpec``, vLLM 0.31+),
split K/V attention views ``[2, B, 16, 1, 128]`` and block-first attention views
``[B, 2, 16, 1, 128]`` (every release with a shared MR).
"""

from __future__ import annotations

from typing import Any

PAGE_SIZE = 4096
KDA_PAGE = 32  # bytes per KDA slot: conv (4, 1) f32 + ssm (2, 2) f32
ATTN_PLANE = 16 * 128 * 2  # one K or V plane of one block (16 tokens x 1 head x 128, fp16)


def backing(start_mod: int, nbytes: int) -> Any:
    """A uint8 tensor whose own storage is ``nbytes`` long and starts at ``start_mod`` mod 4096."""
    import torch

    buffer = bytearray(nbytes + 2 * PAGE_SIZE)
    address = torch.frombuffer(buffer, dtype=torch.uint8).data_ptr()
    offset = (start_mod - address) % PAGE_SIZE
    return torch.frombuffer(buffer, dtype=torch.uint8, offset=offset, count=nbytes)


def kda_spec() -> Any:
    import torch
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(block_size=16, shapes=((4, 1), (2, 2)), dtypes=(torch.float32, torch.float32))


def attention_spec() -> Any:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=128, dtype=torch.float16)


def kda_cache(storage: Any, offset: int, slots: int = 2) -> Any:
    """A packed KDA layer ``[slots, 1, 1, 32]`` (uint8) at ``offset`` bytes into ``storage``."""
    return storage[offset : offset + slots * KDA_PAGE].view(slots, 1, 1, KDA_PAGE)


def split_kv_cache(storage: Any, offset: int, num_blocks: int = 1) -> Any:
    """A split K/V attention layer ``[2, blocks, 16, 1, 128]`` (fp16): K plane, then V plane."""
    import torch

    plane = num_blocks * ATTN_PLANE
    return storage[offset : offset + 2 * plane].view(torch.float16).view(2, num_blocks, 16, 1, 128)


def block_first_cache(storage: Any, offset: int, num_blocks: int = 1) -> Any:
    """A block-first attention layer ``[blocks, 2, 16, 1, 128]`` (fp16): one registration region."""
    import torch

    nbytes = num_blocks * 2 * ATTN_PLANE
    return storage[offset : offset + nbytes].view(torch.float16).view(num_blocks, 2, 16, 1, 128)
