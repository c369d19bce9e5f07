"""One worker-like vLLM process for integration/test_guest.py, and the comparison the test makes.

Run as a script (``python _guest_process.py OUT [--leaks]``), it is a vLLM process with every
fix's plugin loaded: it traces every bind (``socket.socket.bind`` and pyzmq's ``Socket.bind``,
each attempt, before anything is imported), captures vLLM's log at INFO, configures logging as
vLLM's processes do, seeds the random generators, runs vLLM's own ``load_general_plugins()`` and
imports every fix's trigger module, the way vLLM would. Then it writes a snapshot of what a probe
could leave behind (:func:`snapshot`) to OUT as JSON, with what each fix's decision changed in the
process (the same snapshot, taken just before and after each decision; the decision's id tags
every bind and log record made while it runs) so that a difference can be traced to its fix.

With ``--leaks`` it then puts back, one at a time, each kind of leak in :data:`LEAKS` through a
probe-like callable run by ``vllm_fix_core.ladder.run_probe`` (so inside the core's guest
context), and writes the comparison of the snapshots before and after each: the negative controls.

Imported (by the test), it only defines :func:`compare`, :data:`LEAKS` and the port helpers.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

# What a tensor-parallel (TP=4) CPU worker's environment holds before vLLM's platform hook runs
# (which would rewrite it: LOCAL_WORLD_SIZE to 1, the multiprocessing method to spawn, ...).
WORKER_ENV = {
    "LOCAL_WORLD_SIZE": "4",
    "WORLD_SIZE": "4",
    "RANK": "0",
    "LOCAL_RANK": "0",
    "VLLM_WORKER_MULTIPROC_METHOD": "fork",
    "MASTER_ADDR": "127.0.0.1",
}
# Set by the test in the baseline process only; both processes get everything else the same.
SWITCH = "VLLM_FIXES_DISABLE"
NUMBERS = re.compile(r"0x[0-9a-fA-F]+|\d+")
END_OF_RUN = "=== guest process: snapshot taken ==="
DECISION = re.compile(r"^vllm-fix ([a-z0-9-]+): ")
# The globals probes are known to touch, described in every light snapshot (module, name).
NAMED_GLOBALS = (
    ("vllm.distributed.parallel_state", "_TP"),
    ("vllm.distributed.parallel_state", "_WORLD"),
    ("vllm.distributed.parallel_state", "_PP"),
    ("*moriio_connector", "IOEngine"),
    ("*moriio_connector", "MoRIIO_enabled"),
    ("*moriio_common", "_role"),
    ("*moriio_engine", "BackendType"),
)


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for the ports it picks (bind to port 0)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_configured_port() -> int:
    """A free port below the kernel's ephemeral range, as an operator would pick for VLLM_PORT."""
    low, _ = ephemeral_range()
    for port in range(min(low, 30000) - 1, 10000, -7):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


# --------------------------------------------------------------------------- the comparison
def _norm(text: str) -> str:
    return NUMBERS.sub("N", text)


def _offending_binds(snap: dict[str, Any], vllm_port: int, ephemeral: tuple[int, int]) -> list[str]:
    low, high = ephemeral
    found = []
    for kind, host, port, tag in snap["binds"]:
        if port is None or port == 0:
            continue
        why = "VLLM_PORT" if port == vllm_port else "" if low <= port <= high else "a non-ephemeral port"
        if why:
            found.append(f"{kind} bind of {why} ({host}:{port}) during {tag or 'no decision'}")
    return found


def _log_lines(snap: dict[str, Any], drop_decisions: bool) -> collections.Counter[str]:
    """vLLM's log lines at INFO and above, numbers normalised; each fix's one decision line taken
    out where `drop_decisions` (a second line of one fix stays in)."""
    lines: collections.Counter[str] = collections.Counter()
    seen: set[str] = set()
    for name, level, message, _thread, tag in snap["log"]:
        match = DECISION.match(message)
        if drop_decisions and match and name == f"vllm.fixes.{match.group(1)}" and name not in seen:
            seen.add(name)
            continue
        lines[f"{level} {name}: {_norm(message)} [during {tag or 'no decision'}]"] += 1
    return lines


