"""Normalized-AST fingerprints of target functions (docstrings and comments ignored)."""

from __future__ import annotations

import ast
import hashlib
import inspect
import linecache
import textwrap
import threading
import time
import types
from collections.abc import Iterable
from typing import Any


def unwrap(obj: Any) -> Any:
    """The innermost object under `obj`'s wrappers (``__wrapped__``, up to 16 deep), and the
    function of a classmethod or staticmethod met on the way."""
    if isinstance(obj, (classmethod, staticmethod)):
        obj = obj.__func__
    for _ in range(16):
        inner = getattr(obj, "__wrapped__", None)
        if inner is None:
            break
        obj = inner
        if isinstance(obj, (classmethod, staticmethod)):
            obj = obj.__func__
    return obj


_PARSE_LOCK = threading.Lock()


def parse_source(source: str) -> ast.Module:
    """ast.parse, serialized and retried.

    CPython 3.11 (gh-106905) keeps the AST constructor's recursion depth in
    per-interpreter state: two threads building ASTs at once can fail with
    ``SystemError: AST constructor recursion depth mismatch``. Our own parses take a lock;
    one racing with a thread we do not own is retried.
    """
    for attempt in range(5):
        try:
            with _PARSE_LOCK:
                return ast.parse(source)
        except SystemError as exc:
            if "recursion depth mismatch" not in str(exc) or attempt == 4:
                raise
            time.sleep(0.01 * (attempt + 1))
    raise AssertionError("unreachable")


def _last_line(code: types.CodeType) -> int:
    """The last source line any instruction of `code` (or of a function nested in it) spans."""
    last = code.co_firstlineno
    for _, end, _, _ in code.co_positions():
        if end is not None and end > last:
            last = end
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            last = max(last, _last_line(const))
    return last


def _quick_source(func: Any) -> str | None:
    """The function's lines, cut from the file at the lines its code object spans: the same
    text inspect.getsource finds (up to trailing comments), without tokenizing the file."""
    code = getattr(func, "__code__", None)
    if not isinstance(code, types.CodeType):
        return None
    lines = linecache.getlines(code.co_filename)
    first, last = code.co_firstlineno, _last_line(code)
    if not lines or not 1 <= first <= last <= len(lines):
        return None
    return "".join(lines[first - 1 : last])


def _parse_function(func: Any) -> ast.FunctionDef | ast.AsyncFunctionDef:
    quick = _quick_source(func)
    if quick is not None:
        try:
            node = parse_source(textwrap.dedent(quick)).body[0]
        except (SyntaxError, IndexError):
            node = None
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == func.__code__.co_name:
            return node
    # Anything the line table cannot cut cleanly: inspect's own reading.
    node = parse_source(textwrap.dedent(inspect.getsource(func))).body[0]
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise TypeError(f"{func!r} is not a function")
    return node


_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
_STATEMENT_HOLDERS = (ast.excepthandler, ast.match_case)  # nodes that hold a statement list


def strip_docstrings(node: ast.FunctionDef | ast.AsyncFunctionDef) -> ast.FunctionDef | ast.AsyncFunctionDef:
    """`node` without the docstrings of itself and of the functions and classes inside it."""
    _strip_statements([node])
    return node


def _strip_statements(statements: list[Any]) -> None:
    # Definitions are statements, so only statement lists are visited, not expressions: a
    # tenth of the time of walking every node.
    for statement in statements:
        if isinstance(statement, _DEFINITIONS):
            body = statement.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                statement.body = body[1:] or [ast.Pass()]
        for field in statement._fields:
            value = getattr(statement, field, None)
            if type(value) is list and value:
                if isinstance(value[0], ast.stmt):
                    _strip_statements(value)
                elif isinstance(value[0], _STATEMENT_HOLDERS):
                    for holder in value:
                        _strip_statements(holder.body)


# code object id -> (the code object, kept alive so the id stays its own; the stripped AST).
# Nothing mutates a returned AST; a function whose __code__ is swapped gets a new entry.
_AST_CACHE: dict[int, tuple[types.CodeType, ast.FunctionDef | ast.AsyncFunctionDef]] = {}


def function_ast(obj: Any) -> ast.FunctionDef | ast.AsyncFunctionDef:
    """The AST of a function's source, docstrings stripped (parsed once per code object)."""
    func = unwrap(obj)
    code = getattr(func, "__code__", None)
    cached = _AST_CACHE.get(id(code)) if isinstance(code, types.CodeType) else None
    if cached is not None and cached[0] is code:
        return cached[1]
    node = strip_docstrings(_parse_function(func))
    if isinstance(code, types.CodeType):
        _AST_CACHE[id(code)] = (code, node)
    return node


def node_fingerprint(node: ast.AST) -> str:
    """16 hex digits of sha256 over a node's AST dump without positions (no line numbers)."""
    dump = ast.dump(node, annotate_fields=True, include_attributes=False)
    return hashlib.sha256(dump.encode()).hexdigest()[:16]


