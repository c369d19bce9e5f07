"""Cost of vllm-fix-mr-extent: MoRIIOConnectorWorker._build_shared_kv_mr, patched vs unpatched.

Runs in a venv with vLLM (0.32.0 or 0.33.0) and vllm-fix-mr-extent installed:

    python benchmarks/bench_mr_extent.py [--layers 48] [--attention-every 4] [--reps 200]

One process, one realistic hybrid layout (KDA layers plus one full-attention layer every
``--attention-every`` layers, each layer 4 KiB aligned on one page-aligned backing that
is padded to 4 KiB, the only input the unpatched builder accepts). The two builders run
interleaved on the same worker and caches; it prints the median times and the
patched/unpatched ratio. It asserts nothing about time.

The backing is an anonymous mmap viewed by torch (page-aligned, untouched pages are never
committed), so the large virtual size costs almost no memory.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import time
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch

PAGE = 4096


def align_up(value: int, to: int = PAGE) -> int:
    return -(-value // to) * to


def build_layout(layers: int, attention_every: int, num_blocks: int, slots: int) -> tuple[Any, ...]:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    kda = MambaSpec(block_size=16, shapes=((3, 1024), (8, 64, 64)), dtypes=(torch.float32, torch.float32))
    kda_page = 3 * 1024 * 4 + 8 * 64 * 64 * 4
    attn = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=128, dtype=torch.float16)
    attn_bytes = num_blocks * 2 * 16 * 4 * 128 * 2
    plan: list[tuple[str, str, int]] = []
    cursor = 0
    for i in range(layers):
        kind = "attn" if (i + 1) % attention_every == 0 else "kda"
        plan.append((f"model.layers.{i}.{kind}", kind, cursor))
        cursor = align_up(cursor + (attn_bytes if kind == "attn" else slots * kda_page))
    area = mmap.mmap(-1, cursor)
    backing = torch.frombuffer(area, dtype=torch.uint8)
    caches: dict[str, Any] = {}
    specs: dict[str, Any] = {}
    for name, kind, off in plan:
        if kind == "attn":
            view = backing[off : off + attn_bytes].view(torch.float16)
            caches[name], specs[name] = view.view(num_blocks, 2, 16, 4, 128), attn
        else:
            caches[name] = backing[off : off + slots * kda_page].view(slots, 1, 1, kda_page)
            specs[name] = kda
    return area, backing, caches, specs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--attention-every", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=2048)
    parser.add_argument("--slots", type=int, default=128)
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args()

    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector as mc

    from vllm_fix_core import runtime
    from vllm_fix_core.patching import original_of
    from vllm_fix_core.settings import Settings
    from vllm_fix_mr_extent import FIX

    area, backing, caches, specs = build_layout(args.layers, args.attention_every, args.blocks, args.slots)
    worker = mc.MoRIIOConnectorWorker.__new__(mc.MoRIIOConnectorWorker)
    worker.kv_caches, worker.layer_to_spec = caches, specs

    unpatched = original_of(mc.MoRIIOConnectorWorker, "_build_shared_kv_mr")
    decision = runtime.apply(FIX, Settings(disabled=frozenset(), strict=True))
    patched = mc.MoRIIOConnectorWorker.__dict__["_build_shared_kv_mr"]
    assert patched is not unpatched, decision.message

    reg_u, off_u = unpatched(worker, caches)
    reg_p, off_p = patched(worker, caches)
    same_base = reg_u.data_ptr() == reg_p.data_ptr() and off_u == off_p

    times: dict[str, list[float]] = {"unpatched": [], "patched": []}
    funcs = {"unpatched": unpatched, "patched": patched}
    for rep in range(args.reps):
        order = ("unpatched", "patched") if rep % 2 == 0 else ("patched", "unpatched")
        for name in order:
            start = time.perf_counter()
            funcs[name](worker, caches)
            times[name].append(time.perf_counter() - start)
    runtime.revert(FIX)

    med = {name: statistics.median(values) for name, values in times.items()}
    attn = sum(1 for n in caches if n.endswith(".attn"))
    print(
        f"vLLM layout: {len(caches)} layers ({len(caches) - attn} KDA, {attn} attention), "
        f"backing {backing.numel() / 2**20:.0f} MiB, {args.reps} interleaved repetitions"
    )
    print(
        f"registration: unpatched {reg_u.numel()} B, patched {reg_p.numel()} B; "
        f"same base and offsets: {same_base}"
    )
    for name in ("unpatched", "patched"):
        print(f"{name:>9}: median {med[name] * 1e6:8.1f} us  (min {min(times[name]) * 1e6:.1f} us)")
    print(f"patched/unpatched ratio: {med['patched'] / med['unpatched']:.2f}")
    del reg_u, reg_p, caches, backing
    area.close()


if __name__ == "__main__":
    main()
