"""Call-site discovery on synthetic modules written to disk (no vLLM): which functions call a
name, through wrappers and cached references, and whether each call passes an argument."""

from __future__ import annotations

import ast
import importlib
import sys
import textwrap
import types
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import wrapt

from vllm_fix_core import PatchSet, callsites, resolve_qualname, unwrap
from vllm_fix_core.callsites import (
    Callers,
    argument,
    call_expressions,
    every_call_passes,
    find_callers,
    functions,
    loads_name,
    passes_argument,
    still_current,
)

LIB_SRC = """
def offset(dp, tp, size=1):
    return dp * size + tp
"""

# Calls `offset` from every place a module's code can sit; `helper` and `Other` do not.
USER_SRC = """
import functools

from {lib} import offset


def logged(func):
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        return func(*args, **kwargs)
    return wrapper


def top(dp, tp):
    return offset(dp, tp)


def helper(x):
    return x + 1


def nested(dp):
    def inner(tp):
        return offset(dp, tp, 4)
    return inner(0)


def in_comprehension(dp):
    return [offset(dp, t, size=2) for t in range(2)]


def by_attribute(lib, dp):
    return lib.offset(dp, 0, 3)


class Sender:
    def send(self, dp, tp):
        return offset(
            dp,
            tp,
        )

    @staticmethod
    def static(dp):
        return offset(dp, 0, 2)

    @classmethod
    def klass(cls, dp):
        return offset(dp, 0)

    @property
    def port(self):
        return offset(1, 1, 2)

    @logged
    def cached(self, dp):
        return offset(dp, 1, 2)

    def quiet(self):
        return 0


class Other:
    def quiet(self):
        return helper(1)
"""

ALL_CALLERS = {
    "top",
    "nested",
    "in_comprehension",
    "by_attribute",
    "Sender.send",
    "Sender.static",
    "Sender.klass",
    "Sender.port",
    "Sender.cached",
}


class Modules:
    """A library module and a user module, written to `root` and imported under fresh names."""

    def __init__(self, root: Path) -> None:
        tag = uuid.uuid4().hex[:8]
        self.lib_name, self.user_name = f"cs_lib_{tag}", f"cs_user_{tag}"
        (root / f"{self.lib_name}.py").write_text(LIB_SRC)
        (root / f"{self.user_name}.py").write_text(textwrap.dedent(USER_SRC).format(lib=self.lib_name))
        self.lib = importlib.import_module(self.lib_name)
        self.user = importlib.import_module(self.user_name)

    def mapping(self) -> dict[str, ModuleType]:
        return {"lib": self.lib, "user": self.user}

    def drop(self) -> None:
        sys.modules.pop(self.lib_name, None)
        sys.modules.pop(self.user_name, None)


@pytest.fixture
def mods(tmp_path: Path) -> Iterator[Modules]:
    sys.path.insert(0, str(tmp_path))
    made = Modules(tmp_path)
    yield made
    made.drop()
    sys.path.remove(str(tmp_path))