def ast_fingerprint(obj: Any) -> str:
    """The normalized AST fingerprint of a function (docstrings stripped, `node_fingerprint`)."""
    return node_fingerprint(function_ast(obj))


# --------------------------------------------------------------------------- drift-tolerant
_LOG_METHODS = frozenset(
    {
        "debug",
        "info",
        "warning",
        "warn",
        "error",
        "exception",
        "critical",
        "info_once",
        "warning_once",
        "debug_once",
    }
)


def _is_log_call(statement: ast.stmt) -> bool:
    """``logger.info(...)``-like: a statement that only logs (a name ending in "logger"/"log")."""
    if not (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call)):
        return False
    func = statement.value.func
    if not (isinstance(func, ast.Attribute) and func.attr in _LOG_METHODS):
        return False
    owner = func.value
    if isinstance(owner, ast.Name):
        return owner.id.lower().endswith(("logger", "log"))
    # logging.getLogger(__name__).debug(...)
    return isinstance(owner, ast.Call) and getattr(owner.func, "attr", "") == "getLogger"


class _Canonical(ast.NodeTransformer):
    """Renames the function's locals by order of first binding, drops log-only statements."""

    def __init__(self, names: dict[str, str]) -> None:
        self.names = names

    def visit_Name(self, node: ast.Name) -> ast.Name:
        if node.id in self.names:
            return ast.Name(id=self.names[node.id], ctx=node.ctx)
        return node

    def generic_visit(self, node: ast.AST) -> ast.AST:
        for field, value in ast.iter_fields(node):
            if type(value) is list and value and isinstance(value[0], ast.stmt):
                kept = [s for s in value if not _is_log_call(s)] or [ast.Pass()]
                setattr(node, field, kept)
        return super().generic_visit(node)


def _locals(node: ast.FunctionDef | ast.AsyncFunctionDef, params: set[str]) -> dict[str, str]:
    declared: set[str] = set()
    order: list[str] = []
    for child in ast.walk(node):
        if isinstance(child, (ast.Global, ast.Nonlocal)):
            declared.update(child.names)
    for child in ast.walk(node):
        if not (isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store)):
            continue
        if child.id not in params and child.id not in order:
            order.append(child.id)
    return {name: f"_local{i}" for i, name in enumerate(n for n in order if n not in declared)}


def canonical_function(obj: Any) -> tuple[ast.FunctionDef | ast.AsyncFunctionDef, tuple[str, ...]]:
    """A function's AST up to the changes a release makes without changing what it does, and
    the keyword-only parameters it dropped:

    * its locals renamed by order of first binding (a renamed local is the same function);
    * log-only statements (``logger.debug(...)``) left out;
    * keyword-only parameters that have a default and that the body never reads left out (the
      function behaves the same whether a caller passes them or not).
    """
    import copy

    node = copy.deepcopy(function_ast(obj))
    read = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    args = node.args
    dropped: list[str] = []
    kept_kw, kept_defaults = [], []
    for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        if default is not None and arg.arg not in read:
            dropped.append(arg.arg)
        else:
            kept_kw.append(arg)
            kept_defaults.append(default)
    args.kwonlyargs, args.kw_defaults = kept_kw, kept_defaults
    params = {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)}
    params |= {a.arg for a in (args.vararg, args.kwarg) if a is not None}
    body = ast.Module(body=node.body, type_ignores=[])
    _Canonical(_locals(node, params)).visit(body)
    node.body = body.body
    return node, tuple(dropped)


def canonical_fingerprint(obj: Any) -> str:
    """`node_fingerprint` of :func:`canonical_function`: equal for two functions that differ
    only by renamed locals, log lines and unused defaulted keyword-only parameters."""
    return node_fingerprint(canonical_function(obj)[0])


def dropping(replacement: Any, dropped: tuple[str, ...]) -> Any:
    """`replacement` taking (and ignoring) the keyword arguments `dropped`: what replaces a
    body whose canonical shape left those unused parameters out."""
    import functools

    if not dropped:
        return replacement

    @functools.wraps(replacement)
    def adapter(*args: Any, **kwargs: Any) -> Any:
        for name in dropped:
            kwargs.pop(name, None)
        return replacement(*args, **kwargs)

    return adapter


def call_params(func: Any, expected: Iterable[str] = ()) -> list[str]:
    """The parameter names of `func` (through classmethod / staticmethod), without the keyword-only
    ones that have a default and are not among `expected`: a release adds such a parameter
    without changing any call a wrapper sees (a wrapper passes it through untouched)."""
    if isinstance(func, (classmethod, staticmethod)):
        func = func.__func__
    known = set(expected)
    return [
        name
        for name, p in inspect.signature(func).parameters.items()
        if not (p.kind is p.KEYWORD_ONLY and p.default is not p.empty and name not in known)
    ]