def _untagged(lines: collections.Counter[str]) -> collections.Counter[str]:
    out: collections.Counter[str] = collections.Counter()
    for line, n in lines.items():
        out[line.rsplit(" [during ", 1)[0]] += n
    return out


def _dict_diff(category: str, a: dict[str, Any], b: dict[str, Any], default: Any = None) -> list[str]:
    out = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key, default), b.get(key, default)
        if va != vb:
            out.append(f"{category}: {key}: fixes {va!r}, baseline {vb!r}")
    return out


def _counter_diff(category: str, a: collections.Counter[str], b: collections.Counter[str]) -> list[str]:
    out = [f"{category}: only with the fixes (x{n}): {k}" for k, n in sorted((a - b).items())]
    out += [f"{category}: only in the baseline (x{n}): {k}" for k, n in sorted((b - a).items())]
    return out


# A logger nobody configured: what a logger that exists in one process only is compared with.
_DEFAULT_LOGGER = [logging.NOTSET, False, True, 0]


def compare(
    fixes: dict[str, Any],
    baseline: dict[str, Any],
    *,
    vllm_port: int,
    ephemeral: tuple[int, int],
    decisions_allowed: bool = True,
) -> list[str]:
    """Every difference between the snapshot of the process with the fixes and the baseline's,
    one line each (empty: the fixes were guests). Binds are judged in the fixes' process alone
    (VLLM_PORT, or a port outside the kernel's ephemeral range, that the baseline did not bind);
    log lines apart from each fix's one decision line."""
    diffs = _dict_diff("environ", fixes["environ"], baseline["environ"])
    diffs += _dict_diff("logger", fixes["loggers"], baseline["loggers"], _DEFAULT_LOGGER)
    diffs += _dict_diff("hook", fixes["hooks"], baseline["hooks"])
    diffs += _dict_diff("torch", fixes["torch"], baseline["torch"])
    diffs += _dict_diff("rng", fixes["rng"], baseline["rng"])
    diffs += _dict_diff("signal", fixes["signals"], baseline["signals"])
    for module in sorted(set(fixes["globals"]) & set(baseline["globals"])):
        mine, theirs = fixes["globals"][module], baseline["globals"][module]
        # A submodule imported in one process only (the import system sets it on its package):
        # an import, not a global a probe changed; what the import itself changed shows elsewhere.
        submodules = {
            name
            for name in set(mine) ^ set(theirs)
            if (mine.get(name) or theirs.get(name)) == f"module {module}.{name}"
        }
        diffs += _dict_diff(
            f"global {module}",
            {k: v for k, v in mine.items() if k not in submodules},
            {k: v for k, v in theirs.items() if k not in submodules},
            "<absent>",
        )
    diffs += _counter_diff(
        "thread", collections.Counter(fixes["threads"]), collections.Counter(baseline["threads"])
    )
    if fixes["native_threads"] != baseline["native_threads"]:
        diffs.append(
            f"native threads: fixes {fixes['native_threads']}, baseline {baseline['native_threads']}"
        )
    diffs += _counter_diff("fd", collections.Counter(fixes["fds"]), collections.Counter(baseline["fds"]))
    mine = _log_lines(fixes, decisions_allowed)
    theirs = _log_lines(baseline, decisions_allowed)
    # The lines are compared; which decision a line was logged during is kept for the report.
    extra = _untagged(mine) - _untagged(theirs)
    diffs += [
        f"log: only with the fixes (x{n}): {line}"
        for line, n in sorted(mine.items())
        if _untagged(collections.Counter([line])) & extra
    ]
    diffs += [
        f"log: only in the baseline (x{n}): {k}"
        for k, n in sorted((_untagged(theirs) - _untagged(mine)).items())
    ]
    base_binds = collections.Counter(_offending_binds(baseline, vllm_port, ephemeral))
    for line, n in (collections.Counter(_offending_binds(fixes, vllm_port, ephemeral)) - base_binds).items():
        diffs.append(f"bind: {line}" + (f" (x{n})" if n > 1 else ""))
    return diffs


