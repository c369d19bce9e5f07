"""Layered, exactly revertible patches.

Every patched attribute keeps its original object and an ordered list of
layers (at most one body replacement, then any number of wrapt wrappers).
The installed object is rebuilt from the original whenever a layer is added
or removed, so two fixes on one target compose in either order and either can
be reverted alone. Nothing rewrites source text.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm_fix_core.declaration import static_lookup

MARKER = "__vllm_fix__"
_ABSENT = object()
_LOCK = threading.RLock()


class PatchConflict(Exception):
    """The target cannot be patched or reverted safely."""


@dataclass
class _Layer:
    fix_id: str
    kind: str  # "replace" | "wrap"
    func: Any


@dataclass
class _Record:
    owner: Any
    attr: str
    original: Any  # owner.__dict__[attr] before us, or _ABSENT if inherited
    base: Any  # what lookup found before us (the inherited object when _ABSENT)
    layers: list[_Layer] = field(default_factory=list)
    installed: Any = None


_RECORDS: dict[tuple[int, str], _Record] = {}


def _own(owner: Any, attr: str) -> Any:
    return getattr(owner, "__dict__", {}).get(attr, _ABSENT)


def _build(record: _Record) -> Any:
    import wrapt  # imported on first apply, not at plugin load

    obj = record.base
    for layer in record.layers:
        if layer.kind == "replace":
            obj = layer.func
    for layer in record.layers:
        if layer.kind == "wrap":
            obj = wrapt.FunctionWrapper(obj, layer.func)
    return obj


def _install(record: _Record) -> None:
    if not record.layers:
        if record.original is _ABSENT:
            delattr(record.owner, record.attr)
        else:
            setattr(record.owner, record.attr, record.original)
        del _RECORDS[(id(record.owner), record.attr)]
        return
    obj = _build(record)
    setattr(record.owner, record.attr, obj)
    record.installed = _own(record.owner, record.attr)


def layers_of(owner: Any, attr: str) -> list[str]:
    """Fix ids patched onto owner.attr, bottom first."""
    record = _RECORDS.get((id(owner), attr))
    return [layer.fix_id for layer in record.layers] if record else []


def original_of(owner: Any, attr: str) -> Any:
    """The object that owner.attr resolved to before any fix touched it."""
    record = _RECORDS.get((id(owner), attr))
    return record.base if record else static_lookup(owner, attr)


class PatchSet:
    """Everything one fix installed; `revert()` undoes exactly that."""

    def __init__(self, fix_id: str) -> None:
        self.fix_id = fix_id
        self._touched: list[tuple[Any, str]] = []
        self._undo: list[Callable[[], None]] = []

    @property
    def applied(self) -> bool:
        return bool(self._touched or self._undo)

    @property
    def targets(self) -> tuple[tuple[Any, str], ...]:
        """Every (owner, attribute) this fix patched, in the order it patched them."""
        return tuple(dict.fromkeys((owner, attr) for owner, attr in self._touched))

    def _record(self, owner: Any, attr: str) -> _Record:
        key = (id(owner), attr)
        record = _RECORDS.get(key)
        current = _own(owner, attr)
        if record is None:
            record = _Record(owner=owner, attr=attr, original=current, base=static_lookup(owner, attr))
            _RECORDS[key] = record
        elif current is not record.installed:
            raise PatchConflict(
                f"{getattr(owner, '__qualname__', owner)!r}.{attr} was replaced by "
                "someone else after a fix patched it"
            )
        return record

    def _add(self, owner: Any, attr: str, kind: str, func: Any) -> None:
        with _LOCK:
            record = self._record(owner, attr)
            if any(layer.fix_id == self.fix_id and layer.kind == kind for layer in record.layers):
                return  # idempotent per target object
            if kind == "replace" and any(layer.kind == "replace" for layer in record.layers):
                other = next(layer.fix_id for layer in record.layers if layer.kind == "replace")
                raise PatchConflict(f"{attr} body is already replaced by fix {other!r}")
            record.layers.append(_Layer(self.fix_id, kind, func))
            try:
                _install(record)
            except Exception:
                record.layers.pop()
                if not record.layers:
                    _RECORDS.pop((id(owner), attr), None)
                raise
            self._touched.append((owner, attr))

    def wrap(self, owner: Any, attr: str, wrapper: Callable[..., Any]) -> None:
        """wrapt-style wrapper(wrapped, instance, args, kwargs) around owner.attr."""
        self._add(owner, attr, "wrap", wrapper)

    def replace(self, owner: Any, attr: str, func: Any) -> None:
        """Replace the body of owner.attr (only for exactly identified shapes)."""
        with contextlib.suppress(AttributeError, TypeError):
            setattr(func, MARKER, self.fix_id)
        self._add(owner, attr, "replace", func)

    def on_revert(self, undo: Callable[[], None]) -> None:
        self._undo.append(undo)

    def revert(self) -> None:
        with _LOCK:
            for undo in reversed(self._undo):
                undo()
            self._undo.clear()
            for owner, attr in reversed(self._touched):
                record = _RECORDS.get((id(owner), attr))
                if record is None:
                    continue
                if _own(owner, attr) is not record.installed:
                    raise PatchConflict(
                        f"cannot revert {attr}: replaced by someone else after fix {self.fix_id!r} patched it"
                    )
                record.layers = [layer for layer in record.layers if layer.fix_id != self.fix_id]
                _install(record)
            self._touched.clear()
