"""Where a module's code calls a function, read from code objects rather than by parsing modules.

A fix that must change what every caller of a function sees (each ``from x import f`` keeps
its own reference; a caller may leave an argument out) needs the callers themselves. They are
found from the names each function's code object (or one nested in it) loads, so finding them
costs no parse; only the calls of a caller that must be looked at more closely are parsed, and
then from the source span of each call (Python 3.11+ positions), the whole function only where
that span cannot be read.

* :func:`functions`: a module's own functions and its classes' methods, each unwrapped;
* :func:`loads_name`: does a code object (or one nested in it) load a name;
* :class:`Callers`: the callers of one name across a set of modules (one scan reusable once);
* :func:`call_expressions` / :func:`every_call_passes`: the calls of a name inside a function,
  and whether each one passes a given argument; :func:`argument`, the argument a call passed
  (for a wrapper, from its ``args, kwargs``).

A caller is named by its :data:`Site`: (the short name its module goes by, its qualname).
"""

from __future__ import annotations

import ast
import dis
import linecache
import types
from collections.abc import Callable, Iterator, Mapping
from types import ModuleType
from typing import Any

from vllm_fix_core.declaration import resolve_qualname
from vllm_fix_core.fingerprint import function_ast, unwrap

Site = tuple[str, str]  # (module short name, qualname of the calling function)


def _function_of(raw: Any) -> types.FunctionType | None:
    """The plain function behind a class or module attribute (a property's getter, a
    classmethod's or staticmethod's function, a wrapper's innermost function); else None."""
    if isinstance(raw, property):
        raw = raw.fget
    elif not isinstance(raw, (types.FunctionType, staticmethod, classmethod)) and not hasattr(
        raw, "__wrapped__"
    ):
        return None
    func = unwrap(raw)
    return func if isinstance(func, types.FunctionType) else None


def functions(module: ModuleType) -> Iterator[tuple[str, types.FunctionType]]:
    """(qualname, function) of the module's own functions and of its own classes' methods.

    Functions and classes a module only imports are left out (their ``__module__`` is another
    module's); a method is named ``Class.method`` and unwrapped to the function its code is in.
    """
    for name, obj in list(vars(module).items()):
        if isinstance(obj, type):
            if obj.__module__ != module.__name__:
                continue
            for attr, raw in list(vars(obj).items()):
                if not isinstance(raw, (property, types.FunctionType, staticmethod, classmethod)):
                    continue
                func = _function_of(raw)
                if func is not None:
                    yield f"{name}.{attr}", func
        elif isinstance(obj, types.FunctionType):
            func = _function_of(obj)
            if func is not None and func.__module__ == module.__name__:
                yield name, func


def loads_name(code: types.CodeType, name: str) -> bool:
    """Does `code`, or a function or comprehension defined in it, load the global or attribute `name`?"""
    if name in code.co_names:
        return True
    return any(isinstance(c, types.CodeType) and loads_name(c, name) for c in code.co_consts)


def find_callers(modules: Mapping[str, ModuleType], name: str) -> dict[Site, types.FunctionType]:
    """Every function of `modules` (short name -> module) whose code loads `name`."""
    found: dict[Site, types.FunctionType] = {}
    for short, module in modules.items():
        for qualname, func in functions(module):
            if loads_name(func.__code__, name):
                found[(short, qualname)] = func
    return found


def still_current(modules: Mapping[str, ModuleType], found: Mapping[Site, types.FunctionType]) -> bool:
    """Is each function of `found` still the one its owner holds (under whatever wrappers)?"""
    try:
        return bool(found) and all(
            _function_of(vars(owner)[attr]) is func
            for (short, qualname), func in found.items()
            for owner, attr in [resolve_qualname(modules[short], qualname)]
        )
    except (AttributeError, KeyError):
        return False


