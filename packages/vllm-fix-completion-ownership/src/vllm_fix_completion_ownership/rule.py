"""The owner-set rule, importable without vLLM.

A request R that finished on the scheduler has an owner set O(R): the MultiConnector
children whose ``request_finished*`` returned True for R, plus the children that
accepted ``register_finished_partial_tail`` for R.  R reaches the scheduler's
``finished_sending`` exactly once, at the first step where every owner has completed
on every worker (and, on the scheduler side, no owner holds it back).

Two halves share one wire format:

* :class:`SchedulerLedger` (engine-core process) records O(R), decides what each
  child's private view of the step output holds, collects scheduler-side child
  completions (watchdogs) and says which requests may be freed.  Every step it hands
  the workers an *update* (:func:`encode_update`): owner sets of newly finished
  requests (empty ones included), scheduler-side child completions, and the loader
  child of newly matched requests.
* :class:`WorkerGate` (every worker process) applies those updates and gates the
  children's ``finished_sending`` reports: a report counts only from an owner, a
  report before O(R) is known is buffered per (child, R) and discarded if
  O(R) = {}, and R is reported upward once, when all of O(R) have completed on this
  worker.  ``finished_recving`` / ``failed_recving`` are accepted only from R's
  loader child when the loader is known.

The update is a plain dict of builtins (str, int, tuple, dict) so that a process
without this package can unpickle the metadata object that carries it. This module holds
that wire format; the halves are ``ledger.py`` and ``gate.py``.
"""

from __future__ import annotations

from typing import Any

# Instance attribute on MultiKVConnectorMetadata that carries the update. vLLM's
# MultiKVConnectorMetadata is a dataclass pickled with its __dict__, so an extra
# instance attribute survives the trip and an unpatched reader simply ignores it.
META_ATTR = "vllm_fix_completion_ownership"
WIRE_VERSION = 1


def encode_update(
    owners: dict[str, tuple[int, ...]],
    forced: dict[str, tuple[int, ...]],
    loaders: dict[str, int],
) -> dict[str, Any]:
    if not (owners or forced or loaders):
        return EMPTY_UPDATE
    return {"v": WIRE_VERSION, "owners": owners, "forced": forced, "loaders": loaders}


# The update of a step with nothing to ship (nearly every step): one shared object, never
# mutated, so an idle step allocates nothing. Absent keys read as empty.
EMPTY_UPDATE: dict[str, Any] = {"v": WIRE_VERSION}
_NOTHING: dict[str, Any] = {}


class WireError(ValueError):
    """An update this version of the rule cannot read."""


def decode_update(
    update: Any,
) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]], dict[str, int]]:
    if not isinstance(update, dict) or update.get("v") != WIRE_VERSION:
        raise WireError(f"unsupported completion-ownership update: {update!r:.200}")
    return update.get("owners", _NOTHING), update.get("forced", _NOTHING), update.get("loaders", _NOTHING)


_CHILDREN: dict[int, tuple[int, ...]] = {}


def children_of(mask: int) -> tuple[int, ...]:
    """The child indexes in an owner mask (child i is bit ``1 << i``), ascending."""
    children = _CHILDREN.get(mask)
    if children is None:  # first sight of this owner set
        children = tuple(child for child in range(mask.bit_length()) if mask >> child & 1)
        if len(_CHILDREN) < 4096:  # masks of a few children: a handful of entries
            _CHILDREN[mask] = children
    return children