def output_lines(text: str) -> collections.Counter[str]:
    """What a process printed (vLLM's log handler, warnings, prints) up to its snapshot, numbers
    normalised, each fix's decision line left out."""
    lines: collections.Counter[str] = collections.Counter()
    for line in text.split(END_OF_RUN, 1)[0].splitlines():
        if line.strip() and not re.search(r"\bvllm-fix [a-z0-9-]+: ", line):
            lines[_norm(line.strip())] += 1
    return lines


def compare_output(fixes: str, baseline: str) -> list[str]:
    """The lines one process printed and the other did not (stdout and stderr each)."""
    return _counter_diff("output", output_lines(fixes), output_lines(baseline))


# --------------------------------------------------------------------------- the child process
# Everything below runs in the child only (main()).
BINDS: list[list[Any]] = []
RECORDS: list[list[Any]] = []
IMPORTED: dict[str, list[str]] = {}  # the vLLM modules each decision imported first
CURRENT: list[str] = []  # the fix whose decision is running (a stack: decisions may nest)


def _tag() -> str:
    return CURRENT[-1] if CURRENT else ""


def _address(address: Any) -> tuple[str, int | None]:
    if isinstance(address, tuple) and len(address) >= 2:
        return str(address[0]), int(address[1])
    if isinstance(address, (str, bytes)):
        text = address.decode() if isinstance(address, bytes) else address
        match = re.match(r"^tcp://(.*):(\d+|\*)$", text)
        if match:
            port = match.group(2)
            return match.group(1), None if port == "*" else int(port)
        return text, None
    return repr(address), None


def _trace_binds() -> None:
    """Record every bind attempt: the standard socket's, and pyzmq's (libzmq binds natively)."""
    original = socket.socket.bind

    def bind(self: socket.socket, address: Any) -> None:
        BINDS.append(["socket", *_address(address), _tag()])
        return original(self, address)

    socket.socket.bind = bind  # type: ignore[method-assign]
    try:
        import zmq
    except ImportError:
        return
    zmq_bind = zmq.Socket.bind

    def zbind(self: Any, addr: Any) -> Any:
        BINDS.append(["zmq", *_address(addr), _tag()])
        return zmq_bind(self, addr)

    zmq.Socket.bind = zbind  # type: ignore[method-assign]


