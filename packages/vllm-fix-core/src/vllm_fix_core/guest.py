"""A probe is a guest in a serving process: how it builds vLLM objects, and what it leaves behind.

Every fix decides inside vLLM's own processes (API server, engine core, workers) by running its
probe there, so a probe follows two rules, both kept here, once for every fix:

**It builds vLLM objects through vLLM's own classes** (:func:`build`). A config a probe needs is
an instance of vLLM's own config class, every field at the default vLLM declares for it, the
fields the probe cares about set, built *without* running ``__post_init__``: vLLM's
``VllmConfig.__post_init__`` runs the platform's ``check_and_update_config``, which writes
``os.environ``, logs the engine's configuration and, on vLLM 0.34's x86 CPU platform without
triton-cpu, raises. A release that reads one more attribute of a config finds it at vLLM's own
default, where a hand-made namespace would raise ``AttributeError``.

**It leaves no trace** (:func:`guest`, which the ladder runs every probe in). After a probe
returns, the process is as it was: ``os.environ`` (exactly), ``threading.excepthook`` and
``sys.excepthook``, and every logger that existed before (level, disabled, propagate, handlers).
While it runs, records that vLLM's code logs on the probing thread (a probe's worker says
"Initializing MoRIIO worker ...") are dropped at the handlers of vLLM's and the root logger, so
vLLM's log at INFO is the same with the fixes on as off, apart from each fix's one decision
line; records of every other thread pass untouched. The restore is a safety net and the guest
test (integration/test_guest.py) holds each probe to it: a probe that changes something while it
runs is a probe to fix, not something to put back.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

T = TypeVar("T")
_UNSET: Any = dataclasses.MISSING


def _default(field: dataclasses.Field[Any]) -> Any:
    """The default vLLM declares for `field` (a dataclass default or factory, or pydantic's
    ``Field(default=...)`` / ``Field(default_factory=...)``); None where it declares none."""
    value = field.default
    if value is not _UNSET:
        # vLLM's configs are pydantic dataclasses: ``x: T = Field(default_factory=T)`` keeps the
        # FieldInfo as the dataclass default.
        factory = getattr(value, "default_factory", None)
        if type(value).__name__ == "FieldInfo":
            if callable(factory):
                return factory()
            default = getattr(value, "default", None)
            return None if type(default).__name__ == "PydanticUndefinedType" else default
        return value
    factory = field.default_factory
    if callable(factory):
        return factory()
    return None


def build(cls: type[T], /, **values: Any) -> T:
    """An instance of vLLM's dataclass `cls`, each field at vLLM's own default or at `values`,
    built without ``__init__`` / ``__post_init__`` (no platform hook, no validation that reads
    the environment or the hub). A name in `values` that is not a field of `cls` is set too
    (an attribute vLLM's ``__post_init__`` would have derived)."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    obj = cls.__new__(cls)
    for field in dataclasses.fields(cls):
        value = values.pop(field.name) if field.name in values else _default(field)
        object.__setattr__(obj, field.name, value)
    for name, value in values.items():
        object.__setattr__(obj, name, value)
    return obj


# --------------------------------------------------------------------------- leaving no trace
# The threads whose records are dropped: each probing thread, and the threads its probe named
# (a listener thread vLLM's code started for the probe's worker), each to the probing thread.
_quiet: dict[int, int] = {}
_quiet_lock = threading.Lock()


# Per probing thread: the modules imported when its probe began. A module a probe imports for the
# first time logs at import what it would log whenever the process imported it (vLLM's "Triton
# not installed ..." line): that record is the process's own and passes.
_modules_before: dict[int, frozenset[str]] = {}


def _importing_now(name: str, owner: int) -> bool:
    before = _modules_before.get(owner)
    if before is None or name in before:
        return False
    spec = getattr(sys.modules.get(name), "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


class _GuestRecords(logging.Filter):
    """Drops the records logged on a probing thread (or one its probe named); others pass, and
    so do the lines a module logs while a probe imports it for the first time."""

    def filter(self, record: logging.LogRecord) -> bool:
        owner = _quiet.get(record.thread) if record.thread is not None else None
        if owner is None or record.name.startswith("vllm.fixes"):  # (the fixes': log.probing)
            return True
        return _importing_now(record.name, owner)


_FILTER = _GuestRecords()


def _handlers() -> list[logging.Handler]:
    found: dict[int, logging.Handler] = {}
    for logger in (logging.getLogger(), logging.getLogger("vllm")):
        for handler in logger.handlers:
            found[id(handler)] = handler
    return list(found.values())


def _logger_states() -> list[tuple[logging.Logger, int, bool, bool, list[logging.Handler]]]:
    loggers = [obj for obj in logging.Logger.manager.loggerDict.values() if isinstance(obj, logging.Logger)]
    loggers.append(logging.getLogger())
    return [(lg, lg.level, lg.disabled, lg.propagate, list(lg.handlers)) for lg in loggers]


def _restore_loggers(saved: list[tuple[logging.Logger, int, bool, bool, list[logging.Handler]]]) -> None:
    for logger, level, disabled, propagate, handlers in saved:
        if logger.level != level:
            logger.setLevel(level)
        logger.disabled = disabled
        logger.propagate = propagate
        if logger.handlers != handlers:
            logger.handlers[:] = handlers
    # A logger the probe's vLLM objects created and switched off (MoRIIO's worker disables the
    # "aiter" logger) is switched on again: off, it would silence whoever creates it next.
    # Its level and handlers are what the import that made it set.
    known = {id(entry[0]) for entry in saved}
    for made in logging.Logger.manager.loggerDict.values():
        if isinstance(made, logging.Logger) and id(made) not in known and made.disabled:
            made.disabled = False


def _restore_environ(saved: dict[str, str]) -> None:
    for name in [name for name in os.environ if name not in saved]:
        del os.environ[name]
    for name, value in saved.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


def quiet_thread(thread: threading.Thread) -> None:
    """Drop the records of `thread` (started by vLLM's code for this probe) until the probe on
    the calling thread ends. Outside a probe, nothing happens."""
    owner = threading.get_ident()
    with _quiet_lock:
        if owner in _quiet and thread.ident is not None:
            _quiet[thread.ident] = _quiet[owner]


@contextmanager
def guest() -> Iterator[None]:
    """Run a probe as a guest: vLLM's records on this thread dropped while it runs; the
    environment, the exception hooks and the loggers that existed put back when it ends."""
    ident = threading.get_ident()
    with _quiet_lock:
        if ident in _quiet:  # nested: the outer probe restores
            nested = True
        else:
            nested = False
            _quiet[ident] = ident
            _modules_before[ident] = frozenset(sys.modules)
            if len({owner for owner in _quiet.values()}) == 1:
                for handler in _handlers():
                    if _FILTER not in handler.filters:
                        handler.addFilter(_FILTER)
    if nested:
        yield
        return
    environ = dict(os.environ)
    hooks = (threading.excepthook, sys.excepthook)
    loggers = _logger_states()
    try:
        yield
    finally:
        _restore_environ(environ)
        if threading.excepthook is not hooks[0]:
            threading.excepthook = hooks[0]
        if sys.excepthook is not hooks[1]:
            sys.excepthook = hooks[1]
        _restore_loggers(loggers)
        with _quiet_lock:
            for name in [name for name, owner in _quiet.items() if owner == ident]:
                del _quiet[name]
            _modules_before.pop(ident, None)
            if not _quiet:
                for handler in _handlers():
                    handler.removeFilter(_FILTER)


def is_guest_thread() -> bool:
    """True on a thread that is running a probe."""
    return threading.get_ident() in _quiet


__all__ = ["build", "guest", "is_guest_thread", "quiet_thread"]
