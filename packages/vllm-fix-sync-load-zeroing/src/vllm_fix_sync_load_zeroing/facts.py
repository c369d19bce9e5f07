"""The layout-coverage facts the probe needs from vLLM's zeroer, and their live computation.

For the probe's fixed attention spec:

* whether vLLM has ``KVBlockZeroer``;
* the layouts vLLM's resolver accepts for a hybrid model (``oracle.hybrid_layouts()``);
* per layout, whether a READ rewrites every byte the zeroer zeroes
  (``oracle.zeroing_is_overwritten``, the probe's own measurement, which shares no code with
  the patch), or the repr of what the computation raised (the probe answers "cannot check" for
  it, as it does live);
* the same per layout for two attention groups aliasing one allocation (``grouped``,
  ``grouped_errors``), which the probe reads only where this vLLM's hybrid READ carries several
  attention groups (0.34.0 on).

Measuring them asks vLLM's own ``KVBlockZeroer`` which bytes it zeroes, and that lives in
``vllm.v1.worker.utils``, which drags in vLLM's attention, linear and Mamba layers (about 100 ms)
and, through them, ``vllm._aiter_ops`` (which sets ``AITER_*`` variables in ``os.environ`` and
disables the ``aiter`` logger on import). A multi-process engine core, where this fix decides,
never imports it, so the probe never does either: where the module is loaded (a worker, a
single-process engine) the facts are measured (:func:`compute_facts`); where it is not, they come
from the memo a worker wrote (:mod:`vllm_fix_sync_load_zeroing.memo`), else from the bug's
specification (:func:`spec_facts`, which imports nothing vLLM has not imported). Only this oracle
input is memoized: the probe still calls vLLM's real ``build_connector_meta`` /
``get_sync_load_block_ids`` on every probe case.
"""

from __future__ import annotations

import ast
import importlib
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WORKER_UTILS = "vllm.v1.worker.utils"


@dataclass(frozen=True)
class CoverageFacts:
    """What the probe needs from vLLM's zeroer, for the probe's attention spec."""

    zeroer: bool  # vllm.v1.worker.utils has KVBlockZeroer
    layouts: tuple[str, ...] = ()  # hybrid_layouts()
    covered: Mapping[str, bool] = field(default_factory=dict)  # layout -> READ rewrites zeroed bytes
    errors: Mapping[str, str] = field(default_factory=dict)  # layout -> repr of what the oracle raised
    # The same for two attention groups aliasing one allocation (several groups READ at once).
    grouped: Mapping[str, bool] = field(default_factory=dict)
    grouped_errors: Mapping[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "zeroer": self.zeroer,
            "layouts": list(self.layouts),
            "covered": dict(self.covered),
            "errors": dict(self.errors),
            "grouped": dict(self.grouped),
            "grouped_errors": dict(self.grouped_errors),
        }

    @classmethod
    def from_json(cls, data: Any) -> CoverageFacts:
        """Strict: anything not exactly of the written shape raises ValueError (corrupt)."""
        if not isinstance(data, dict) or set(data) != set(_SHAPE):
            raise ValueError("facts are not of the memo's shape")
        zeroer, layouts = data["zeroer"], data["layouts"]
        if not isinstance(zeroer, bool) or not isinstance(layouts, list):
            raise ValueError("facts are not of the memo's shape")
        if not all(isinstance(name, str) for name in layouts):
            raise ValueError("layout names are not strings")
        for answers, failures in (("covered", "errors"), ("grouped", "grouped_errors")):
            covered, errors = data[answers], data[failures]
            if not isinstance(covered, dict) or not all(type(v) is bool for v in covered.values()):
                raise ValueError("coverage is not a bool per layout")
            if not isinstance(errors, dict) or not all(isinstance(v, str) for v in errors.values()):
                raise ValueError("errors are not a string per layout")
            if set(covered) | set(errors) != set(layouts) or set(covered) & set(errors):
                raise ValueError("not exactly one answer per layout")
        return cls(
            zeroer,
            tuple(layouts),
            dict(data["covered"]),
            dict(data["errors"]),
            dict(data["grouped"]),
            dict(data["grouped_errors"]),
        )