def _call_through(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return wrapped(*args, **kwargs)


# --------------------------------------------------------------------------- finding callers


def test_functions_are_the_modules_own_unwrapped(mods: Modules) -> None:
    found = dict(functions(mods.user))
    assert "offset" not in found  # imported, not the module's own
    assert "functools" not in found
    assert {"top", "helper", "logged", "Sender.quiet", "Other.quiet"} <= set(found)
    assert all(isinstance(f, types.FunctionType) for f in found.values())
    assert found["Sender.static"] is vars(mods.user.Sender)["static"].__func__
    assert found["Sender.port"] is mods.user.Sender.port.fget
    assert found["Sender.cached"] is mods.user.Sender.cached.__wrapped__  # under the decorator
    assert found["Sender.cached"].__name__ == "cached"


def test_loads_name_sees_nested_code(mods: Modules) -> None:
    assert loads_name(mods.user.nested.__code__, "offset")  # only the inner function calls it
    assert "offset" not in mods.user.nested.__code__.co_names
    assert loads_name(mods.user.in_comprehension.__code__, "offset")
    assert not loads_name(mods.user.helper.__code__, "offset")


def test_find_callers_names_every_caller_by_site(mods: Modules) -> None:
    found = find_callers(mods.mapping(), "offset")
    assert set(found) == {("user", q) for q in ALL_CALLERS}
    assert found[("user", "top")] is mods.user.top


def test_a_wrapped_caller_is_found_as_its_function(mods: Modules) -> None:
    """A caller under a fix's wrapper (wrapt, as PatchSet installs it) is still the same caller."""
    original = mods.user.Sender.send
    patch = PatchSet("callsites-test")
    patch.wrap(mods.user.Sender, "send", _call_through)
    try:
        assert isinstance(vars(mods.user.Sender)["send"], wrapt.FunctionWrapper)
        found = find_callers(mods.mapping(), "offset")
        assert found[("user", "Sender.send")] is original
    finally:
        patch.revert()


def test_callers_reuse_once_while_unchanged(mods: Modules) -> None:
    calls: list[int] = []

    def modules() -> dict[str, ModuleType]:
        calls.append(1)
        return mods.mapping()

    inventory = Callers("offset", modules)
    first = inventory.scan()
    assert set(first) == {("user", q) for q in ALL_CALLERS}
    assert inventory.scan(reuse=True) == first  # unchanged: the last scan, handed back once
    assert inventory._last == {}
    assert inventory.scan(reuse=True) == first  # nothing to reuse: scanned again
    assert len(calls) == 3


def test_callers_rescan_when_a_function_changed(mods: Modules, monkeypatch: pytest.MonkeyPatch) -> None:
    inventory = Callers("offset", mods.mapping)
    inventory.scan()

    def top(dp: int, tp: int) -> int:  # no longer calls offset
        return dp + tp

    top.__module__ = mods.user_name
    monkeypatch.setattr(mods.user, "top", top)
    assert not still_current(mods.mapping(), inventory._last)
    assert ("user", "top") not in inventory.scan(reuse=True)


def test_still_current_through_wrappers_and_properties(mods: Modules) -> None:
    found = find_callers(mods.mapping(), "offset")
    assert still_current(mods.mapping(), found)
    patch = PatchSet("callsites-test")
    patch.wrap(mods.user, "top", _call_through)
    try:
        assert still_current(mods.mapping(), found)  # wrapped, not replaced
    finally:
        patch.revert()
    assert not still_current(mods.mapping(), {})
    assert not still_current(mods.mapping(), {("user", "Gone.method"): mods.user.top})
    assert not still_current({}, found)


# --------------------------------------------------------------------------- reading calls


def _source(call: ast.expr) -> str:
    return ast.unparse(call)


def test_call_expressions_are_each_call(mods: Modules) -> None:
    assert [_source(c) for c in call_expressions(mods.user.top, "offset")] == ["offset(dp, tp)"]
    assert [_source(c) for c in call_expressions(mods.user.nested, "offset")] == ["offset(dp, tp, 4)"]
    assert [_source(c) for c in call_expressions(mods.user.in_comprehension, "offset")] == [
        "offset(dp, t, size=2)"
    ]
    assert [_source(c) for c in call_expressions(mods.user.by_attribute, "offset")] == [
        "lib.offset(dp, 0, 3)"
    ]
    # a call over several lines is cut from its own span
    assert [_source(c) for c in call_expressions(mods.user.Sender.send, "offset")] == ["offset(dp, tp)"]


def test_call_expressions_without_positions_parse_the_function(
    mods: Modules, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(callsites, "_calls_from_bytecode", lambda func, name: None)
    assert [_source(c) for c in call_expressions(mods.user.in_comprehension, "offset")] == [
        "offset(dp, t, size=2)"
    ]
    assert [_source(c) for c in call_expressions(mods.user.by_attribute, "offset")] == [
        "lib.offset(dp, 0, 3)"
    ]


def test_passes_argument_by_position_or_keyword() -> None:
    def call(text: str) -> ast.expr:
        return ast.parse(text, mode="eval").body

    assert passes_argument(call("f(1, 2, 3)"), 2, "size")
    assert passes_argument(call("f(1, 2, size=3)"), 2, "size")
    assert not passes_argument(call("f(1, 2)"), 2, "size")
    assert not passes_argument(call("f(1, 2, other=3)"), 2, "size")
    assert not passes_argument(call("f"), 0, "x")  # not a call


@pytest.mark.parametrize(
    ("qualname", "passes"),
    [
        ("top", False),
        ("nested", True),
        ("in_comprehension", True),
        ("by_attribute", True),
        ("Sender.send", False),
        ("Sender.static", True),
        ("Sender.klass", False),
    ],
)
def test_every_call_passes(mods: Modules, qualname: str, passes: bool) -> None:
    func = dict(functions(mods.user))[qualname]
    assert every_call_passes(func, "offset", 2, "size") is passes


def test_every_call_passes_is_read_once_per_code_object(
    mods: Modules, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Code objects compare by content: a function of its own, so that no earlier answer is reused.
    tag = uuid.uuid4().hex[:8]
    source = f"from {mods.lib_name} import offset\n\ndef fresh_{tag}(dp):\n    return offset(dp, 0, 2)\n"
    (tmp_path / f"cs_fresh_{tag}.py").write_text(source)
    fresh = importlib.import_module(f"cs_fresh_{tag}")
    reads: list[Any] = []
    real = callsites.call_expressions

    def counting(func: types.FunctionType, name: str) -> list[ast.expr]:
        reads.append(func)
        return real(func, name)

    monkeypatch.setattr(callsites, "call_expressions", counting)
    func = getattr(fresh, f"fresh_{tag}")
    try:
        assert every_call_passes(func, "offset", 2, "size")
        assert every_call_passes(func, "offset", 2, "size")
        assert len(reads) == 1
        func.__code__ = func.__code__.replace(co_consts=(None, 0, 3 + len(reads)))  # swapped: read again
        assert every_call_passes(func, "offset", 2, "size")
        assert len(reads) == 2
    finally:
        sys.modules.pop(fresh.__name__, None)


def test_argument_by_position_keyword_or_default() -> None:
    assert argument((1, 2), {}, 1, "tp") == 2
    assert argument((1,), {"tp": 5}, 1, "tp") == 5
    assert argument((1,), {}, 1, "tp", default=7) == 7
    assert argument((), {}, 0, "dp") is None


# --------------------------------------------------------------------------- core helpers used


def test_unwrap_through_wrappers_and_descriptors(mods: Modules) -> None:
    def inner() -> int:
        return 1

    assert unwrap(staticmethod(inner)) is inner
    assert unwrap(classmethod(inner)) is inner
    assert unwrap(wrapt.FunctionWrapper(staticmethod(inner), _call_through)) is inner
    assert unwrap(vars(mods.user.Sender)["cached"]) is mods.user.Sender.cached.__wrapped__
    layered: Callable[[], int] = inner
    for _ in range(20):  # at most 16 levels are followed
        layered = wrapt.FunctionWrapper(layered, _call_through)
    assert unwrap(layered) is not inner


def test_resolve_qualname(mods: Modules) -> None:
    assert resolve_qualname(mods.user, "Sender.send") == (mods.user.Sender, "send")
    assert resolve_qualname(mods.user, "top") == (mods.user, "top")
    assert resolve_qualname(mods.user.Sender, "send") == (mods.user.Sender, "send")
    with pytest.raises(AttributeError):
        resolve_qualname(mods.user, "Gone.send")
