"""A prefill instance in miniature: MultiConnector[MoRIIO READ producer, X], for tests and
benchmarks of MultiConnector completion handling (never used at runtime).

Real vLLM code throughout: ``MultiConnector`` (one scheduler-side instance, one per
worker), ``MoRIIOConnector`` with the real ``MoRIIOConnectorScheduler``
(``request_finished``, ``build_connector_meta``, ``update_connector_output``) and the
real ``MoRIIOConnectorWorker`` (``get_transfer_results`` / ``get_finished``), the real
``KVOutputAggregator``, real ``Request`` objects and the real scheduler free loop
``Scheduler._update_from_kv_xfer_finished`` (with ``_free_blocks``), called on a
``Scheduler`` built with ``__new__`` plus the attributes that loop reads. Connector
metadata crosses to the workers through ``pickle``, as over vLLM's shared-memory queue.

Fakes, only where this machine has nothing real: X, a contract-following async saver
(holds a request's blocks until its own save has finished on every worker, reports a
request only after it was handed in ``finished_req_ids``), and the RDMA ACK queue the
decode side's release notifications arrive on.

Engine steps follow vLLM's two ways of stepping:

* async scheduling (the default): step n builds its metadata, then the scheduler
  processes the output of step n-1 while the workers run step n, so the owner sets of
  requests that finish there reach the workers at step n+1 — and an ACK from the decode
  side can land in worker step n already;
* synchronous: step n builds its metadata, runs the workers, processes its own output.

An oracle records, for every free, whether every owner had really completed (every
worker's ACK delivered or MoRIIO's watchdog expired; X's save finished on every
worker), and counts double frees (the real loop asserts ``req_id in self.requests``; a
recording dict lets the run continue and counts them instead of crashing).
"""

from __future__ import annotations

import functools
import pickle
import random
import time
from collections import defaultdict
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from vllm_fix_core.moriio_probe import scheduler_without_requests

MC_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.multi_connector"
MORIIO_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_connector"

M, X = 0, 1  # child indices inside the MultiConnector: [MoRIIO, X]
NEVER = 10**9


@functools.lru_cache(maxsize=1)
def _vllm() -> SimpleNamespace:
    import importlib

    mc = importlib.import_module(MC_MODULE)
    mo = importlib.import_module(MORIIO_MODULE)
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request, RequestStatus

    return SimpleNamespace(
        mc=mc,
        mo=mo,
        KVOutputAggregator=KVOutputAggregator,
        SamplingParams=SamplingParams,
        Scheduler=Scheduler,
        Request=Request,
        RequestStatus=RequestStatus,
    )


# ------------------------------------------------------------------------------ fakes
class AckQueue:
    """Stand-in for the MORI engine's queue of decode-side release ACKs."""

    def __init__(self) -> None:
        self.acks: list[str] = []

    def pop_finished_req_ids(self) -> list[str]:
        acks, self.acks = self.acks, []
        return acks

    def shutdown(self) -> None:
        return None


class XMetadata:
    """X's per-step metadata: the requests whose blocks X saves."""

    def __init__(self, saves: list[str]) -> None:
        self.saves = saves


class XScheduler:
    """Scheduler side of X: holds the blocks of the requests it saves."""

    def __init__(self) -> None:
        self.holds: set[str] = set()  # request_finished returns True
        self.partial: set[str] = set()  # accepts register_finished_partial_tail
        self.new_saves: list[str] = []
        self._connector_metadata: Any = None

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def register_finished_partial_tail(self, request: Any, block_ids: Any, tails: Any) -> bool:
        return request.request_id in self.partial

    def request_finished(self, request: Any, blocks: Any) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        if rid in self.holds or rid in self.partial:
            self.new_saves.append(rid)
        return rid in self.holds, None

    def build_connector_meta(self, scheduler_output: Any) -> XMetadata:
        meta, self.new_saves = XMetadata(self.new_saves), []
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        return None


