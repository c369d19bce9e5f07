"""Apply: replace MoRIIOConnectorWorker._pop_done_transfers, for exactly known shapes.

Why a replacement and not a wrapper (spec §3.5): a wrapper would have to poll the
statuses under the wrapper's lock, decide, release the lock and delegate; a status can
turn from pending to failed between the two lock acquisitions, and vLLM's body would
then release the producer's blocks and drop the tracking of a hybrid transfer. So the
body is replaced, with our own implementation of the ownership rule (rule.py), one per
known target shape, selected by exact normalized-AST fingerprint. The shapes differ
only in how a release reaches the producer:

* vllm-0.32.0: one holder per transfer; the callback address carries a single notify
  port and the release is a ``send_notify`` to it;
* vllm-0.33.0: the callback address carries one notify port per holder prefill TP
  rank, and the release goes through the worker's own ``_send_read_release``.
"""

from __future__ import annotations

import ast
import time
from collections.abc import Callable
from typing import Any

from vllm_fix_core import PatchSet, UnknownShape, ast_fingerprint, function_ast, get_logger, original_of
from vllm_fix_core.fingerprint import canonical_fingerprint, canonical_function, dropping
from vllm_fix_read_failure_ownership.rule import Outcome, classify, ownership

FIX_ID = "read-failure-ownership"
TARGET = "_pop_done_transfers"

# Normalized-AST fingerprints (vllm_fix_core.ast_fingerprint) of the known targets.
KNOWN_SHAPES = {
    "e36833d400c2f75a": "vllm-0.32.0",
    "692d6197971f9783": "vllm-0.33.0",
}
# The same shapes up to what a release changes without changing behaviour (renamed locals, log
# lines, unused defaulted keyword-only parameters: vllm_fix_core.fingerprint.canonical_function),
# read on 0.31.0-0.32.0 and 0.33.0-0.34.0.
CANONICAL_SHAPES = {
    "afae3b34f6b694df": "vllm-0.32.0",
    "a4df9c59867dff14": "vllm-0.33.0",
}
# Worker helpers each shape's replacement calls.
_HELPERS = {
    "vllm-0.32.0": ("_record_failed_recv",),
    "vllm-0.33.0": ("_record_failed_recv", "_send_read_release"),
}

logger = get_logger(FIX_ID)

Release = Callable[[Any, str, Any, Any], None]


def _mc() -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector as mc

    return mc


def fails_closed_for_hybrid(func: Any) -> bool:
    """Static "already fixed" marker: a ``raise`` under a test that reads ``_has_mamba``."""
    try:
        node = function_ast(func)
    except (OSError, TypeError):
        return False
    for sub in ast.walk(node):
        if not isinstance(sub, ast.If):
            continue
        reads_mamba = any(isinstance(n, ast.Attribute) and n.attr == "_has_mamba" for n in ast.walk(sub.test))
        if reads_mamba and any(isinstance(n, ast.Raise) for stmt in sub.body for n in ast.walk(stmt)):
            return True
    return False


def recognize() -> str:
    cls = _mc().MoRIIOConnectorWorker
    if TARGET not in cls.__dict__:
        raise UnknownShape(f"MoRIIOConnectorWorker.{TARGET} is not defined on the class")
    # Fingerprint what vLLM shipped, also when a fix of ours is layered on it already.
    method = original_of(cls, TARGET)
    fingerprint = ast_fingerprint(method)
    shape = KNOWN_SHAPES.get(fingerprint) or CANONICAL_SHAPES.get(canonical_fingerprint(method))
    if shape is None:
        hint = (
            "; it already raises for hybrid models on some path, so upstream may carry the fix"
            if fails_closed_for_hybrid(method)
            else ""
        )
        raise UnknownShape(
            f"MoRIIOConnectorWorker.{TARGET} has normalized-AST fingerprint {fingerprint}, "
            f"not one of the known shapes {sorted(KNOWN_SHAPES.values())}{hint}; its body is "
            "only replaced for exactly known shapes"
        )
    missing = [name for name in _HELPERS[shape] if not callable(getattr(cls, name, None))]
    if missing:
        raise UnknownShape(f"{shape} shape without the worker helpers {missing}")
    return shape


# -- how a release reaches the holders, per shape ---------------------------------


def _release_single_port(worker: Any, transfer_id: str, host: str, port: Any) -> None:
    worker.moriio_wrapper.send_notify(
        transfer_id,
        host,
        port,
        message_type="release",
        message_fields={"consumer_tp_size": worker.world_size},
    )


def _release_every_holder(worker: Any, transfer_id: str, host: str, ports: Any) -> None:
    worker._send_read_release(transfer_id, host, ports)


RELEASES: dict[str, Release] = {
    "vllm-0.32.0": _release_single_port,
    "vllm-0.33.0": _release_every_holder,
}


# -- the replacement ------------------------------------------------------------------


def _first_failure(statuses: list[Any]) -> str:
    for status in statuses:
        if status.Failed():
            return f"{status.Message()} (code={status.Code()})"
    return "no status reports a failure"


