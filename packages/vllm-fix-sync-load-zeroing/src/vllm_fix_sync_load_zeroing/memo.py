"""A persistent, self-invalidating memo of the layout-coverage facts the probe needs.

Computing them asks vLLM's own ``KVBlockZeroer`` which bytes it zeroes, and importing
``vllm.v1.worker.utils`` for that drags in vLLM's attention, linear and Mamba layers (about
100 ms); a multi-process engine core, where this fix decides, does not otherwise import it. The
facts are a deterministic function of vLLM's and torch's code (plus one environment variable
vLLM's layout resolver reads), so they are kept on disk, for the probe's fixed attention spec:

* whether vLLM has ``KVBlockZeroer``;
* the layouts vLLM's resolver accepts for a hybrid model (``oracle.hybrid_layouts()``);
* per layout, whether a READ rewrites every byte the zeroer zeroes
  (``oracle.zeroing_is_overwritten``, the probe's own measurement, which shares no code with
  the patch), or the repr of what the computation raised (the probe answers "cannot check" for
  it, as it does live).

Only this oracle input is memoized: the probe still calls vLLM's real ``build_connector_meta`` /
``get_sync_load_block_ids`` on every probe case.

Validity works like Python's own bytecode cache: the entry records ``(path, size, mtime_ns)`` of
the file of every ``vllm`` module loaded once the facts were computed (a superset of what the
computation can depend on), vLLM's version and install path, torch's and Python's versions, the
values of the environment variables the computation reads, this package's version and a hash of
the source of the modules that define the facts. A read stats every recorded file; any
difference, or anything unreadable, means "compute live" (and write a new entry).

The memo stands in for the import only: where ``vllm.v1.worker.utils`` is already loaded (a
worker, a single-process engine, a test) the probe's facts are computed live from the loaded
objects (a few ms), and the memo is *refreshed* with them: read, and rewritten only where it is
missing, stale, corrupt or holds other facts; once per process and facts (the re-probe of the
same decision does not read it again). vLLM starts an engine core's workers (which import
the module, and decide in ``init_device``) before the engine core builds its scheduler, where
this fix decides; so the first engine core after an install or upgrade finds the memo its
workers wrote, instead of paying the import.

Writing from a process whose vLLM objects are loaded is sound for what the facts are for: they
describe the zeroer that runs, and the zeroer runs in the workers. If something in a worker
changed vLLM's zeroer or layout code in memory (another plugin, a test), the worker's facts are
those of the zeroer that will actually zero, and the engine core reads exactly those. Every
worker start refreshes the memo before its engine core reads it, so a memo never outlives the
configuration that wrote it by more than one process start; a process that sees other facts
rewrites it (one DEBUG line). (Only a dry run in between, ``vllm-fixes status`` say, may read a
memo that a process with changed objects wrote.) This package's tests get a fresh cache root
each, so a test that changes vLLM's objects writes only into its own.

The entry lives under vLLM's own cache root:
``$VLLM_CACHE_ROOT/vllm-fixes/sync-load-zeroing/coverage-<install hash>.json``, one file per
vLLM install, written atomically (a temporary file in the same directory, then ``os.replace``):
concurrent writers (several TP workers starting at once) each replace the whole file, and a
reader opens only the final name, so it sees one complete entry or none, never a temporary
file. Nothing here ever raises into the probe: a memo that cannot be read, parsed or written
costs the live computation (or, where the facts are live anyway, a skipped refresh) and one
DEBUG line.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import logging
import os
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_fix_core import get_logger
from vllm_fix_sync_load_zeroing.__about__ import __version__

FIX_ID = "sync-load-zeroing"
WORKER_UTILS = "vllm.v1.worker.utils"
SCHEMA = 1
# Environment variables the computation reads (vLLM's layout resolver in hybrid_layouts():
# VLLM_KV_CACHE_LAYOUT narrows the accepted layouts to the requested one). Found by recording
# every os.environ / vllm.envs read during the computation on vLLM 0.31.0, 0.32.0 and 0.33.0.
ENV_INPUTS = ("VLLM_KV_CACHE_LAYOUT",)
# The modules whose source defines the facts (and this memo's format).
_OWN_MODULES = ("oracle", "probe", "memo")


def _memo_logger() -> logging.Logger:
    # A child of the package's logger, deliberately: the ladder silences the fix's own logger
    # while a probe runs (probe input must not make the fix warn), and this line is about the
    # memo, not about probe input. It propagates to the same handler as the decision line.
    return get_logger(FIX_ID).getChild("memo")


@dataclass(frozen=True)
class CoverageFacts:
    """What the probe needs from vLLM's zeroer, for the probe's attention spec."""

    zeroer: bool  # vllm.v1.worker.utils has KVBlockZeroer
    layouts: tuple[str, ...] = ()  # hybrid_layouts()
    covered: Mapping[str, bool] = field(default_factory=dict)  # layout -> READ rewrites zeroed bytes
    errors: Mapping[str, str] = field(default_factory=dict)  # layout -> repr of what byte_ranges raised

    def to_json(self) -> dict[str, Any]:
        return {
            "zeroer": self.zeroer,
            "layouts": list(self.layouts),
            "covered": dict(self.covered),
            "errors": dict(self.errors),
        }

    @classmethod
    def from_json(cls, data: Any) -> CoverageFacts:
        """Strict: anything not exactly of the written shape raises ValueError (corrupt)."""
        if not isinstance(data, dict) or set(data) != {"zeroer", "layouts", "covered", "errors"}:
            raise ValueError("facts are not of the memo's shape")
        zeroer, layouts, covered, errors = data["zeroer"], data["layouts"], data["covered"], data["errors"]
        if not isinstance(zeroer, bool) or not isinstance(layouts, list):
            raise ValueError("facts are not of the memo's shape")
        if not all(isinstance(name, str) for name in layouts):
            raise ValueError("layout names are not strings")
        if not isinstance(covered, dict) or not all(type(v) is bool for v in covered.values()):
            raise ValueError("coverage is not a bool per layout")
        if not isinstance(errors, dict) or not all(isinstance(v, str) for v in errors.values()):
            raise ValueError("errors are not a string per layout")
        if set(covered) | set(errors) != set(layouts) or set(covered) & set(errors):
            raise ValueError("not exactly one answer per layout")
        return cls(zeroer, tuple(layouts), dict(covered), dict(errors))


def compute_facts(spec: Callable[[], Any]) -> CoverageFacts:
    """The facts, computed live from vLLM (imports vllm.v1.worker.utils). Raises what the
    layout resolver raises; a layout whose bytes cannot be computed is recorded with its error."""
    from vllm_fix_sync_load_zeroing.oracle import hybrid_layouts, zeroing_is_overwritten

    worker_utils = importlib.import_module(WORKER_UTILS)
    if not hasattr(worker_utils, "KVBlockZeroer"):
        return CoverageFacts(zeroer=False)
    layouts = hybrid_layouts()
    attention = spec()
    covered: dict[str, bool] = {}
    errors: dict[str, str] = {}
    for layout in layouts:
        try:
            covered[layout] = zeroing_is_overwritten(layout, attention)
        except Exception as exc:
            errors[layout] = repr(exc)
    return CoverageFacts(True, layouts, covered, errors)


# (memo path, stamp + facts) this process has read from or written (or tried to write) to the
# memo: the re-probe of the same decision (and any later probe with the same facts) neither reads
# nor writes it again, nor logs a second DEBUG line about it.
_refreshed: set[tuple[str, str]] = set()


def _done(path: Path, stamp: Mapping[str, Any], facts: CoverageFacts) -> tuple[str, str]:
    return str(path), json.dumps([stamp, facts.to_json()], sort_keys=True)


def _remember(path: Path, stamp: Mapping[str, Any], facts: CoverageFacts) -> None:
    with contextlib.suppress(Exception):
        _refreshed.add(_done(path, stamp, facts))


def _read(path: Path, stamp: Mapping[str, Any], problems: list[str]) -> CoverageFacts | None:
    """read_memo; a missing file is a miss, any other failure a miss noted in `problems`."""
    try:
        return read_memo(path, stamp)
    except FileNotFoundError:
        return None
    except Exception as exc:  # unreadable or corrupt: overwritten with the live facts
        problems.append(f"{path} unreadable ({exc!r})")
        return None


def _write(path: Path, stamp: Mapping[str, Any], facts: CoverageFacts, problems: list[str]) -> bool:
    """write_memo; False, noted in `problems`, where it fails."""
    try:
        write_memo(path, stamp, facts)
    except Exception as exc:
        problems.append(f"cannot write {path} ({exc!r})")
        return False
    return True


def coverage_facts(spec: Callable[[], Any], *, use_memo: bool | None = None) -> CoverageFacts:
    """The facts for the probe: from the memo where it is valid, otherwise computed live.

    `use_memo` None (the probe): where vllm.v1.worker.utils is not loaded yet, the memo is used;
    where it is loaded, the facts are computed live and the memo refreshed with them
    (refresh_memo). True: the memo is used regardless; False: live, the memo left alone."""
    if use_memo is None:
        if WORKER_UTILS in sys.modules:
            live = compute_facts(spec)  # may raise: the probe then answers "cannot check"
            refresh_memo(live)
            return live
        use_memo = True
    if not use_memo:
        return compute_facts(spec)
    problems: list[str] = []
    key: tuple[Path, dict[str, Any]] | None = None
    try:
        key = memo_path(), current_stamp()
    except Exception as exc:
        problems.append(f"no memo key ({exc!r})")
    else:
        held = _read(*key, problems)
        if held is not None:
            _remember(*key, held)
            return held
    try:
        facts = compute_facts(spec)  # may raise: the probe then answers "cannot check"
        if key is not None:
            _remember(*key, facts)  # a later refresh_memo has nothing to add
            _write(*key, facts, problems)
    finally:
        if problems:
            _memo_logger().debug("coverage memo: %s; computed live", "; ".join(problems))
    return facts


def refresh_memo(facts: CoverageFacts) -> bool:
    """Make the memo hold `facts`, computed live in this process: read it, and write `facts`
    (atomically) only where it is missing, stale, corrupt or holds other facts. Tried once per
    process for the same path, stamp and facts. True iff it wrote. Never raises; a problem
    other than a plain miss or a stale entry is one DEBUG line."""
    try:
        path, stamp = memo_path(), current_stamp()
        done = _done(path, stamp, facts)
    except Exception as exc:
        _memo_logger().debug("coverage memo: no memo key (%r); not refreshed", exc)
        return False
    if done in _refreshed:
        return False
    problems: list[str] = []
    held = _read(path, stamp, problems)
    wrote = False
    if held != facts:
        if held is not None:
            problems.append(f"{path} holds other facts than computed live here")
        wrote = _write(path, stamp, facts, problems)
    _refreshed.add(done)  # tried: a memo this process cannot write is not retried (nor logged) again
    if problems:
        outcome = "refreshed from the live facts" if wrote else "not refreshed"
        _memo_logger().debug("coverage memo: %s; %s", "; ".join(problems), outcome)
    return wrote


def memo_path() -> Path:
    """One file per vLLM install, under vLLM's own cache root."""
    import vllm
    import vllm.envs

    root = Path(vllm.envs.VLLM_CACHE_ROOT)
    install = hashlib.sha256(os.path.dirname(os.path.abspath(vllm.__file__ or "")).encode()).hexdigest()
    return root / "vllm-fixes" / FIX_ID / f"coverage-{install[:16]}.json"


