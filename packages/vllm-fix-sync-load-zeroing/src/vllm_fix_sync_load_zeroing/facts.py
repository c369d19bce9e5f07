"""The layout-coverage facts the probe needs from vLLM's zeroer, and their live computation.

For the probe's fixed attention spec:

* whether vLLM has ``KVBlockZeroer``;
* the layouts vLLM's resolver accepts for a hybrid model (``oracle.hybrid_layouts()``);
* per layout, whether a READ rewrites every byte the zeroer zeroes
  (``oracle.zeroing_is_overwritten``, the probe's own measurement, which shares no code with
  the patch), or the repr of what the computation raised (the probe answers "cannot check" for
  it, as it does live).

Computing them asks vLLM's own ``KVBlockZeroer`` which bytes it zeroes, and importing
``vllm.v1.worker.utils`` for that drags in vLLM's attention, linear and Mamba layers (about
100 ms); a multi-process engine core, where this fix decides, does not otherwise import it. The
facts are a deterministic function of vLLM's and torch's code (plus one environment variable
vLLM's layout resolver reads), so :mod:`vllm_fix_sync_load_zeroing.memo` keeps them on disk.
Only this oracle input is memoized: the probe still calls vLLM's real ``build_connector_meta`` /
``get_sync_load_block_ids`` on every probe case.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

WORKER_UTILS = "vllm.v1.worker.utils"


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