Verdict = tuple[str, list[Any], Outcome, "float | None"]


def _verdicts(worker: Any, now: float, timeout: float) -> list[Verdict]:
    """Poll every tracked READ once (under the wrapper's lock): the ones that are settled."""
    mc = _mc()
    done_state, failed_state = mc.TransferBatchState.DONE, mc.TransferBatchState.FAILED
    verdicts: list[Verdict] = []
    for req_id, by_layer in list(worker._recving_transfers.items()):
        statuses = [status for layer in by_layer.values() for status in layer]
        state = worker.moriio_wrapper.poll_transfer_batch(statuses)
        start = worker._recving_transfers_start.get(req_id)
        age = None if start is None else now - start
        outcome = classify(
            has_statuses=bool(statuses),
            done=state is done_state,
            failed=state is failed_state,
            age=age,
            timeout=timeout,
        )
        if outcome is not Outcome.PENDING:
            verdicts.append((req_id, statuses, outcome, age))
    return verdicts


def _what(statuses: list[Any], outcome: Outcome, age: float | None, timeout: float) -> str:
    if outcome is Outcome.FAILED:
        return f"READ failed: {_first_failure(statuses)}"
    if outcome is Outcome.TIMED_OUT:
        return f"READ timed out after {age:.1f}s (recv_abort_timeout={timeout:.0f}s)"
    return ""


def _release(worker: Any, release: Release, req_id: str, completed: set[str], must_complete: bool) -> None:
    host, ports, transfer_id = worker._recving_transfers_callback_addr[req_id]
    if must_complete:
        release(worker, transfer_id, host, ports)
        completed.add(transfer_id)
        return
    try:
        release(worker, transfer_id, host, ports)
    except Exception:
        logger.exception("MoRIIO request %s: sending the release failed", req_id)


def _drop(worker: Any, req_id: str) -> None:
    del worker._recving_transfers[req_id]
    worker._recving_transfers_callback_addr.pop(req_id, None)
    worker._recving_transfers_start.pop(req_id, None)
    worker._recving_local_blocks.pop(req_id, None)


def _fail_closed(fatal: list[str]) -> None:
    message = (
        "MoRIIO hybrid READ cannot complete, failing the step: "
        + "; ".join(fatal)
        + ". Nothing was released or reported and the transfers stay tracked, because "
        "RDMA may still write into their blocks; the producer reclaims its blocks "
        "through its own timeout."
    )
    logger.error("%s", message)
    raise _mc().TransferError(message)


def make_pop_done_transfers(release: Release) -> Callable[[Any], set[str]]:
    """Our ``_pop_done_transfers`` for one way of releasing (see RELEASES)."""

    def _pop_done_transfers(self: Any) -> set[str]:
        timeout = self.moriio_config.recv_abort_timeout
        completed: set[str] = set()
        fatal: list[str] = []
        with self.moriio_wrapper.lock:
            # One poll per transfer, all under the lock: the verdict and what we do
            # about it can never disagree (see the module docstring).
            for req_id, statuses, outcome, age in _verdicts(self, time.monotonic(), timeout):
                # Whether the model is hybrid matters only for a READ that failed or
                # timed out; vLLM's own body reads _has_mamba only there too (in
                # _record_failed_recv), so a completed or pending READ needs no more
                # worker state than vLLM's code does.
                hybrid = outcome is not Outcome.DONE and bool(self._has_mamba)
                plan = ownership(outcome, hybrid=hybrid)
                if not plan.acts:
                    continue
                what = _what(statuses, outcome, age, timeout)
                if plan.fail_closed:
                    fatal.append(f"{req_id}: {what}")
                    continue
                if what:
                    logger.error(
                        "MoRIIO request %s: %s; %s",
                        req_id,
                        what,
                        "reporting its blocks for recovery"
                        + (" and releasing the producer's blocks" if plan.release else ""),
                    )
                if plan.report:
                    self._record_failed_recv(req_id)
                if plan.release:
                    _release(self, release, req_id, completed, must_complete=plan.completed)
                if plan.drop:
                    _drop(self, req_id)
        if fatal:
            _fail_closed(fatal)
        return completed

    _pop_done_transfers.__qualname__ = "MoRIIOConnectorWorker._pop_done_transfers"
    _pop_done_transfers.__doc__ = (
        "Poll every tracked READ once and settle it by the ownership rule of "
        "vllm-fix-read-failure-ownership: hybrid failures and timeouts fail closed."
    )
    return _pop_done_transfers


REPLACEMENTS: dict[str, Callable[[Any], set[str]]] = {
    shape: make_pop_done_transfers(release) for shape, release in RELEASES.items()
}


def apply(patch: PatchSet, shape: str) -> None:
    if shape not in REPLACEMENTS:
        raise UnknownShape(f"no replacement for shape {shape!r}")
    cls = _mc().MoRIIOConnectorWorker
    # Parameters a release added and the body never reads are taken and ignored, as vLLM does.
    dropped = canonical_function(original_of(cls, TARGET))[1]
    patch.replace(cls, TARGET, dropping(REPLACEMENTS[shape], dropped))
