"""vllm_fix_core.guest: probes build vLLM objects through vLLM's classes and leave no trace."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
from typing import Any

import pytest

from vllm_fix_core import guest
from vllm_fix_core.declaration import ProbeReport
from vllm_fix_core.ladder import run_probe


# ---------------------------------------------------------------- build
@dataclasses.dataclass
class Plain:
    required: int
    number: int = 3
    items: list[int] = dataclasses.field(default_factory=lambda: [1, 2])

    def __post_init__(self) -> None:
        raise AssertionError("build must not run __post_init__")


def test_build_sets_every_field_to_its_default_without_post_init() -> None:
    obj = guest.build(Plain, number=7, derived="x")
    assert (obj.required, obj.number, obj.items) == (None, 7, [1, 2])
    assert obj.derived == "x"  # type: ignore[attr-defined]
    assert guest.build(Plain).items is not guest.build(Plain).items  # a factory per instance


def test_build_refuses_what_is_not_a_dataclass() -> None:
    with pytest.raises(TypeError, match="not a dataclass"):
        guest.build(int)


def test_build_gives_vllm_configs_their_own_defaults_and_runs_no_platform_hook(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm.config import CacheConfig, ParallelConfig, VllmConfig

    def no_hook(self: Any) -> None:
        raise AssertionError("VllmConfig.__post_init__ (the platform hook) ran")

    monkeypatch.setattr(VllmConfig, "__post_init__", no_hook)
    environ = dict(os.environ)
    config = guest.build(VllmConfig, parallel_config=guest.build(ParallelConfig, data_parallel_rank=1))
    assert isinstance(config.cache_config, CacheConfig)  # vLLM's default_factory, a real config
    assert config.parallel_config.data_parallel_rank == 1
    # Every field a release declares is there: one it adds is at its default, not missing.
    for field in dataclasses.fields(VllmConfig):
        assert hasattr(config, field.name), field.name
    assert "FieldInfo" not in {type(getattr(config, f.name)).__name__ for f in dataclasses.fields(VllmConfig)}
    assert dict(os.environ) == environ


# ---------------------------------------------------------------- guest()
def test_the_environment_is_put_back_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GUEST_KEEP", "1")
    monkeypatch.setenv("GUEST_CHANGE", "before")
    monkeypatch.delenv("GUEST_NEW", raising=False)
    before = dict(os.environ)
    with guest.guest():
        os.environ["GUEST_NEW"] = "x"
        os.environ["GUEST_CHANGE"] = "after"
        del os.environ["GUEST_KEEP"]
    assert dict(os.environ) == before


def test_hooks_and_loggers_are_put_back() -> None:
    logger = logging.getLogger("vllm.guest_test_logger")
    logger.setLevel(logging.INFO)
    hooks = (threading.excepthook, sys.excepthook)
    with guest.guest():
        threading.excepthook = lambda args: None
        sys.excepthook = lambda *args: None
        logger.setLevel(logging.CRITICAL)
        logger.disabled = True
        logger.propagate = False
        logger.addHandler(logging.NullHandler())
    assert (threading.excepthook, sys.excepthook) == hooks
    assert (logger.level, logger.disabled, logger.propagate, logger.handlers) == (
        logging.INFO,
        False,
        True,
        [],
    )


class _Recorder(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def vllm_handler() -> Any:
    root = logging.getLogger("vllm")
    handler = _Recorder()
    root.addHandler(handler)
    level = root.level
    root.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def test_vllm_records_of_the_probing_thread_are_dropped_and_other_threads_pass(
    vllm_handler: _Recorder,
) -> None:
    log = logging.getLogger("vllm.distributed.guest_test")
    started = threading.Event()
    other_logged = threading.Event()

    def other() -> None:
        started.wait(10)
        log.info("the engine's own line")
        other_logged.set()

    thread = threading.Thread(target=other)
    thread.start()
    with guest.guest():
        log.info("Initializing MoRIIO worker probe")
        started.set()
        assert other_logged.wait(10)
        assert guest.is_guest_thread()
    thread.join()
    log.info("after the probe")
    assert vllm_handler.messages == ["the engine's own line", "after the probe"]
    assert not any(isinstance(f, type(guest._FILTER)) for f in vllm_handler.filters)  # taken off again


def test_a_thread_the_probe_names_is_quiet_until_the_probe_ends(vllm_handler: _Recorder) -> None:
    log = logging.getLogger("vllm.distributed.guest_test")
    go, logged = threading.Event(), threading.Event()

    def listener() -> None:
        go.wait(10)
        log.info("Node starting to listen notify from path")
        logged.set()

    thread = threading.Thread(target=listener)
    with guest.guest():
        thread.start()
        guest.quiet_thread(thread)
        go.set()
        assert logged.wait(10)
    thread.join()
    assert vllm_handler.messages == []
    guest.quiet_thread(thread)  # outside a probe: nothing happens
    assert not guest.is_guest_thread()


def test_the_ladder_runs_every_probe_as_a_guest(
    monkeypatch: pytest.MonkeyPatch, vllm_handler: _Recorder
) -> None:
    monkeypatch.delenv("GUEST_PROBE_LEAK", raising=False)

    class Leaky:
        def run_probe(self) -> ProbeReport:
            os.environ["GUEST_PROBE_LEAK"] = "1"
            logging.getLogger("vllm.config").info(
                "Chunked prefill is enabled with max_num_batched_tokens=2048"
            )
            threading.excepthook = lambda args: None
            return ProbeReport(())

    hook = threading.excepthook
    run_probe(Leaky())  # type: ignore[arg-type]
    assert "GUEST_PROBE_LEAK" not in os.environ
    assert threading.excepthook is hook
    assert vllm_handler.messages == []


def test_a_logger_the_probe_created_and_switched_off_is_switched_on_again() -> None:
    name = "guest_test_created_during_probe"
    assert name not in logging.Logger.manager.loggerDict
    with guest.guest():
        logging.getLogger(name).disabled = True  # as MoRIIO's worker does to "aiter"
    assert logging.getLogger(name).disabled is False


def test_what_a_module_logs_while_the_probe_first_imports_it_passes(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, vllm_handler: _Recorder
) -> None:
    (tmp_path / "vllm_guest_import_demo.py").write_text(
        "import logging\nlogging.getLogger('vllm.guest_import_demo').info('imported: its own line')\n"
        "def work():\n    logging.getLogger('vllm.guest_import_demo').info('the probe working')\n",
        encoding="utf-8",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    # The logger name is the module's, as vLLM's init_logger(__name__) makes it.
    monkeypatch.delitem(sys.modules, "vllm.guest_import_demo", raising=False)
    with guest.guest():
        import importlib

        spec = importlib.util.spec_from_file_location(
            "vllm.guest_import_demo", tmp_path / "vllm_guest_import_demo.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["vllm.guest_import_demo"] = module
        spec._initializing = True  # type: ignore[attr-defined]  # (what importlib sets while it runs)
        try:
            spec.loader.exec_module(module)
        finally:
            spec._initializing = False  # type: ignore[attr-defined]
        module.work()
    sys.modules.pop("vllm.guest_import_demo", None)
    assert vllm_handler.messages == ["imported: its own line"]