class XWorker:
    """Worker side of X: reports R once R finished, X saves it, and its save is due."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.saves: set[str] = set()
        self.finished: set[str] = set()
        self.due: dict[str, int] = {}  # rid -> worker step at which the save is done
        self.reported: dict[str, int] = {}
        self.step = 0
        self._connector_metadata: Any = None

    def bind_connector_metadata(self, metadata: XMetadata) -> None:
        self.saves.update(metadata.saves)

    def clear_connector_metadata(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """vLLM 0.24-0.29 worker entry point."""
        return self._done(finished_req_ids) or None, None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        return _vllm().mc.KVConnectorTransferResults(finished_sending=self._done(finished_req_ids))

    def _done(self, finished_req_ids: set[str]) -> set[str]:
        for rid in finished_req_ids:
            if rid in self.saves:
                self.saves.discard(rid)
                self.finished.add(rid)
        done = {rid for rid in self.finished if self.due.get(rid, NEVER) <= self.step}
        self.finished -= done
        for rid in done:
            self.reported[rid] = self.step
        return done


# ------------------------------------------------------------------------------ recording
class FreeRecorder:
    """The scheduler's kv_cache_manager, reduced to `free` (the oracle hooks in here)."""

    def __init__(self, world: World) -> None:
        self.world = world

    def free(self, request: Any) -> None:
        self.world._on_free(request)


class Requests(dict):  # type: ignore[type-arg]
    """Scheduler.requests that survives a double free so it can be counted.

    The real loop asserts ``req_id in self.requests`` before freeing; an id that was
    already freed (or never held) would stop vLLM's engine core with an
    AssertionError. Here the id stays visible as a tombstone and the free is counted.
    """

    def __init__(self) -> None:
        super().__init__()
        self.tombstones: dict[str, Any] = {}

    def __contains__(self, key: object) -> bool:
        return dict.__contains__(self, key) or key in self.tombstones

    def __getitem__(self, key: str) -> Any:
        if dict.__contains__(self, key):
            return dict.__getitem__(self, key)
        return self.tombstones[key]

    def __delitem__(self, key: str) -> None:
        if dict.__contains__(self, key):
            self.tombstones[key] = dict.pop(self, key)


@dataclass
class Figures:
    requests: int = 0
    steps: int = 0
    freed: int = 0
    leaked: int = 0
    double_frees: int = 0
    early_frees: int = 0
    owner_sets: dict[str, int] = field(default_factory=dict)
    watchdog_expiries: int = 0
    aborts: int = 0
    ledger_entries: int = 0
    gate_entries: int = 0
    retired_ids: int = 0

    def line(self) -> str:
        return (
            f"requests={self.requests} steps={self.steps} freed={self.freed} leaked={self.leaked} "
            f"double_frees={self.double_frees} early_frees={self.early_frees} "
            f"owner_sets={self.owner_sets} watchdog_expiries={self.watchdog_expiries} "
            f"aborts={self.aborts} ledger_entries={self.ledger_entries} "
            f"gate_entries={self.gate_entries} retired_ids={self.retired_ids}"
        )


class TimedConnector:
    """What the Scheduler holds as `connector`: the MultiConnector, with the time spent
    in its update_connector_output accumulated (benchmark)."""

    def __init__(self, connector: Any, timings: dict[str, int]) -> None:
        self.connector = connector
        self.timings = timings

    def update_connector_output(self, connector_output: Any) -> None:
        start = time.thread_time_ns()
        self.connector.update_connector_output(connector_output)
        self.timings["update_connector_output"] += time.thread_time_ns() - start

    def __getattr__(self, name: str) -> Any:
        return getattr(self.connector, name)