class Callers:
    """The callers of one function name across a set of modules.

    ``modules`` is called on each scan (it imports them). ``scan(reuse=True)`` hands back the
    inventory of the last scan once, if each of its functions is unchanged (say, a fix's apply
    right after its recognize, in one decision), and scans again otherwise.
    """

    def __init__(self, name: str, modules: Callable[[], Mapping[str, ModuleType]]) -> None:
        self.name = name
        self._modules = modules
        self._last: dict[Site, types.FunctionType] = {}

    def scan(self, *, reuse: bool = False) -> dict[Site, types.FunctionType]:
        """Every function of the modules that calls :attr:`name`, by :data:`Site`."""
        mods = self._modules()
        if reuse and still_current(mods, self._last):
            last = dict(self._last)
            self._last.clear()
            return last
        found = find_callers(mods, self.name)
        self._last = dict(found)
        return found


def argument(
    args: tuple[Any, ...], kwargs: Mapping[str, Any], index: int, name: str, default: Any = None
) -> Any:
    """The argument a call passed at position `index` or as keyword `name` (else `default`),
    read from a wrapper's ``(args, kwargs)``."""
    if len(args) > index:
        return args[index]
    return kwargs.get(name, default)


def _call_span(instructions: list[dis.Instruction], load: dis.Instruction) -> Any:
    """The positions of the CALL that starts where `load` starts (the call of what it loaded)."""
    start = getattr(load, "positions", None)
    if start is None or start.lineno is None:
        return None
    return next(
        (
            i.positions
            for i in instructions
            if i.opname == "CALL"
            and i.positions is not None
            and (i.positions.lineno, i.positions.col_offset) == (start.lineno, start.col_offset)
        ),
        None,
    )


def _parse_span(lines: list[str], span: Any) -> ast.expr | None:
    if span is None or None in (span.lineno, span.end_lineno, span.col_offset, span.end_col_offset):
        return None
    chunk = [line.encode() for line in lines[span.lineno - 1 : span.end_lineno]]
    if not chunk:
        return None
    chunk[-1] = chunk[-1][: span.end_col_offset]  # columns are byte offsets
    chunk[0] = chunk[0][span.col_offset :]
    try:
        return ast.parse(b"".join(chunk).decode().strip(), mode="eval").body
    except (SyntaxError, UnicodeDecodeError):
        return None


def _calls_from_bytecode(func: types.FunctionType, name: str) -> list[ast.expr] | None:
    """The calls of `name` in `func`, each parsed from its own source span; None where a span
    cannot be read (no positions before 3.11, no source, a load that is not called)."""
    lines = linecache.getlines(func.__code__.co_filename)
    if not lines:
        return None
    codes = [func.__code__]
    calls: list[ast.expr] = []
    while codes:
        code = codes.pop()
        codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
        instructions = list(dis.get_instructions(code))
        for load in instructions:
            if load.argval != name or not load.opname.startswith("LOAD_"):
                continue
            call = _parse_span(lines, _call_span(instructions, load))
            if call is None:
                return None
            calls.append(call)
    return calls or None  # referenced but no call found here: parse the function


def _called_name(node: ast.Call) -> str | None:
    return node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)


def call_expressions(func: types.FunctionType, name: str) -> list[ast.expr]:
    """The expressions that call `name` (as ``name(...)`` or ``x.name(...)``) inside `func`.

    Each is parsed from the source span of its CALL instruction; where that is not possible the
    function's source is parsed (:func:`vllm_fix_core.function_ast`) and its calls collected.
    """
    calls = _calls_from_bytecode(func, name)
    if calls is not None:
        return calls
    return [
        node
        for node in ast.walk(function_ast(func))
        if isinstance(node, ast.Call) and _called_name(node) == name
    ]


def passes_argument(call: ast.expr, position: int, keyword: str) -> bool:
    """Does `call` pass the argument at index `position` (counting from 0), or as `keyword`?"""
    return isinstance(call, ast.Call) and (
        len(call.args) > position or any(k.arg == keyword for k in call.keywords)
    )


_PASSES_CACHE: dict[tuple[types.CodeType, str, int, str], bool] = {}


def every_call_passes(func: types.FunctionType, name: str, position: int, keyword: str) -> bool:
    """Does every call of `name` in `func` pass the argument at `position` or as `keyword`?

    Answered once per code object (a function whose ``__code__`` is swapped is read again).
    """
    key = (func.__code__, name, position, keyword)
    cached = _PASSES_CACHE.get(key)
    if cached is None:
        cached = all(passes_argument(c, position, keyword) for c in call_expressions(func, name))
        _PASSES_CACHE[key] = cached
    return cached
