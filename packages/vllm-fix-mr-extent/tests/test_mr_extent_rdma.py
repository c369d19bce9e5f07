"""Hardware check: the region the fix computes registers with a real ibv_reg_mr (pyverbs).

Needs an RDMA device and the `rdma` extra (pyverbs); skipped with the reason otherwise. The
KV storage is host memory placed 128 bytes past a page boundary, the input unpatched vLLM
cannot register at all.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from vllm_fix_mr_extent import FIX, probe
from vllm_fix_testing import applied

pytestmark = pytest.mark.rdma


@pytest.fixture
def rdma_pd() -> Iterator[Any]:
    try:
        import pyverbs.device as device
        from pyverbs.pd import PD
    except ImportError as exc:
        pytest.skip(f"pyverbs is not installed (install the 'rdma' extra): {exc}")
    try:
        devices = device.get_device_list()
    except Exception as exc:  # no rdma-core kernel/user stack
        pytest.skip(f"no RDMA stack on this machine: {exc!r}")
    if not devices:
        pytest.skip("no RDMA device on this machine")
    name = devices[0].name
    ctx = device.Context(name=name.decode() if isinstance(name, bytes) else name)
    pd = PD(ctx)
    try:
        yield pd
    finally:
        pd.close()
        ctx.close()


def _access_flags() -> int:
    try:
        from pyverbs import enums
    except ImportError:  # older pyverbs
        from pyverbs import libibverbs_enums as enums
    flags: int = enums.IBV_ACCESS_LOCAL_WRITE | enums.IBV_ACCESS_REMOTE_READ | enums.IBV_ACCESS_REMOTE_WRITE
    return flags


@pytest.mark.parametrize("make", [*probe.FAILING, probe.CONTROL], ids=lambda f: f.__name__)
def test_computed_region_registers_with_ibv_reg_mr(make: Any, rdma_pd: Any) -> None:
    from pyverbs.mr import MR

    scenario = make()
    with applied(FIX):
        reg, offsets = scenario.worker()._build_shared_kv_mr(scenario.kv_caches)
    mr = MR(rdma_pd, reg.numel(), _access_flags(), address=reg.data_ptr())
    try:
        assert mr.buf == reg.data_ptr() and mr.length == reg.numel()
        for layer, cache in scenario.kv_caches.items():
            assert 0 <= offsets[layer] < mr.length
            assert mr.buf + offsets[layer] == cache.data_ptr()
    finally:
        mr.close()