# ------------------------------------------------------------------------------ the world
class WorkerProc:
    def __init__(self, world: World, index: int) -> None:
        v = world.v
        self.index = index
        self.world = world
        self.acks = AckQueue()
        mw = v.mo.MoRIIOConnectorWorker.__new__(v.mo.MoRIIOConnectorWorker)
        mw.is_producer = True
        mw.mode = v.mo.MoRIIOMode.READ
        mw.moriio_wrapper = self.acks
        mw._pending_unmapped_acks = []
        mw.transfer_id_to_request_id = {}
        mw.world_size = world.num_workers
        mw._consumer_notification_counts = {}
        mw._completed_consumer_notifications = set()
        self.moriio_worker = mw
        moriio = v.mo.MoRIIOConnector.__new__(v.mo.MoRIIOConnector)
        moriio.connector_scheduler = None
        moriio.connector_worker = mw
        moriio.mode = v.mo.MoRIIOMode.READ
        moriio._connector_metadata = None
        self.x = XWorker(index)
        self.mc = world.multi([moriio, self.x])

    def execute(self, blob: bytes, finished_req_ids: set[str], step: int, acks: list[str]) -> Any:
        v = _vllm()
        metadata = pickle.loads(blob)
        self.mc.bind_connector_metadata(metadata)
        # What MoRIIOConnectorWorker.start_load_kv does first with its metadata.
        self.moriio_worker.transfer_id_to_request_id = metadata.metadata[M].transfer_id_to_request_id
        self.acks.acks.extend(acks)
        self.x.step = step
        finished = set(finished_req_ids)
        start = time.thread_time_ns()
        if hasattr(self.mc, "get_transfer_results"):  # vLLM 0.30+
            results = self.mc.get_transfer_results(finished)
            self.world.timings["get_transfer_results"] += time.thread_time_ns() - start
            out = v.mc.KVConnectorOutput(
                finished_sending=results.finished_sending or None,
                finished_recving=results.finished_recving or None,
                failed_recving=results.failed_recving,
            )
        else:  # vLLM 0.24-0.29
            sending, recving = self.mc.get_finished(finished)
            self.world.timings["get_transfer_results"] += time.thread_time_ns() - start
            out = v.mc.KVConnectorOutput(finished_sending=sending, finished_recving=recving)
        self.mc.clear_connector_metadata()
        return SimpleNamespace(kv_connector_output=out)


