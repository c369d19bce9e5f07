"""Test oracle: does zeroing a block and then READing it leave the same memory as the READ alone?

Simulated on CPU bytes: the zeroing kernel's segments and the READ's destination ranges come
from vLLM (its view builder, KVBlockZeroer and MoRIIO's offsets, via coverage.byte_ranges); the
verdict is a memory comparison, independent of the rule module's interval arithmetic.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from vllm_fix_sync_load_zeroing.coverage import byte_ranges


@functools.lru_cache(maxsize=None)
def zero_then_read_equals_read(layout: str, spec: Any, skipped: frozenset[int] = frozenset()) -> bool:
    try:
        zero, reads = byte_ranges(layout, spec, skipped)
    except Exception:
        return False  # vLLM cannot build it: nothing may be excluded
    end = max(e for ranges in (*zero.values(), *reads.values()) for _, e in ranges)
    gen = torch.Generator().manual_seed(0)
    stale = torch.randint(1, 256, (end,), dtype=torch.uint8, generator=gen)
    remote = torch.randint(1, 256, (end,), dtype=torch.uint8, generator=gen)
    for block in zero:
        read_only = stale.clone()
        raced = stale.clone()
        for s, e in zero[block]:  # the zeroing kernel lands first...
            raced[s:e] = 0
        for memory in (read_only, raced):  # ...then the READ
            for s, e in reads[block]:
                memory[s:e] = remote[s:e]
        if not torch.equal(read_only, raced):
            return False
    return True