class _Capture(logging.Handler):
    """vLLM's log at INFO and above, as a handler of vLLM's logger (and the root) sees it: the
    core's guest filter is added to it as to vLLM's own handler while a probe runs."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.seen: dict[int, logging.LogRecord] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if id(record) in self.seen:  # one record reaching both loggers' handlers
            return
        self.seen[id(record)] = record
        try:
            message = record.getMessage()
        except Exception as exc:  # a bad format string is a line too
            message = f"<unformattable: {exc}>"
        RECORDS.append([record.name, record.levelname, message, _norm(record.threadName or ""), _tag()])


def describe(value: Any) -> str:
    """A value as two processes can compare it: identity for modules, classes and functions,
    the value for scalars, the type (and size) for everything else."""
    if value is None or isinstance(value, (bool, int, float, complex)):
        return repr(value)
    if isinstance(value, (str, bytes)):
        return _norm(repr(value)[:200])
    if isinstance(value, types.ModuleType):
        return f"module {value.__name__}"
    if isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType, types.MethodType)):
        try:
            kind = "class" if isinstance(value, type) else "callable"
            return f"{kind} {value.__module__}.{value.__qualname__}"
        except Exception:
            pass
    kind = type(value)
    text = f"{kind.__module__}.{kind.__qualname__}"
    if isinstance(value, (dict, list, set, frozenset, tuple, collections.deque)):
        text += f" len={len(value)}"
    return text


def _module(pattern: str) -> types.ModuleType | None:
    if not pattern.startswith("*"):
        return sys.modules.get(pattern)
    for name, module in list(sys.modules.items()):
        if name.startswith("vllm.") and name.endswith(pattern[1:]) and isinstance(module, types.ModuleType):
            return module
    return None


def _fds() -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the listing's own descriptor, closed meanwhile
        out.append(_norm(re.sub(r"^(socket|pipe):\[\d+\]$", r"\1", target)))
    return sorted(out)


def _rng() -> dict[str, str]:
    import random

    import numpy as np
    import torch

    def digest(data: Any) -> str:
        return hashlib.sha256(repr(data).encode() if not isinstance(data, bytes) else data).hexdigest()[:16]

    return {
        "random": digest(random.getstate()),
        "numpy": digest(np.random.get_state()[1].tobytes()),
        "torch": digest(torch.random.get_rng_state().numpy().tobytes()),
    }


def _torch() -> dict[str, Any]:
    import torch

    return {
        "num_threads": torch.get_num_threads(),
        "num_interop_threads": torch.get_num_interop_threads(),
        "default_dtype": str(torch.get_default_dtype()),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "grad_enabled": torch.is_grad_enabled(),
        "matmul_precision": torch.get_float32_matmul_precision(),
        "default_device": str(torch.empty(0).device),
    }


def _globals_of(module: types.ModuleType) -> dict[str, str]:
    try:
        items = list(vars(module).items())
    except TypeError:
        return {}
    return {name: describe(value) for name, value in items}


def snapshot(*, full: bool) -> dict[str, Any]:
    """What a probe could leave behind in this process. `full` adds every global of every vLLM
    module (the light form describes the globals probes are known to touch)."""
    loggers = {
        name: [lg.level, lg.disabled, lg.propagate, len(lg.handlers)]
        for name, lg in list(logging.Logger.manager.loggerDict.items())
        if isinstance(lg, logging.Logger)
    }
    root = logging.getLogger()
    loggers["<root>"] = [root.level, root.disabled, root.propagate, len(root.handlers)]
    loggers["<logging.disable>"] = [logging.root.manager.disable, False, True, 0]
    named: dict[str, dict[str, str]] = {}
    for pattern, name in NAMED_GLOBALS:
        module = _module(pattern)
        if module is not None:
            named.setdefault(module.__name__, {})[name] = describe(vars(module).get(name, "<absent>"))
    if full:
        named = {
            name: _globals_of(module)
            for name, module in list(sys.modules.items())
            if (name == "vllm" or name.startswith("vllm.")) and isinstance(module, types.ModuleType)
        }
    return {
        "environ": {k: v for k, v in os.environ.items() if k != SWITCH},
        "loggers": loggers,
        "hooks": {
            "threading.excepthook": describe(threading.excepthook),
            "sys.excepthook": describe(sys.excepthook),
            "sys.unraisablehook": describe(sys.unraisablehook),
        },
        "globals": named,
        "threads": sorted(f"{_norm(t.name)} daemon={t.daemon}" for t in threading.enumerate()),
        "native_threads": len(os.listdir("/proc/self/task")),
        "fds": _fds(),
        "torch": _torch(),
        "rng": _rng(),
        "signals": {
            signal.Signals(n).name: describe(signal.getsignal(n))
            for n in sorted(signal.valid_signals())
            if n in set(signal.Signals) and n not in (signal.SIGKILL, signal.SIGSTOP)
        },
        "binds": [list(b) for b in BINDS],
        "log": [list(r) for r in RECORDS],
    }


def _settle(*, collect: bool = True) -> None:
    """Let threads a decision started finish (a listener closing), and collect garbage (a socket
    only a reference cycle holds is closed then)."""
    import gc

    deadline = time.monotonic() + 3.0
    counts: tuple[int, ...] = ()
    while time.monotonic() < deadline:
        # Python threads, native ones (a ZeroMQ context's I/O thread), descriptors: all settled.
        now = (threading.active_count(), len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd")))
        if now == counts:
            break
        counts = now
        time.sleep(0.1)
    if collect:
        gc.collect()


def _watch_decisions(per_fix: dict[str, list[str]], vllm_port: int) -> None:
    """Tag what each decision does with its fix id and record what it changed (test-side: the
    core's evaluate, wrapped in this process for attribution only)."""
    from vllm_fix_core import runtime

    evaluate = getattr(runtime, "evaluate", None)
    if evaluate is None:
        return

    def watched(fix: Any, *args: Any, **kwargs: Any) -> Any:
        before = snapshot(full=False)
        modules = set(sys.modules)
        CURRENT.append(fix.id)
        try:
            return evaluate(fix, *args, **kwargs)
        finally:
            CURRENT.pop()
            after = snapshot(full=False)
            changes = compare(after, before, vllm_port=vllm_port, ephemeral=ephemeral_range())
            if changes:
                per_fix.setdefault(fix.id, []).extend(changes)
            imported = sorted(n for n in set(sys.modules) - modules if n.startswith("vllm."))
            if imported:
                IMPORTED.setdefault(fix.id, []).extend(imported)

    runtime.evaluate = watched


# --------------------------------------------------------------------------- negative controls
@contextmanager
def _later(action: Callable[[], None]) -> Iterator[Callable[[], None]]:
    """A thread the probe starts that does `action` once the probe has returned (after the guest
    context ends): the yielded callable releases it and waits for it."""
    go = threading.Event()

    def run() -> None:
        go.wait(30)
        action()

    thread = threading.Thread(target=run, name="probe-helper", daemon=True)

    def release() -> None:
        go.set()
        thread.join(30)

    yield thread.start
    release()


_KEEP: list[Any] = []  # what a leak keeps alive


def _leak_env() -> None:
    os.environ["VLLM_GUEST_TEST_LEAK"] = "set by a probe's thread"


def _leak_logger() -> None:
    logging.getLogger("aiter").disabled = True


def _leak_hook() -> None:
    threading.excepthook = lambda args: None


def _leak_info() -> None:
    logging.getLogger("vllm.distributed.kv_transfer").info(
        "Node starting to listen notify from path = tcp://*:%d", 5555
    )


def _leak_bind_vllm_port() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with suppress(OSError):  # the attempt is what counts
            s.bind(("127.0.0.1", int(os.environ["VLLM_PORT"])))


def _leak_bind_configured_port() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s, suppress(OSError):
        s.bind(("127.0.0.1", ephemeral_range()[0] - 1))


def _leak_global() -> None:
    from vllm.distributed import parallel_state

    parallel_state._TP = types.SimpleNamespace(rank=0, local_rank=0, rank_in_group=0, world_size=1)


def _leak_moriio_global() -> None:
    module = _module("*moriio_connector")
    assert module is not None, "no MoRIIO connector module imported"
    module.MoRIIO_enabled = True


def _leak_thread() -> None:
    stop = threading.Event()
    _KEEP.append(stop)
    threading.Thread(target=stop.wait, name="probe-listener", daemon=True).start()


def _leak_fd() -> None:
    _KEEP.append(socket.socket(socket.AF_INET, socket.SOCK_STREAM))


def _leak_rng() -> None:
    import torch

    torch.rand(1)


def _leak_torch() -> None:
    import torch

    torch.set_num_threads(max(1, torch.get_num_threads() + 1))


def _leak_signal() -> None:
    signal.signal(signal.SIGUSR1, lambda *a: None)


# kind: (what the probe leaks, whether it does it from a thread it started once the probe has
# returned, the category of difference it must make, a text that difference names)
LEAKS: dict[str, tuple[Callable[[], None], bool, str, str]] = {
    "env-set-from-another-thread": (_leak_env, True, "environ", "VLLM_GUEST_TEST_LEAK"),
    "logger-disabled-from-another-thread": (_leak_logger, True, "logger", "aiter"),
    "excepthook-replaced-from-another-thread": (_leak_hook, True, "hook", "threading.excepthook"),
    "info-line-from-a-thread-after-the-probe": (_leak_info, True, "log", "Node starting to listen"),
    "bind-of-vllm-port": (_leak_bind_vllm_port, False, "bind", "VLLM_PORT"),
    "bind-of-a-configured-port": (_leak_bind_configured_port, False, "bind", "non-ephemeral"),
    "parallel-state-global-left-swapped": (_leak_global, False, "global", "_TP"),
    "moriio-global-left-swapped": (_leak_moriio_global, False, "global", "MoRIIO_enabled"),
    "thread-left-running": (_leak_thread, False, "thread", "probe-listener"),
    "fd-left-open": (_leak_fd, False, "fd", "socket"),
    "rng-state-consumed": (_leak_rng, False, "rng", "torch"),
    "torch-threads-changed": (_leak_torch, False, "torch", "num_threads"),
    "signal-handler-replaced": (_leak_signal, False, "signal", "SIGUSR1"),
}


class _LeakyProbe:
    """Stands where a fix stands for run_probe: its probe does one kind of leak."""

    id = "guest-test-leak"

    def __init__(self, action: Callable[[], None], later: bool) -> None:
        self.action = action
        self.later = later
        self.start: Callable[[], None] | None = None

    def run_probe(self) -> None:
        if self.later:
            assert self.start is not None
            self.start()
        else:
            self.action()


def _negative_controls(vllm_port: int) -> dict[str, list[str]]:
    from vllm_fix_core import ladder

    results: dict[str, list[str]] = {}
    before = snapshot(full=True)
    for kind, (action, later, _, _) in LEAKS.items():
        probe = _LeakyProbe(action, later)
        CURRENT.append(f"leak {kind}")
        try:
            if later:
                with _later(action) as start:
                    probe.start = start
                    ladder.run_probe(probe)  # type: ignore[arg-type]
            else:
                ladder.run_probe(probe)  # type: ignore[arg-type]
        finally:
            CURRENT.pop()
        _settle(collect=False)  # what each leak keeps is referenced: no cycle to collect
        after = snapshot(full=True)
        results[kind] = compare(after, before, vllm_port=vllm_port, ephemeral=ephemeral_range())
        before = after
    return results


# --------------------------------------------------------------------------- main
def main() -> int:
    out_path = sys.argv[1]
    leaks = "--leaks" in sys.argv[2:]
    _trace_binds()
    started = time.process_time()
    began_at = time.monotonic()
    capture = _Capture()
    logging.getLogger().addHandler(capture)

    import vllm.logger

    logging.getLogger("vllm").addHandler(capture)
    if not logging.getLogger("vllm").handlers[:-1]:
        # Releases that configure vLLM's logging when a process starts, not on import: as a
        # worker process does.
        try:
            from vllm.config.logging import LoggingConfig

            vllm.logger.configure_logging(LoggingConfig())  # type: ignore[attr-defined]
        except (ImportError, AttributeError):
            vllm.logger._configure_vllm_root_logger()
        if capture not in logging.getLogger("vllm").handlers:
            logging.getLogger("vllm").addHandler(capture)

    import random

    import numpy as np
    import torch

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)

    from vllm.plugins import load_general_plugins

    from vllm_fix_core.registry import installed_fixes

    vllm_port = int(os.environ["VLLM_PORT"])
    per_fix: dict[str, list[str]] = {}
    _watch_decisions(per_fix, vllm_port)
    load_general_plugins()
    import importlib

    for item in installed_fixes():
        importlib.import_module(item.fix.trigger_module)
    _settle()
    final = snapshot(full=True)
    from vllm_fix_core import runtime

    result: dict[str, Any] = {
        "snapshot": final,
        "per_fix": per_fix,
        "decisions": {fid: d.answer.value for fid, d in runtime.decisions().items()},
        "imported_by": IMPORTED,
        "wall_s": time.monotonic() - began_at,
        "modules": sorted(n for n in sys.modules if n == "vllm" or n.startswith("vllm.")),
        "cpu_s": time.process_time() - started,
    }
    # What the process printed up to here is compared too; the negative controls print more.
    for stream in (sys.stdout, sys.stderr):
        print(END_OF_RUN, file=stream, flush=True)
    if leaks:
        began = time.monotonic()
        result["leaks"] = _negative_controls(vllm_port)
        result["leaks_wall_s"] = time.monotonic() - began
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