class World:
    """MultiConnector[MoRIIO READ producer, X] on a prefill instance with N workers."""

    def __init__(self, num_workers: int = 2, async_scheduling: bool = True) -> None:
        self.v = v = _vllm()
        self.num_workers = num_workers
        self.async_scheduling = async_scheduling
        ms = scheduler_without_requests(v.mo)
        ms.is_producer = True
        ms.mode = v.mo.MoRIIOMode.READ
        ms._has_mamba = False
        ms._is_hma_required = False
        ms.blocks_per_sw = [0]
        ms.kv_cache_config = SimpleNamespace(kv_cache_groups=[None], select_transfer_block_ids=lambda b: b)
        ms._deferred_send_deadlines = {}
        ms._pending_sent_acks = {}
        ms._defer_timeout = float(NEVER)  # the test clock expires deadlines explicitly
        ms.engine_id = "prefill-0"
        ms.host_ip = "127.0.0.1"
        ms.handshake_port = 6301
        ms.side_notify_port = 61005
        ms._global_dp_rank = 0
        ms.vllm_config = SimpleNamespace(
            parallel_config=SimpleNamespace(
                data_parallel_size=1, data_parallel_size_local=1, tensor_parallel_size=num_workers
            )
        )
        self.moriio_sched = ms
        moriio = v.mo.MoRIIOConnector.__new__(v.mo.MoRIIOConnector)
        moriio.connector_scheduler = ms
        moriio.connector_worker = None
        moriio.mode = v.mo.MoRIIOMode.READ
        moriio._connector_metadata = None
        self.x = XScheduler()
        self.mc = self.multi([moriio, self.x])

        self.timings: dict[str, int] = defaultdict(int)  # ns spent in the patched entry points
        sched = v.Scheduler.__new__(v.Scheduler)
        sched.connector = TimedConnector(self.mc, self.timings)
        sched.requests = Requests()
        sched.finished_recving_kv_req_ids = set()
        sched.failed_recving_kv_req_ids = set()
        sched._kv_fetch_stages = None
        # vLLM 0.34.0: aborted requests whose KV load is in flight (finished_recving discards)
        sched._aborted_kv_loads = set()
        sched.defer_block_free = False
        sched.kv_cache_manager = FreeRecorder(self)
        self.sched = sched
        self.aggregator = v.KVOutputAggregator(num_workers)
        self.workers = [WorkerProc(self, w) for w in range(num_workers)]

        self.step_no = 0
        self.sched_finished: set[str] = set()
        self.pending_output: list[Any] = []
        self.finish_at: dict[int, list[str]] = defaultdict(list)  # step -> rids finishing there
        self.acks_at: dict[tuple[int, int], list[str]] = defaultdict(list)  # (step, worker) -> tids
        self.expire_at: dict[int, list[str]] = defaultdict(list)
        # oracle
        self.kinds: dict[str, str] = {}
        self.truth_owners: dict[str, set[int]] = {}
        self.finished_at: dict[str, int] = {}
        self.ack_delivered: dict[str, set[int]] = defaultdict(set)
        self.expired: set[str] = set()
        self.free_log: list[tuple[int, str]] = []
        self.freed: set[str] = set()
        self.double_frees: list[str] = []
        self.early_frees: list[tuple[str, str]] = []

    def multi(self, children: list[Any]) -> Any:
        mc = self.v.mc.MultiConnector.__new__(self.v.mc.MultiConnector)
        mc._connectors = list(children)
        mc._requests_to_connector = {}
        mc._extra_async_saves = {}
        mc._all_support_hma = False
        mc._connector_metadata = None
        return mc

    # -- requests --------------------------------------------------------------------
    def add(self, rid: str, kind: str = "pd", x_holds: bool = False, x_partial: bool = False) -> None:
        """kind: "pd" (handed to a decode instance: MoRIIO holds it), "plain" (no
        kv_transfer_params), "abort" (aborted P/D request: MoRIIO does not hold it)."""
        v = self.v
        params = None if kind == "plain" else {"do_remote_decode": True, "transfer_id": f"t-{rid}"}
        extra = {"kv_transfer_params": params} if params else None
        request = v.Request(
            request_id=rid,
            prompt_token_ids=[1, 2, 3, 4],
            sampling_params=v.SamplingParams(max_tokens=1, extra_args=extra),
            pooling_params=None,
        )
        request.status = v.RequestStatus.RUNNING
        dict.__setitem__(self.sched.requests, rid, request)
        if params:
            self.moriio_sched.map_request_id(rid, params["transfer_id"])
        if x_holds:
            self.x.holds.add(rid)
        if x_partial:
            self.x.partial.add(rid)
        self.kinds[rid] = kind
        owners = {M} if kind == "pd" else set()
        if x_holds or x_partial:
            owners.add(X)
        self.truth_owners[rid] = owners

    def finish(self, rid: str, step: int | None = None) -> None:
        """R finishes in the scheduler output processed in `step` (default: the current one).

        With async scheduling the workers of that step already run with metadata built
        before R finished; they learn R's owners one step later."""
        self.finish_at[self.step_no if step is None else step].append(rid)

    def ack(self, rid: str, step: int, workers: list[int] | None = None) -> None:
        """Decode's release ACK for R reaches these workers in worker step `step`."""
        for w in range(self.num_workers) if workers is None else workers:
            self.acks_at[(step, w)].append(f"t-{rid}")

    def x_done(self, rid: str, step: int, workers: list[int] | None = None) -> None:
        """X's save of R is done on these workers at worker step `step` (or when R finished)."""
        for w in range(self.num_workers) if workers is None else workers:
            self.workers[w].x.due[rid] = step

    def expire(self, rid: str, step: int) -> None:
        """MoRIIO's defer_timeout for R runs out before the output processed in `step`."""
        self.expire_at[step].append(rid)

    # -- stepping --------------------------------------------------------------------
    def step(self) -> list[str]:
        """One engine step; returns the request ids freed in it."""
        n = self.step_no
        before = len(self.free_log)
        finished, self.sched_finished = self.sched_finished, set()
        metadata = self.mc.build_connector_meta(SimpleNamespace(finished_req_ids=finished))
        blob = pickle.dumps(metadata)
        if self.async_scheduling:
            if self.pending_output:
                self._process(self.pending_output.pop(0), n)
            self.pending_output.append(self._execute(blob, finished, n))
        else:
            self._process(self._execute(blob, finished, n), n)
        self.step_no += 1
        return [rid for _, rid in self.free_log[before:]]

    def run(self, steps: int) -> list[tuple[int, str]]:
        start = len(self.free_log)
        for _ in range(steps):
            self.step()
        return self.free_log[start:]

    def _execute(self, blob: bytes, finished: set[str], n: int) -> Any:
        outputs = []
        for w, worker in enumerate(self.workers):
            tids = self.acks_at.pop((n, w), [])
            for tid in tids:
                self.ack_delivered[tid[2:]].add(w)
            outputs.append(worker.execute(blob, finished, n, tids))
        return self.aggregator.aggregate(outputs)

    def _process(self, output: Any, n: int) -> None:
        v = self.v
        for rid in self.expire_at.pop(n, []):
            entry = self.moriio_sched._deferred_send_deadlines.get(rid)
            if entry is not None:
                self.moriio_sched._deferred_send_deadlines[rid] = (0.0, entry[1])
                self.expired.add(rid)
        # Requests finishing in this output (what Scheduler._free_request does for the connector).
        due = sorted(s for s in self.finish_at if s <= n)
        for rid in [r for s in due for r in self.finish_at.pop(s)]:
            kind = self.kinds[rid]
            request = self.sched.requests[rid]
            request.status = (
                v.RequestStatus.FINISHED_ABORTED
                if kind == "abort"
                else v.RequestStatus.FINISHED_LENGTH_CAPPED
                if kind == "pd"
                else v.RequestStatus.FINISHED_STOPPED
            )
            self.finished_at[rid] = n
            blocks = ([1, 2, 3],)
            partial_delay = False
            if rid in self.x.partial:
                partial_delay = self.mc.register_finished_partial_tail(request, blocks, [(0, 0, 1)])
            delay, _params = self.mc.request_finished_all_groups(request, blocks)
            self.sched_finished.add(rid)
            if not (delay or partial_delay):
                self.sched._free_blocks(request)
        self.sched._update_from_kv_xfer_finished(output.kv_connector_output)

    # -- oracle ----------------------------------------------------------------------
    def owner_complete(self, rid: str, owner: int) -> bool:
        if owner == M:
            return rid in self.expired or len(self.ack_delivered.get(rid, ())) == self.num_workers
        return all(rid in w.x.reported for w in self.workers)

    def _on_free(self, request: Any) -> None:
        rid = request.request_id
        self.free_log.append((self.step_no, rid))
        if rid in self.freed or rid not in self.truth_owners:
            self.double_frees.append(rid)
            return
        self.freed.add(rid)
        pending = [o for o in self.truth_owners[rid] if not self.owner_complete(rid, o)]
        if pending:
            self.early_frees.append((rid, "+".join("MoRIIO" if o == M else "X" for o in pending)))

    def leaked(self) -> list[str]:
        return [rid for rid in self.finished_at if rid not in self.freed]

    def figures(self, ledger_attr: str = "", gate_attr: str = "") -> Figures:
        """The run's figures; `ledger_attr` / `gate_attr` name the instance attributes in which
        a fix keeps its scheduler-side and worker-side bookkeeping (objects with `size()`)."""
        ledger = self.mc.__dict__.get(ledger_attr) if ledger_attr else None
        gates = [w.mc.__dict__.get(gate_attr) for w in self.workers] if gate_attr else []
        sets: dict[str, int] = defaultdict(int)
        for owners in self.truth_owners.values():
            sets["{" + ",".join("MoRIIO" if o == M else "X" for o in sorted(owners)) + "}"] += 1
        return Figures(
            requests=len(self.truth_owners),
            steps=self.step_no,
            freed=len(self.freed),
            leaked=len(self.leaked()),
            double_frees=len(self.double_frees),
            early_frees=len(self.early_frees),
            owner_sets=dict(sorted(sets.items())),
            watchdog_expiries=len(self.expired),
            aborts=sum(1 for k in self.kinds.values() if k == "abort"),
            ledger_entries=ledger.size() if ledger is not None else 0,
            gate_entries=sum(g.size() for g in gates if g is not None),
            retired_ids=max((len(g.retired) for g in gates if g is not None), default=0),
        )


