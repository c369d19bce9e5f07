"""The readiness rule itself (no vLLM imports): which connectors wait for the step's draft KV,
the step-done device event, and which output waits on which event.

A connector that publishes blocks for a remote READ (the decode side pulls them once the
scheduler has seen the request finish) must not let the step's output reach the scheduler
before the device has finished writing the step's KV, draft layers included. Every other
connector keeps vLLM's overlap of the output copy with the draft forward.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from vllm_fix_core import get_logger

_logger = get_logger("spec-kv-readiness")

# Class names (anywhere in a connector's MRO) of in-tree connectors whose producer publishes
# blocks that the consumer READs remotely after the request finishes.
READ_PUBLISHERS = frozenset({"NixlConnector", "NixlPullConnector"})
PUSH_ONLY = frozenset({"NixlPushConnector"})
MODE_DEPENDENT = frozenset({"MoRIIOConnector"})  # READ publisher only in READ mode
READ_MODE = "READ"  # the name of the mode (an enum member) in which MODE_DEPENDENT ones publish
MULTI_CONNECTOR = "MultiConnector"  # asks its children (`_connectors`)
OPT_IN_ATTRIBUTE = "requires_full_step_completion"


def _is_producer(connector: Any) -> bool:
    config = getattr(connector, "_kv_transfer_config", None) or getattr(connector, "kv_transfer_config", None)
    return bool(getattr(config, "is_kv_producer", False))


def publishes_for_remote_read(connector: Any) -> bool:
    """Does this (worker-side) KV connector hand blocks to a remote READ when a request finishes?

    In order: an explicit ``requires_full_step_completion`` attribute (the opt-in proposed
    upstream) decides; a MultiConnector asks its children; otherwise a producer of a known
    READ-mode connector (NIXL pull, MoRIIO in READ mode) does, and nothing else.
    """
    explicit = getattr(connector, OPT_IN_ATTRIBUTE, None)
    if explicit is not None:
        return bool(explicit)
    names = {klass.__name__ for klass in type(connector).__mro__}
    children = getattr(connector, "_connectors", None)
    if MULTI_CONNECTOR in names and isinstance(children, (list, tuple)):
        return any(publishes_for_remote_read(child) for child in children)
    if not _is_producer(connector) or names & PUSH_ONLY:
        return False
    if names & READ_PUBLISHERS:
        return True
    if names & MODE_DEPENDENT:
        return getattr(getattr(connector, "mode", None), "name", None) == READ_MODE
    return False


_NEEDS: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def needs_step_done(active: Any) -> bool:
    """Should this ActiveKVConnector's speculative steps wait for their draft KV? (cached per object)"""
    try:
        return _NEEDS[active]
    except KeyError:
        pass
    except TypeError:  # not weak-referenceable: decide every time
        return _decide(active)
    decision = _NEEDS[active] = _decide(active)
    return decision


def _decide(active: Any) -> bool:
    config = getattr(active, "vllm_config", None)
    if getattr(config, "speculative_config", None) is None:
        return False  # no draft forward, so the output copy already covers the step's KV
    return publishes_for_remote_read(getattr(active, "kv_connector", None))


def defers_collection(active: Any) -> bool:
    """Where execute_model collects the KV output (0.15 - 0.21), may this ActiveKVConnector's
    collection wait until sample_tokens has run the drafter?

    Only with speculative decoding (a draft forward follows) and without pipeline parallelism
    (a non-last pipeline stage sends execute_model's output on before sample_tokens runs).
    """
    config = getattr(active, "vllm_config", None)
    if getattr(config, "speculative_config", None) is None:
        return False
    size = getattr(getattr(config, "parallel_config", None), "pipeline_parallel_size", 1)
    return isinstance(size, int) and size <= 1


# Event factory for the probe (a CPU process has no device events): set per thread, so a probe
# never changes what another thread's steps record.
_local = threading.local()
_cuda: Any = None  # torch.cuda once known to be usable, False when not


def override_events(factory: Callable[[], Any] | None) -> None:
    """Make this thread's step-done events come from `factory` (None: real device events)."""
    _local.factory = factory


def event_factory() -> Callable[[], Any] | None:
    """This thread's stand-in for device events (`override_events`), or None."""
    factory: Callable[[], Any] | None = getattr(_local, "factory", None)
    return factory


def record_step_done() -> Any:
    """An event recorded on the current stream now (after the step's last draft kernel), or None."""
    factory = event_factory()
    if factory is not None:
        event = factory()
    else:
        cuda = _device()
        if not cuda:
            return None
        event = cuda.Event(blocking=True)  # sleep-waits, like vLLM's copy_event
    event.record()
    return event


def _device() -> Any:
    global _cuda
    if _cuda is None:
        import torch

        usable = bool(torch.cuda.is_available())
        if not usable:
            _logger.warning(
                "no CUDA device in this process: speculative steps' outputs cannot wait for their "
                "draft KV here (the model runner that needs it does not run without one either)"
            )
        _cuda = torch.cuda if usable else False
    return _cuda


class StepDone:
    """Which step output (a KVConnectorOutput) waits on which step-done event.

    Keyed by object identity, holding the output so its id cannot be reused while listed;
    bounded, because outputs that never go through AsyncOutput.get_output (a no-forward step,
    say) are never taken.
    """

    def __init__(self, capacity: int = 16) -> None:
        self._capacity = capacity
        self._lock = threading.Lock()
        self._events: OrderedDict[int, tuple[Any, Any]] = OrderedDict()

    def attach(self, output: Any, event: Any) -> None:
        if output is None or event is None:
            return
        with self._lock:
            self._events[id(output)] = (output, event)
            while len(self._events) > self._capacity:
                self._events.popitem(last=False)

    def take(self, output: Any) -> Any:
        if output is None or not self._events:
            return None
        with self._lock:
            entry = self._events.pop(id(output), None)
        return entry[1] if entry is not None and entry[0] is output else None

    def clear(self) -> None:
        """Forget every listed output (the fix reverted: nothing will take them any more)."""
        with self._lock:
            self._events.clear()

    def __len__(self) -> int:
        return len(self._events)


STEP_DONE = StepDone()


def copy_into(placeholder: Any, fresh: Any) -> None:
    """Fill the output the runner already holds with the fields of the step's real output."""
    if type(placeholder) is type(fresh) and hasattr(fresh, "__dict__"):
        placeholder.__dict__.update(fresh.__dict__)  # a plain dataclass: one C-level copy
    else:
        for field in dataclasses.fields(fresh):
            setattr(placeholder, field.name, getattr(fresh, field.name))
