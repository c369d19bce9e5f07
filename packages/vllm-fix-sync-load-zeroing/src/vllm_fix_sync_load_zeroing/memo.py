"""Where the probe's coverage facts come from, and when the on-disk memo is refreshed.

Measuring the facts (:mod:`vllm_fix_sync_load_zeroing.facts`) needs ``vllm.v1.worker.utils``
(vLLM's ``KVBlockZeroer``), and a multi-process engine core, where this fix decides, never
imports that module: importing it there costs about 100 ms and runs module code the serving
process would not run (on vLLM 0.32.0 it pulls in ``vllm._aiter_ops``, which sets
``AITER_SITUV2_A4W4`` in ``os.environ`` and disables the ``aiter`` logger). So this fix never
imports it:

* where it is loaded (a worker, a single-process engine, a test), the facts are measured live
  from the loaded objects (a few ms), and the memo is *refreshed* with them: read, and
  rewritten only where it is missing, stale, corrupt or holds other facts; once per process
  and facts (the re-probe of the same decision does not read it again);
* where it is not loaded, the facts are read from the memo where it is valid for this install
  (:mod:`vllm_fix_sync_load_zeroing.memo_key`); otherwise they are taken from the bug's
  specification (``facts.spec_facts``: the source of vLLM's worker utilities read, not
  imported) and written (:mod:`vllm_fix_sync_load_zeroing.memo_file`).

vLLM starts an engine core's workers (which import the module, and decide in ``init_device``)
before the engine core builds its scheduler, where this fix decides; so an engine core normally
finds the facts its workers measured. A test holds the specification's facts to the measured
ones on every release the fix is tested on.

Writing from a process whose vLLM objects are loaded is sound for what the facts are for: they
describe the zeroer that runs, and the zeroer runs in the workers. If something in a worker
changed vLLM's zeroer or layout code in memory (another plugin, a test), the worker's facts are
those of the zeroer that will actually zero, and the engine core reads exactly those. Every
worker start refreshes the memo before its engine core reads it, so a memo never outlives the
configuration that wrote it by more than one process start; a process that sees other facts
rewrites it (one DEBUG line). (Only a dry run in between, ``vllm-fixes status`` say, may read a
memo that a process with changed objects wrote.) This package's tests get a fresh cache root
each, so a test that changes vLLM's objects writes only into its own.

Nothing here ever raises into the probe: a memo that cannot be read, parsed or written costs the
computation (or, where the facts are live anyway, a skipped refresh) and one DEBUG line.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from vllm_fix_core import get_logger
from vllm_fix_sync_load_zeroing import memo_file, memo_key
from vllm_fix_sync_load_zeroing.facts import WORKER_UTILS, CoverageFacts, compute_facts, spec_facts


def _memo_logger() -> logging.Logger:
    # A child of the package's logger, deliberately: the ladder silences the fix's own logger
    # while a probe runs (probe input must not make the fix warn), and this line is about the
    # memo, not about probe input. It propagates to the same handler as the decision line.
    return get_logger(memo_key.FIX_ID).getChild("memo")


# (memo path, stamp + facts) this process has read from or written (or tried to write) to the
# memo: the re-probe of the same decision (and any later probe with the same facts) neither reads
# nor writes it again, nor logs a second DEBUG line about it.
_refreshed: set[tuple[str, str]] = set()
# (memo path, stamp) -> the facts a process without vllm.v1.worker.utils decided with: its
# re-probe (after apply) answers from the same facts, neither reading nor writing the memo again.
_decided: dict[tuple[str, str], CoverageFacts] = {}


def _done(path: Path, stamp: Mapping[str, Any], facts: CoverageFacts) -> tuple[str, str]:
    return str(path), json.dumps([stamp, facts.to_json()], sort_keys=True)


def _remember(path: Path, stamp: Mapping[str, Any], facts: CoverageFacts) -> None:
    with contextlib.suppress(Exception):
        _refreshed.add(_done(path, stamp, facts))


def coverage_facts(spec: Callable[[], Any], *, use_memo: bool | None = None) -> CoverageFacts:
    """The facts for the probe.

    `use_memo` None (the probe): where vllm.v1.worker.utils is loaded, the facts are computed
    live and the memo refreshed with them (refresh_memo); where it is not, the memo is used, and
    on a miss the specification's facts (``spec_facts``, which import nothing vLLM has not
    imported) are used and written. True: the memo is used regardless, a miss computed live;
    False: live, the memo left alone."""
    if use_memo is None:
        if WORKER_UTILS in sys.modules:
            live = compute_facts(spec)  # may raise: the probe then answers "cannot check"
            refresh_memo(live)
            return live
        return _once(lambda: spec_facts(), "taken from the specification")
    if not use_memo:
        return compute_facts(spec)
    return _from_memo(lambda: compute_facts(spec), "computed live")


def _once(compute: Callable[[], CoverageFacts], how: str) -> CoverageFacts:
    """_from_memo, once per process and memo key: later calls get the same facts."""
    try:
        key = str(memo_key.memo_path()), json.dumps(memo_key.current_stamp(), sort_keys=True)
    except Exception:
        return _from_memo(compute, how)  # it notes the missing key
    if key not in _decided:
        _decided[key] = _from_memo(compute, how)
    return _decided[key]


def _from_memo(compute: Callable[[], CoverageFacts], how: str) -> CoverageFacts:
    """The memo's facts where it is valid, else compute()'s (written)."""
    problems: list[str] = []
    key: tuple[Path, dict[str, Any]] | None = None
    try:
        key = memo_key.memo_path(), memo_key.current_stamp()
    except Exception as exc:
        problems.append(f"no memo key ({exc!r})")
    else:
        held = memo_file.try_read(*key, problems)
        if held is not None:
            _remember(*key, held)
            return held
    try:
        facts = compute()  # may raise: the probe then answers "cannot check"
        if key is not None:
            _remember(*key, facts)  # a later refresh_memo has nothing to add
            memo_file.try_write(*key, facts, problems)
    finally:
        if problems:
            _memo_logger().debug("coverage memo: %s; %s", "; ".join(problems), how)
    return facts


def refresh_memo(facts: CoverageFacts) -> bool:
    """Make the memo hold `facts`, computed live in this process: read it, and write `facts`
    (atomically) only where it is missing, stale, corrupt or holds other facts. Tried once per
    process for the same path, stamp and facts. True iff it wrote. Never raises; a problem
    other than a plain miss or a stale entry is one DEBUG line."""
    try:
        path, stamp = memo_key.memo_path(), memo_key.current_stamp()
        done = _done(path, stamp, facts)
    except Exception as exc:
        _memo_logger().debug("coverage memo: no memo key (%r); not refreshed", exc)
        return False
    if done in _refreshed:
        return False
    problems: list[str] = []
    held = memo_file.try_read(path, stamp, problems)
    wrote = False
    if held != facts:
        if held is not None:
            problems.append(f"{path} holds other facts than computed live here")
        wrote = memo_file.try_write(path, stamp, facts, problems)
    _refreshed.add(done)  # tried: a memo this process cannot write is not retried (nor logged) again
    if problems:
        outcome = "refreshed from the live facts" if wrote else "not refreshed"
        _memo_logger().debug("coverage memo: %s; %s", "; ".join(problems), outcome)
    return wrote
