"""Fingerprints read from the code object's line table equal those read by inspect.getsource,
for every function of the installed vLLM's modules that the fixes patch, and for the shapes
the line table cannot cut alone (a body ending in a bare `pass`, decorators, nested code).
The reference also strips docstrings its own way (visiting every node), so the fast strip of
statement lists is checked against it on the same functions."""

from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
import textwrap
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vllm_fix_core import fingerprint
from vllm_fix_core.fingerprint import ast_fingerprint, function_ast

PATCHED_MODULES = (
    "vllm.distributed.kv_transfer.kv_connector.v1.multi_connector",
    "vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_connector",
    "vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_engine",
    "vllm.v1.core.sched.scheduler",
    "vllm.v1.worker.gpu.kv_connector",
    "vllm.v1.worker.gpu.model_runner",
    "vllm.entrypoints.openai.chat_completion.serving",
)


GETSOURCE = inspect.getsource  # the reference reads the source with inspect itself


def reference_strip(node: ast.AST) -> ast.AST:
    """Every docstring of a function or class anywhere in `node`, found by visiting every node."""
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


def inspect_fingerprint(obj: Any) -> str:
    """The fingerprint of the source as inspect.getsource reads it (the reference: only how the
    source is found differs from ast_fingerprint)."""
    node = ast.parse(textwrap.dedent(GETSOURCE(obj))).body[0]
    assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    dump = ast.dump(reference_strip(node), annotate_fields=True, include_attributes=False)
    return hashlib.sha256(dump.encode()).hexdigest()[:16]


def functions_of(module: types.ModuleType) -> Iterator[types.FunctionType]:
    for obj in vars(module).values():
        if isinstance(obj, type) and obj.__module__ == module.__name__:
            for value in vars(obj).values():
                func = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
                func = func.fget if isinstance(func, property) else func
                if isinstance(func, types.FunctionType):
                    yield func
        elif isinstance(obj, types.FunctionType) and obj.__module__ == module.__name__:
            yield obj


@pytest.mark.parametrize("name", PATCHED_MODULES)
def test_same_fingerprint_as_inspect_for_vllms_patched_modules(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        pytest.skip(f"{name} is not part of this vLLM: {exc}")
    fallbacks: list[str] = []

    def counting_getsource(obj: Any) -> str:
        fallbacks.append(obj.__qualname__)
        return GETSOURCE(obj)

    monkeypatch.setattr(fingerprint.inspect, "getsource", counting_getsource)
    compared = 0
    for func in functions_of(module):
        try:
            expected = inspect_fingerprint(func)
        except OSError:  # generated code (a namedtuple's __new__): no source for either
            continue
        fingerprint._AST_CACHE.clear()
        assert ast_fingerprint(func) == expected, func.__qualname__
        compared += 1
    assert compared >= 5, f"only {compared} functions with source in {name}"
    # The line table is what is read, not inspect's tokenizer (which would hide a wrong cut).
    assert not fallbacks, f"read by inspect instead of the line table: {fallbacks[:5]}"


EDGE_CASES = '''
import functools


def trailing_pass(x):
    if x:
        return 1
    else:
        pass


def trailing_comment(x):
    return x
    # a comment after the last statement


@functools.lru_cache(maxsize=None)
def decorated(x):
    return (
        x,
        x,
    )


def nested(x):
    def inner(y):
        return [
            y
        ]

    class Local:
        def method(self):
            """doc"""
            while True:
                break

    return inner, Local


def docstrings_everywhere(x):
    """Definitions with docstrings in every kind of statement list."""
    try:
        def in_try():
            """doc"""
    except ValueError:
        def in_handler():
            """doc"""
            return 1
    else:
        class InElse:
            """doc"""
    finally:
        async def in_finally():
            """doc"""
            return [lambda: "not a docstring"]
    match x:
        case 1:
            def in_case():
                """doc"""
    with open(x) as f:
        for _ in f:
            def in_for():
                """doc"""
        else:
            while x:
                def in_while():
                    """only a docstring"""
    return "a string that is not a docstring"


class Holder:
    def method(self, x):
        """A docstring that spans
        two lines."""
        try:
            return x
        finally:
            x = None
'''


def test_same_fingerprint_as_inspect_for_edge_shapes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "fp_edge_cases.py").write_text(EDGE_CASES)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("fp_edge_cases")
    funcs = [
        module.trailing_pass,
        module.trailing_comment,
        module.decorated.__wrapped__,
        module.nested,
        module.docstrings_everywhere,
        module.Holder.method,
    ]
    for func in funcs:
        fingerprint._AST_CACHE.clear()
        assert ast_fingerprint(func) == inspect_fingerprint(func), func.__qualname__
    # parsed once per code object: the second call returns the same tree
    assert function_ast(module.nested) is function_ast(module.nested)