_SHAPE = ("zeroer", "layouts", "covered", "errors", "grouped", "grouped_errors")


def second_group_spec(spec: Any) -> Any:
    """The probe's second attention group: a sliding-window group of `spec`'s page shape (as a
    hybrid model with full and sliding-window attention has; vLLM's planner gives both the same
    page)."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return SlidingWindowSpec(
        block_size=spec.block_size,
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        dtype=spec.dtype,
        page_size_padded=getattr(spec, "page_size_padded", None),
        sliding_window=2 * spec.block_size,
    )


def compute_facts(spec: Callable[[], Any]) -> CoverageFacts:
    """The facts, computed live from vLLM (imports vllm.v1.worker.utils). Raises what the
    layout resolver raises; a layout whose bytes cannot be computed is recorded with its error."""
    from vllm_fix_sync_load_zeroing.oracle import hybrid_layouts, zeroing_is_overwritten

    worker_utils = importlib.import_module(WORKER_UTILS)
    if not hasattr(worker_utils, "KVBlockZeroer"):
        return CoverageFacts(zeroer=False)
    layouts = hybrid_layouts()
    attention = spec()
    answers: list[tuple[dict[str, bool], dict[str, str]]] = []
    for specs in ((attention,), (attention, second_group_spec(attention))):
        covered: dict[str, bool] = {}
        errors: dict[str, str] = {}
        for layout in layouts:
            try:
                covered[layout] = zeroing_is_overwritten(layout, *specs)
            except Exception as exc:
                errors[layout] = repr(exc)
        answers.append((covered, errors))
    (covered, errors), (grouped, grouped_errors) = answers
    return CoverageFacts(True, layouts, covered, errors, grouped, grouped_errors)


def spec_facts() -> CoverageFacts:
    """The facts without vLLM's zeroer, for a process that has not imported
    ``vllm.v1.worker.utils`` (importing it there is what this fix must not do):

    * whether vLLM has ``KVBlockZeroer``: read from the module's source, not imported;
    * the layouts vLLM's resolver accepts for a hybrid model: asked of the resolver, as live;
    * per layout, the bug's specification (§4.2): the READ rewrites every byte the zeroer clears
      under a block-compact layout (``KVCacheLayout.is_block_compact``: each layer's page of a
      block is one run, which both the zeroer and the READ cover whole, padded or not), and under
      the others only where MoRIIO's READ copies head slices (it then reads every head of every
      layer of the tile). Attention groups alias one allocation with the same page, so two
      groups are covered exactly where one is.

    A test holds these to the measured facts on every release the fix is tested on."""
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from vllm_fix_sync_load_zeroing.oracle import hybrid_layouts

    if not _defines_zeroer():
        return CoverageFacts(zeroer=False)
    layouts = hybrid_layouts()
    head_slices = _read_copies_head_slices()
    covered = {name: bool(KVCacheLayout[name].is_block_compact or head_slices) for name in layouts}
    return CoverageFacts(True, layouts, covered, {}, dict(covered), {})


def _defines_zeroer() -> bool:
    """``vllm.v1.worker.utils`` defines ``KVBlockZeroer``: from the loaded module where it is
    loaded, else from its source file (found through the loaded ``vllm.v1`` package, parsed,
    never executed)."""
    loaded = sys.modules.get(WORKER_UTILS)
    if loaded is not None:
        return hasattr(loaded, "KVBlockZeroer")
    package = sys.modules.get("vllm.v1")
    if package is None:
        package = importlib.import_module("vllm.v1")
    for folder in getattr(package, "__path__", ()):
        path = Path(folder) / "worker" / "utils.py"
        if path.is_file():
            tree = ast.parse(path.read_bytes(), filename=str(path))
            return any(isinstance(node, ast.ClassDef) and node.name == "KVBlockZeroer" for node in tree.body)
    return False


def _read_copies_head_slices() -> bool:
    """MoRIIO's READ path asks for head-slice offsets (``_compute_read_attention_offsets``)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector as mc

    read_path = getattr(getattr(mc.MoRIIOConnectorWorker, "_read_blocks", None), "__code__", None)
    return read_path is not None and "_compute_read_attention_offsets" in read_path.co_names
