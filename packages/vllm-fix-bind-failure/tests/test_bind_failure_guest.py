"""The probe is a guest (real vLLM): it binds no VLLM_PORT, leaves threading.excepthook alone (so
another thread's exception is reported as before), ends every thread it or vLLM starts for it,
and keeps vLLM's INFO lines about its worker and listeners out of vLLM's log."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from vllm_fix_bind_failure import FIX
from vllm_fix_bind_failure import probe as probe_module
from vllm_fix_core import Answer
from vllm_fix_core.guest import guest
from vllm_fix_testing import applied, ports

AFFECTED = {
    "handshake-bind-failure-unseen",
    "start-up-waits-on-dead-handshake-listener",
    "notify-bind-failure-unseen",
}
# What vLLM logs at INFO for the probe's worker and its listeners (the probing thread's lines
# and the listener threads' own).
PROBE_LINES = ("Initializing MoRIIO worker", "Using MoRIIO backend", "Node starting to listen notify")


@pytest.fixture
def binds(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    return ports.trace_binds(monkeypatch)


@pytest.fixture(params=ports.VLLM_PORT_KINDS)
def vllm_port(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    with ports.vllm_port(request.param, monkeypatch) as port:
        yield port


def test_vllm_port_is_never_bound_and_the_decisions_hold(
    vllm_port: int, binds: list[tuple[int, int]]
) -> None:
    assert set(FIX.run_probe().names(True)) == AFFECTED
    with applied(FIX) as decision:
        assert decision.answer is Answer.AFFECTED_FIXED
        after = FIX.run_probe()
        assert not after.affected, after.summary()
    assert binds, "the probe bound nothing: the trace is not seeing its sockets"
    assert vllm_port not in {port for bind in binds for port in bind}
    assert {asked for asked, _ in binds} == {0}  # only ports the kernel picks


def _probe_threads_gone(before: set[threading.Thread]) -> list[str]:
    deadline = time.monotonic() + 5.0
    while True:
        left = [t.name for t in threading.enumerate() if t not in before]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.01)


@pytest.mark.parametrize("patched", [False, True], ids=["unpatched", "patched"])
def test_excepthook_untouched_other_threads_reported_probe_threads_end(
    patched: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A thread of someone else's that dies while the probe runs reaches the process's own
    hook; the probe's dying listeners do not; the hook is the same object before, during and
    after; every thread started for the probe has ended when it returns."""
    reported: list[str] = []
    hooks_during: list[Any] = []

    def hook(args: Any) -> None:
        reported.append(args.thread.name if args.thread is not None else "?")

    monkeypatch.setattr(threading, "excepthook", hook)
    original = probe_module.kv_caches

    def kv_caches() -> dict[str, Any]:  # called by the probe in the middle of its start-up check
        hooks_during.append(threading.excepthook)
        other = threading.Thread(target=lambda: 1 / 0, name="someone-elses-thread")
        other.start()
        other.join()
        return original()

    monkeypatch.setattr(probe_module, "kv_caches", kv_caches)
    before = set(threading.enumerate())
    if patched:
        with applied(FIX):
            report = FIX.run_probe()
        assert not report.affected, report.summary()
    else:
        assert set(FIX.run_probe().names(True)) == AFFECTED
    assert hooks_during and all(during is hook for during in hooks_during)
    assert threading.excepthook is hook
    assert reported == ["someone-elses-thread"] * len(hooks_during)
    assert _probe_threads_gone(before) == []


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _probe_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith(PROBE_LINES)]


def test_vllm_lines_of_the_probes_worker_and_listeners_stay_out_of_the_log() -> None:
    vllm_logger = logging.getLogger("vllm")
    level = vllm_logger.level
    vllm_logger.setLevel(logging.INFO)  # vLLM's default; a test run may have it configured higher
    handler = _Lines()
    vllm_logger.addHandler(handler)
    try:
        probe_module.probe()  # the control: outside guest(), vLLM's lines reach its log
        control = _probe_lines(handler.lines)
        handler.lines.clear()
        with guest():
            report = probe_module.probe()
        time.sleep(0.2)  # a listener's late line would be here by now
    finally:
        vllm_logger.removeHandler(handler)
        vllm_logger.setLevel(level)
    assert set(report.names(True)) == AFFECTED
    assert any(line.startswith("Node starting to listen notify") for line in control), control
    assert any(line.startswith("Initializing MoRIIO worker") for line in control), control
    assert _probe_lines(handler.lines) == []