# ---------------------------------------------------------------- drift-tolerant (canonical)
_BASE = """
def target(self, items, *, limit=3):
    total = 0
    for item in items[:limit]:
        total += item
    return total
"""

_SAME = {
    "renamed-local": _BASE.replace("total", "acc"),
    "log-line": _BASE.replace("    total = 0\n", "    logger.debug('summing %d', limit)\n    total = 0\n"),
    "getLogger-line": _BASE.replace(
        "    return total", "    logging.getLogger(__name__).info('done')\n    return total"
    ),
    "unused-keyword": _BASE.replace("*, limit=3", "*, limit=3, drift_option=None"),
}
_DIFFERENT = {
    "changed-operator": _BASE.replace("total += item", "total -= item"),
    "used-keyword": _BASE.replace("*, limit=3", "*, limit=3, scale=1").replace(
        "total += item", "total += item * scale"
    ),
    "changed-call": _BASE.replace("items[:limit]", "items[limit:]"),
    "renamed-parameter": _BASE.replace("items", "values"),
}


def _compiled(source: str, tmp_path: Any, name: str) -> Any:
    path = tmp_path / f"canonical_{name.replace('-', '_')}.py"
    path.write_text(source, encoding="utf-8")
    namespace: dict[str, Any] = {}
    exec(compile(source, str(path), "exec"), namespace)  # the file is what inspect reads
    return namespace["target"]


@pytest.mark.parametrize("name", sorted(_SAME))
def test_a_benign_drift_keeps_the_canonical_fingerprint(name: str, tmp_path: Any) -> None:
    from vllm_fix_core.fingerprint import ast_fingerprint, canonical_fingerprint

    base, drifted = _compiled(_BASE, tmp_path, "base"), _compiled(_SAME[name], tmp_path, name)
    assert ast_fingerprint(base) != ast_fingerprint(drifted)  # the exact one sees the change
    assert canonical_fingerprint(base) == canonical_fingerprint(drifted)


@pytest.mark.parametrize("name", sorted(_DIFFERENT))
def test_a_change_of_behaviour_changes_the_canonical_fingerprint(name: str, tmp_path: Any) -> None:
    from vllm_fix_core.fingerprint import canonical_fingerprint

    base, changed = _compiled(_BASE, tmp_path, "base"), _compiled(_DIFFERENT[name], tmp_path, name)
    assert canonical_fingerprint(base) != canonical_fingerprint(changed)


def test_a_replacement_takes_and_ignores_the_dropped_keywords(tmp_path: Any) -> None:
    from vllm_fix_core.fingerprint import canonical_function, dropping

    drifted = _compiled(_SAME["unused-keyword"], tmp_path, "unused")
    dropped = canonical_function(drifted)[1]
    assert dropped == ("drift_option",)

    def replacement(self: Any, items: list[int], *, limit: int = 3) -> int:
        return sum(items[:limit])

    adapted = dropping(replacement, dropped)
    assert adapted(None, [1, 2, 3, 4], drift_option="x") == drifted(None, [1, 2, 3, 4], drift_option="x") == 6
    with pytest.raises(TypeError):
        adapted(None, [1], other=1)  # only the dropped names are taken
    assert dropping(replacement, ()) is replacement


def test_call_params_leave_out_only_added_defaulted_keywords() -> None:
    from vllm_fix_core.fingerprint import call_params

    def target(self: Any, request: Any, n: int, *args: Any, known: int = 1, added: Any = None) -> None:
        return None

    assert call_params(target, ["known"]) == ["self", "request", "n", "args", "known"]
    assert call_params(target) == ["self", "request", "n", "args"]

    def required(self: Any, *, must: int) -> None:  # a required keyword changes every call
        return None

    assert call_params(required) == ["self", "must"]
    assert call_params(staticmethod(required)) == ["self", "must"]
