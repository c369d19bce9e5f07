"""The readiness rule on real connector classes: which connectors wait for the draft KV."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_fix_spec_kv_readiness.readiness import (
    StepDone,
    copy_into,
    needs_step_done,
    publishes_for_remote_read,
)


def built(cls: type, *, role: str, **attrs: Any) -> Any:
    """A real connector object as vLLM's own tests build one: __new__ plus what is read."""
    obj = cls.__new__(cls)
    obj._kv_transfer_config = SimpleNamespace(is_kv_producer=role in ("kv_producer", "kv_both"), kv_role=role)
    for name, value in attrs.items():
        setattr(obj, name, value)
    return obj


def moriio(role: str, read: bool) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector as mc

    return built(mc.MoRIIOConnector, role=role, mode=mc.MoRIIOMode.READ if read else mc.MoRIIOMode.WRITE)


def nixl(role: str, push: bool = False) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    name = "NixlPushConnector" if push else "NixlConnector"
    try:
        cls = KVConnectorFactory.get_connector_class_by_name(name)
    except Exception as exc:  # not part of this release
        pytest.skip(f"{name}: {exc!r}")
    return built(cls, role=role)


def example(role: str) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

    return built(ExampleConnector, role=role)


def multi(*children: Any) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    return built(MultiConnector, role="kv_producer", _connectors=list(children))


# (id, a connector, does it publish blocks for a remote READ?): the native carry's tests ask the
# helper it writes into a tree the same questions (test_spec_kv_readiness_native.py).
PUBLISHERS: list[tuple[str, Callable[[], Any], bool]] = [
    ("moriio-read-producer", lambda: moriio("kv_producer", read=True), True),
    ("moriio-write-producer", lambda: moriio("kv_producer", read=False), False),  # the producer pushes
    ("moriio-read-consumer", lambda: moriio("kv_consumer", read=True), False),  # publishes nothing
    ("nixl-producer", lambda: nixl("kv_producer"), True),
    ("nixl-both", lambda: nixl("kv_both"), True),
    ("nixl-consumer", lambda: nixl("kv_consumer"), False),
    ("nixl-push-producer", lambda: nixl("kv_producer", push=True), False),
    ("example-producer", lambda: example("kv_producer"), False),
    ("multi-with-moriio-read", lambda: multi(example("kv_producer"), moriio("kv_producer", read=True)), True),
    (
        "multi-with-moriio-write",
        lambda: multi(example("kv_producer"), moriio("kv_producer", read=False)),
        False,
    ),
]


@pytest.mark.parametrize(
    ("make", "expected"), [case[1:] for case in PUBLISHERS], ids=[case[0] for case in PUBLISHERS]
)
def test_which_connectors_publish_blocks_for_remote_read(make: Any, expected: bool) -> None:
    assert publishes_for_remote_read(make()) is expected


@pytest.mark.parametrize("flag", [True, False])
def test_explicit_opt_in_attribute_decides(flag: bool) -> None:
    connector = example("kv_consumer")
    connector.requires_full_step_completion = flag
    assert publishes_for_remote_read(connector) is flag


def test_only_speculative_configs_wait() -> None:
    producer = moriio("kv_producer", read=True)
    spec = SimpleNamespace(vllm_config=SimpleNamespace(speculative_config=object()), kv_connector=producer)
    plain = SimpleNamespace(vllm_config=SimpleNamespace(speculative_config=None), kv_connector=producer)
    assert needs_step_done(spec) is True
    assert needs_step_done(plain) is False


def test_copy_into_fills_the_runner_held_output() -> None:
    from vllm.v1.outputs import KVConnectorOutput

    held = KVConnectorOutput()
    fresh = KVConnectorOutput(finished_sending={"a"}, finished_recving={"b"}, invalid_block_ids={3})
    copy_into(held, fresh)
    assert held == fresh and held is not fresh


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 40)), max_size=60), st.integers(1, 8))
def test_step_done_gives_each_output_its_own_event_once(ops: list[tuple[bool, int]], capacity: int) -> None:
    """For any interleaving of attach/take: take returns the event attached to that very output
    (never another's), at most once, and the table never holds more than its capacity."""
    table = StepDone(capacity)
    outputs = [object() for _ in range(41)]
    attached: dict[int, object] = {}
    for attach, i in ops:
        if attach:
            event = object()
            table.attach(outputs[i], event)
            attached[i] = event
        else:
            got = table.take(outputs[i])
            assert got is None or got is attached.pop(i)
            assert table.take(outputs[i]) is None
        assert len(table) <= capacity


def _active(*, speculative: bool, pipeline: Any = 1, parallel: bool = True) -> Any:
    config = SimpleNamespace(speculative_config=object() if speculative else None)
    if parallel:
        config.parallel_config = SimpleNamespace(pipeline_parallel_size=pipeline)
    return SimpleNamespace(vllm_config=config)


@pytest.mark.parametrize(
    ("active", "expected"),
    [
        (_active(speculative=True), True),
        (_active(speculative=True, parallel=False), True),  # no parallel config: one stage
        (_active(speculative=False), False),  # no draft forward follows: nothing to wait for
        (_active(speculative=True, pipeline=2), False),  # a non-last stage sends its output on
        (_active(speculative=True, pipeline=None), False),  # unknown: keep vLLM's order
        (SimpleNamespace(), False),
    ],
)
def test_defers_collection_only_for_a_single_stage_speculative_runner(active: Any, expected: bool) -> None:
    """0.15 - 0.21 (execute_model collects the KV output): the collection waits for the drafter
    only with speculative decoding and one pipeline stage."""
    from vllm_fix_spec_kv_readiness.readiness import defers_collection

    assert defers_collection(active) is expected
