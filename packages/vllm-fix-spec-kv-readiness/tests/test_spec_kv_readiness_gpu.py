"""c3b with real CUDA events (optional: skips without a CUDA device; not yet run on a GPU).

Real MRV2 sample_tokens, real ActiveKVConnector, real AsyncOutput (real streams and events).
The drafter sleeps on the device before writing the draft KV, so its last kernel ends well
after the target's sampled tokens are copied. After get_output() returns, an event recorded
right after that kernel says whether the draft KV was on the device when the output became
visible: without the fix it is not, at least once (reported as a count, never an exact
timing); with the fix, never.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from vllm_fix_spec_kv_readiness import FIX  # noqa: E402
from vllm_fix_testing import applied  # noqa: E402
from vllm_fix_testing.spec_runner import SpecRunner  # noqa: E402

STEPS = 20


def early_outputs(read_publisher: bool = True) -> int:
    """Steps whose output was visible before the draft's last kernel had finished."""
    spec = SpecRunner(device="cuda", read_publisher=read_publisher, draft_sleep_cycles=50_000_000)
    spec.step()  # warm up (allocations, first launches)
    early = 0
    for _ in range(STEPS):
        result = spec.step()
        early += result.draft_done_at_output is False
    torch.cuda.synchronize()
    return early


def test_c3b_output_visible_before_draft_kernel_finished_on_gpu() -> None:
    unpatched = early_outputs()
    print(f"unpatched: {unpatched}/{STEPS} outputs visible before the draft kernel finished")
    assert unpatched >= 1
    with applied(FIX):
        patched = early_outputs()
    print(f"patched: {patched}/{STEPS}")
    assert patched == 0


def test_non_read_connector_keeps_overlap_on_gpu() -> None:
    with applied(FIX):
        overlapped = early_outputs(read_publisher=False)
    print(f"non-READ connector, patched: {overlapped}/{STEPS} outputs overlapped the draft")
    assert overlapped >= 1