def soak(requests: int, seed: int = 0, num_workers: int = 2, async_scheduling: bool = True) -> World:
    """Random owner sets, completion order and timing, watchdog expiries and aborts."""
    rng = random.Random(seed)
    world = World(num_workers=num_workers, async_scheduling=async_scheduling)
    live: dict[str, int] = {}  # rid -> step it finishes
    made = 0
    while made < requests or live:
        n = world.step_no
        if made < requests:
            for _ in range(rng.randint(0, 6)):
                if made >= requests:
                    break
                rid = f"r{made}"
                made += 1
                kind = rng.choices(["pd", "plain", "abort"], weights=[6, 2, 2])[0]
                x_partial = rng.random() < 0.08
                x_holds = not x_partial and rng.random() < 0.5
                world.add(rid, kind, x_holds=x_holds, x_partial=x_partial)
                live[rid] = n + rng.randint(0, 4)
        for rid, at in list(live.items()):
            if at > n:
                continue
            del live[rid]
            world.finish(rid, n)
            _plan(world, rng, rid, n)
        world.step()
    # Drain: everything planned lands; lost ACKs end in MoRIIO's watchdog.
    for _ in range(40):
        world.step()
    for rid in list(world.moriio_sched._deferred_send_deadlines):
        world.expire(rid, world.step_no + 1)
    for _ in range(10):
        world.step()
    return world