def current_stamp() -> dict[str, Any]:
    """Everything but the per-file stamps that the facts depend on."""
    import torch
    import vllm

    return {
        "schema": SCHEMA,
        "fix_version": __version__,
        "own_source": own_source_hash(),
        "python": sys.version,
        "vllm_version": str(getattr(vllm, "__version__", "")),
        "vllm_path": os.path.dirname(os.path.abspath(vllm.__file__ or "")),
        "torch_version": str(torch.__version__),
        "env": {name: os.environ.get(name) for name in ENV_INPUTS},
    }


def own_source_hash() -> str:
    digest = hashlib.sha256()
    here = Path(__file__).parent
    for name in _OWN_MODULES:
        digest.update(name.encode() + b"\0" + (here / f"{name}.py").read_bytes() + b"\0")
    return digest.hexdigest()


def vllm_files() -> list[tuple[str, int, int]]:
    """(path, size, mtime_ns) of the file of every loaded vllm module, sorted."""
    found: dict[str, tuple[str, int, int]] = {}
    for name, module in list(sys.modules.items()):
        if name != "vllm" and not name.startswith("vllm."):
            continue
        path = getattr(module, "__file__", None)
        if not isinstance(path, str) or path in found:
            continue  # a namespace package has no file of its own
        st = os.stat(path)  # a module file that cannot be stat'ed: nothing is written
        found[path] = (path, st.st_size, st.st_mtime_ns)
    return sorted(found.values())


def read_memo(path: Path, stamp: Mapping[str, Any]) -> CoverageFacts | None:
    """The memo's facts if it is valid for `stamp` and every recorded file is unchanged; None
    if stale. Raises on an unreadable or malformed file."""
    data = json.loads(path.read_bytes())
    if not isinstance(data, dict) or not isinstance(data.get("files"), list):
        raise ValueError("not a coverage memo")
    if data.get("stamp") != stamp:
        return None
    files = data["files"]
    if not files:
        raise ValueError("a memo without files")
    for entry in files:
        file, size, mtime_ns = entry  # ValueError/TypeError on a malformed entry
        try:
            st = os.stat(file)
        except OSError:
            return None  # a recorded file is gone: stale
        if st.st_size != size or st.st_mtime_ns != mtime_ns:
            return None
    return CoverageFacts.from_json(data.get("facts"))


def write_memo(path: Path, stamp: Mapping[str, Any], facts: CoverageFacts) -> None:
    """Atomically (a temporary file in the same directory, then os.replace)."""
    payload = json.dumps(
        {"stamp": dict(stamp), "facts": facts.to_json(), "files": vllm_files()}, separators=(",", ":")
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the memo from other users of the root
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(payload)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
