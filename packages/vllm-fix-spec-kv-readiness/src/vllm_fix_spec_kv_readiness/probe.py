"""Does this vLLM's MRV2 runner hand out a speculative step's KV output too early?

Runs the real, currently installed ``GPUModelRunner.sample_tokens`` for one step, with the
real ``ActiveKVConnector`` (``post_forward`` / ``finalize_step`` as installed) and the real
``AsyncOutput.get_output`` (as installed). Where the installed ``execute_model`` collects the
KV connector output itself (0.15 - 0.21), the probe makes that ``post_forward`` call as
``execute_model`` does, after the target forward's saves and before ``sample_tokens``. What
differs between releases (the form of the state ``execute_model`` leaves, where the output is
collected, ``post_forward``'s arguments) is read from the installed code in ``releases.py``.
Only what a CPU process lacks is stood in for (``stand_ins.py``), and only for the duration of
the probe, in this thread:

* the runner's ``self``: the attributes ``sample_tokens`` reads (sampled tokens, request
  state, a drafter whose ``propose`` saves a draft layer through the bound connector, which
  is what the attention layers' KV-transfer hook does, and then marks its last kernel);
* the worker-side connector: records the order of calls; a save completes at ``wait_for_save``;
* device events: recorded in call order (an ``AsyncOutput`` that records its copy event where
  vLLM's does; step-done events created by whatever the installed code asks for: the runtime
  fix's ``readiness.record_step_done``, or ``torch.cuda.Event`` in a tree that carries the fix
  natively, which this thread sees as the same recording stand-in while the probe runs).

On CPU the order of submission is the device order (one stream), so "the output waits on an
event recorded after the draft's last kernel" is checked as an ordering. The checks:

* ``kv-output-misses-step-saves`` (0.15 - 0.21, 0.33.0): the step's ``KVConnectorOutput`` does
  not report the saves the target and draft forwards issued and ``wait_for_save`` completed;
* ``output-visible-before-draft-kv`` (0.15 - 0.33.0): ``get_output()`` waits on nothing
  recorded after the draft's last kernel, for a connector that publishes blocks for READ;
* guards: the transfer results are drained exactly once per step; a connector that does not
  publish for READ keeps the overlap (no extra wait); a non-speculative step drains once,
  after ``wait_for_save``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from vllm_fix_core import Check, NotApplicable, ProbeReport
from vllm_fix_spec_kv_readiness import readiness, releases
from vllm_fix_spec_kv_readiness.stand_ins import (
    DRAFT_DONE,
    DRAIN,
    SAVES,
    TARGET_LAYER,
    Connector,
    Drafter,
    Event,
    Step,
    active_connector,
    async_output_class,
    runner,
)

_lock = threading.Lock()  # the probe swaps model_runner.AsyncOutput while it runs


def _device_events(real: Any) -> Any:
    """``torch.cuda.Event`` while the probe runs: in the probing thread, the probe's recording
    stand-in (whatever the installed code asks for: a tree that carries the fix natively creates
    its step-done event this way); in any other thread, a real device event."""

    def event(*args: Any, **kwargs: Any) -> Any:
        factory = readiness.event_factory()
        return real(*args, **kwargs) if factory is None else factory()

    return event


@contextmanager
def _cpu_device(step: Step) -> Iterator[None]:
    import torch
    from vllm.v1.worker.gpu import model_runner

    with _lock:
        real = model_runner.AsyncOutput
        real_event = torch.cuda.Event
        model_runner.AsyncOutput = async_output_class(real, step)
        readiness.override_events(lambda: Event("step-done", step))
        torch.cuda.Event = _device_events(real_event)  # type: ignore[misc]
        try:
            yield
        finally:
            torch.cuda.Event = real_event  # type: ignore[misc]
            readiness.override_events(None)
            model_runner.AsyncOutput = real


@dataclass
class Outcome:
    step: Step
    kv_output: Any
    drafted: bool


def run_step(*, speculative: bool, read_publisher: bool) -> Outcome:
    """One step through the installed sample_tokens: target saves, sampling, draft, output."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    sample_tokens = getattr(GPUModelRunner, "sample_tokens", None)
    if sample_tokens is None:
        raise NotApplicable("this vLLM's MRV2 runner has no sample_tokens (no speculative step to order)")
    step = Step()
    connector = Connector(step, read_publisher=read_publisher)
    drafter = Drafter(connector, 1) if speculative else None
    active = active_connector(connector, speculative)
    # What execute_model does before sample_tokens: metadata bound, the target forward's saves
    # issued and, where the installed execute_model collects the KV connector output itself,
    # its post_forward call (through the class, so whatever is installed runs).
    connector.bind_connector_metadata(object())
    connector.save_kv_layer(TARGET_LAYER, None, {})
    kv_connector_output = None
    if releases.collects_in_execute_model(GPUModelRunner):
        if not releases.post_forward_takes_scheduler_output(type(active)):
            raise RuntimeError("execute_model calls post_forward, which does not take the scheduler output")
        kv_connector_output = active.post_forward(SimpleNamespace(finished_req_ids=set()))
    self = runner(active, drafter, kv_connector_output)
    with _cpu_device(step):
        out = sample_tokens(self, None)
        if out is None or not hasattr(out, "get_output"):
            raise RuntimeError(f"sample_tokens returned {type(out).__name__}, not an async output")
        result = out.get_output()
    return Outcome(step, result.kv_connector_output, DRAFT_DONE in step.entries)


def _finished(outcome: Outcome) -> set[str]:
    return set(getattr(outcome.kv_output, "finished_sending", None) or ())


def probe() -> ProbeReport:
    spec = run_step(speculative=True, read_publisher=True)
    if not spec.drafted:
        raise NotApplicable("this vLLM's MRV2 sample_tokens runs no speculator")
    log = spec.step.entries
    missing = set(SAVES.values()) - _finished(spec)
    early = 0 <= spec.step.at(DRAIN) < spec.step.at(DRAFT_DONE)
    last_kernel = spec.step.at(DRAFT_DONE)
    waited = sorted((e.name, e.recorded_at) for e in spec.step.synced)
    ready = any(e.recorded_at > last_kernel for e in spec.step.synced)

    overlap = run_step(speculative=True, read_publisher=False)
    extra_waits = [e.name for e in overlap.step.synced if e.name != "copy"]

    plain = run_step(speculative=False, read_publisher=True)
    plain_ok = (
        plain.step.count(DRAIN) == 1
        and plain.step.at("wait_for_save") < plain.step.at(DRAIN)
        and _finished(plain) == {"r-target"}
    )
    return ProbeReport(
        (
            Check(
                "kv-output-misses-step-saves",
                bool(missing) or early,
                f"step output lacks {sorted(missing)}; order {log}" if missing or early else "",
            ),
            Check(
                "output-visible-before-draft-kv",
                not ready,
                ""
                if ready
                else f"get_output waited on {waited}, draft's last kernel at {last_kernel}; order {log}",
            ),
            Check(
                "transfer-results-drained-once",
                spec.step.count(DRAIN) != 1,
                f"{spec.step.count(DRAIN)} drains in one speculative step",
                guard=True,
            ),
            Check(
                "non-read-connector-keeps-overlap",
                bool(extra_waits),
                f"get_output also waited on {extra_waits}",
                guard=True,
            ),
            Check("non-speculative-step-unchanged", not plain_ok, f"order {plain.step.entries}", guard=True),
        )
    )