def _plan(world: World, rng: random.Random, rid: str, n: int) -> None:
    # The request finishes in the output processed at step n (async: seen by workers at n+1).
    owners = world.truth_owners[rid]
    if M in owners:
        if rng.random() < 0.1:  # ACK lost: only MoRIIO's watchdog ends MoRIIO's part
            world.expire(rid, n + rng.randint(2, 12))
        else:
            for w in range(world.num_workers):
                world.ack(rid, n + rng.randint(0, 5), [w])
            if rng.random() < 0.05:  # watchdog races the ACKs (X may be slower still)
                world.expire(rid, n + rng.randint(1, 8))
    if X in owners:
        for w in range(world.num_workers):
            world.x_done(rid, n + rng.randint(0, 8), [w])


# ------------------------------------------------------------------------------ a configurable X
@functools.lru_cache(maxsize=1)
def async_saver_connector_class() -> type:
    """X as a real connector class for vLLM's connector factory (``kv_connector_module_path``
    = this module, ``kv_connector`` = "AsyncSaverConnector"): the scheduler side holds the
    blocks of every finished request whose id starts with "x" until the workers report its
    save done. Only the scheduler-side methods a Scheduler calls do anything."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

    class AsyncSaver(KVConnectorBase_V1):  # type: ignore[misc]
        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
            self._connector_metadata = None
            self._role = role

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            return None

        def wait_for_layer_load(self, layer_name: str) -> None:
            return None

        def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
            return None

        def wait_for_save(self) -> None:
            return None

        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
            return 0, False

        def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
            return None

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            return KVConnectorMetadata()

        def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
            return request.request_id.startswith("x"), None

    AsyncSaver.__name__ = AsyncSaver.__qualname__ = "AsyncSaverConnector"
    return AsyncSaver


def __getattr__(name: str) -> Any:  # the factory looks the class up by name, lazily
    if name == "AsyncSaverConnector":
        return async_saver_connector_class()
    raise AttributeError(name)
