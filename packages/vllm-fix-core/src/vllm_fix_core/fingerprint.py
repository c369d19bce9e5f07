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
