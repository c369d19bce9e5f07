"""Property-based: for any kv_transfer_params, the patched READ consumer never crashes,
claims remote KV only for well-formed remote prefills, and then claims what vLLM claims."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_fix_read_eligibility import FIX
from vllm_fix_read_eligibility.probe import consumer
from vllm_fix_read_eligibility.rule import malformed_reason
from vllm_fix_testing import applied

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 50), st.text(max_size=4), st.floats(allow_nan=False)
)
groups = st.lists(st.one_of(st.integers(0, 100), scalars), max_size=4)
block_ids = st.one_of(
    scalars,
    st.lists(st.lists(st.integers(0, 100), max_size=5), max_size=3),
    st.lists(groups, max_size=3),
    st.tuples(st.lists(st.integers(0, 100), max_size=3)),
)
params = st.one_of(
    st.none(),
    st.fixed_dictionaries(
        {},
        optional={
            "do_remote_prefill": st.one_of(st.booleans(), scalars),
            "remote_block_ids": block_ids,
            "remote_engine_id": st.one_of(st.text(max_size=6), scalars),
        },
    ),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(p=params, n=st.integers(0, 64), computed=st.integers(0, 64))
def test_patched_claims_only_for_well_formed_remote_prefill(p: Any, n: int, computed: int) -> None:
    def call() -> Any:
        req = SimpleNamespace(
            request_id="prop", num_prompt_tokens=n, kv_transfer_params=None if p is None else dict(p)
        )
        return consumer().get_num_new_matched_tokens(req, computed)

    unpatched = call()
    with applied(FIX):
        patched = call()
    eligible = isinstance(p, dict) and bool(p.get("do_remote_prefill")) and malformed_reason(p) is None
    if eligible:
        assert patched == unpatched == (max(n - computed - 1, 0), False)
    else:
        assert patched == (0, False)
