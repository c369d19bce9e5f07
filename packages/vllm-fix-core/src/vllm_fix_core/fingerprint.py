"""Normalized-AST fingerprints of target functions (docstrings and comments ignored)."""

from __future__ import annotations

import ast
import hashlib
import inspect
import textwrap
import threading
import time
from typing import Any


def _unwrap(obj: Any) -> Any:
    if isinstance(obj, (classmethod, staticmethod)):
        obj = obj.__func__
    seen = 0
    while hasattr(obj, "__wrapped__") and seen < 16:
        obj = obj.__wrapped__
        seen += 1
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


def function_ast(obj: Any) -> ast.FunctionDef | ast.AsyncFunctionDef:
    """The AST of a function's source, docstrings stripped."""
    source = textwrap.dedent(inspect.getsource(_unwrap(obj)))
    node = parse_source(source).body[0]
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise TypeError(f"{obj!r} is not a function")
    for sub in ast.walk(node):
        body = getattr(sub, "body", None)
        if (
            isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            sub.body = body[1:] or [ast.Pass()]
    return node


def ast_fingerprint(obj: Any) -> str:
    """16 hex digits of sha256 over the normalized AST dump (no line numbers)."""
    dump = ast.dump(function_ast(obj), annotate_fields=True, include_attributes=False)
    return hashlib.sha256(dump.encode()).hexdigest()[:16]
