"""Lazy application: act when vLLM itself imports a target module.

A tiny meta-path finder wraps the loader of watched modules only. Unlike a
plain post-import hook it also reports an import that *fails*, so a process
where (say) MoRIIO cannot be imported still gets its one "not applicable"
line. It never imports anything itself and delegates every other name.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

OnLoaded = Callable[[ModuleType], None]
OnFailed = Callable[[BaseException], None]

_lock = threading.RLock()
_watchers: dict[str, list[tuple[OnLoaded, OnFailed]]] = {}


class _ObservingLoader(importlib.abc.Loader):
    def __init__(self, inner: Any, name: str) -> None:
        self._inner = inner
        self._name = name

    def __getattr__(self, item: str) -> Any:
        return getattr(self._inner, item)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        create = getattr(self._inner, "create_module", None)
        return create(spec) if create else None

    def exec_module(self, module: ModuleType) -> None:
        # Keep the module's own loader visible to inspect/linecache.
        module.__loader__ = self._inner
        if module.__spec__ is not None:
            module.__spec__.loader = self._inner
        try:
            self._inner.exec_module(module)
        except BaseException as exc:
            _fire(self._name, None, exc)
            raise
        _fire(self._name, module, None)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _watchers:
            return None
        spec: importlib.machinery.ModuleSpec | None = None
        for finder in sys.meta_path:
            if finder is self or isinstance(finder, _Finder):
                continue
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _ObservingLoader(spec.loader, fullname)
        return spec


_finder = _Finder()


def _fire(name: str, module: ModuleType | None, exc: BaseException | None) -> None:
    with _lock:
        callbacks = _watchers.pop(name, [])
    for on_loaded, on_failed in callbacks:
        if module is not None:
            on_loaded(module)
        elif exc is not None:
            on_failed(exc)


def when_imported(name: str, on_loaded: OnLoaded, on_failed: OnFailed) -> None:
    """Call on_loaded(module) once `name` is imported (now, if it already is),
    or on_failed(exc) if its import raises."""
    with _lock:
        module = sys.modules.get(name)
        if module is None:
            _watchers.setdefault(name, []).append((on_loaded, on_failed))
            if not any(isinstance(f, _Finder) for f in sys.meta_path):
                sys.meta_path.insert(0, _finder)
            return
    on_loaded(module)


def locate(name: str) -> bool:
    """Whether module `name` exists (a source/extension file or package),
    without importing it or any of its parent packages' __init__ beyond what
    is already imported."""
    if name in sys.modules:
        return sys.modules[name] is not None
    parts = name.split(".")
    top = sys.modules.get(parts[0])
    if top is None:
        spec = importlib.machinery.PathFinder.find_spec(parts[0])
        if spec is None:
            return False
        paths = list(spec.submodule_search_locations or [])
    else:
        paths = list(getattr(top, "__path__", []))
    for i, part in enumerate(parts[1:], start=1):
        qual = ".".join(parts[: i + 1])
        if qual in sys.modules:
            mod = sys.modules[qual]
            if mod is None:
                return False
            paths = list(getattr(mod, "__path__", []))
            continue
        spec = importlib.machinery.PathFinder.find_spec(part, paths)
        if spec is None:
            return False
        paths = list(spec.submodule_search_locations or [])
    return True
