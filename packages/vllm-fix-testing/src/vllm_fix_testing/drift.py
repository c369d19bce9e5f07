"""The drift drill: copies of a release's tree changed the way releases change, for `status --source`.

A new release usually changes the code a fix patches in ways that do not touch the bug: a new
config attribute read in a constructor, a local renamed, a new keyword argument with a default, a
new log line, methods reordered. :func:`drifted_tree` writes a scratch copy of a tree (hard links
but for the files it changes) with such *benign* drifts made, with libcst, in every patched
target of the fixes given, so a test can check that each fix answers on it as on the unchanged
tree. :data:`SEMANTIC` holds *semantic* drifts: the bug's own line changed the way an upstream
fix changes it, where the probe must see the behaviour (and answer "fixed upstream"), never read
the new line as "affected → fixed".

What each benign drift does, in each patched target (``module:Class.method`` or ``module:func``):

* ``new-config-attribute``: vLLM's ``CacheConfig`` gains a field ``drift_drill_knob: int = 0``,
  and the ``__init__`` of every patched class that takes a ``vllm_config`` reads it first thing;
* ``renamed-local``: the first local the function assigns (not a parameter) is renamed everywhere
  in the function;
* ``new-keyword-argument``: the function gains a keyword-only ``drift_drill_option=None``;
* ``new-log-line``: the function logs one DEBUG line first thing (after its docstring);
* ``reordered-method``: a patched method moves to the end of its class.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import libcst as cst

from vllm_fix_core.backport import scratch_copy
from vllm_fix_core.declaration import Fix
from vllm_fix_core.native import SourceTree

BENIGN = ("new-config-attribute", "renamed-local", "new-keyword-argument", "new-log-line", "reordered-method")
KNOB = "drift_drill_knob"
OPTION = "drift_drill_option"
CACHE_CONFIG = "vllm/config/cache.py"


@dataclass(frozen=True)
class Semantic:
    """The bug's line of one fix changed the way an upstream fix changes it: in `module`'s file,
    `old` (which must occur exactly once) becomes `new`; the fix must then answer `expected`."""

    fix_id: str
    module: str
    old: str
    new: str
    expected: str
    why: str


SEMANTIC = (
    Semantic(
        "listener-port",
        "vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_common",
        "local_kv_port=get_open_port()",
        "local_kv_port=0",
        "refused",
        "half of #60641's rule: MORI's listener now binds port 0, but the worker still publishes "
        "the config's port (0) rather than the one its listener bound: the probe still sees the "
        "bug, and the fix does not recognise the changed line, so it says so (refused, the bug "
        "seen) instead of reading it as 'affected → fixed'",
    ),
)


def _rewrite(path: Path, text: str) -> None:
    # The copy is hard-linked to the installed vLLM: replace the file, never write through it.
    path.unlink()
    path.write_text(text, encoding="utf-8")


class _Renamer(cst.CSTTransformer):
    """Renames the Name `old` to `new` in expression positions (not attributes, not keywords)."""

    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new

    def leave_Name(self, original: cst.Name, updated: cst.Name) -> cst.Name:
        return updated.with_changes(value=self.new) if updated.value == self.old else updated

    def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute) -> cst.Attribute:
        return updated.with_changes(attr=original.attr)

    def leave_Arg(self, original: cst.Arg, updated: cst.Arg) -> cst.Arg:
        return updated.with_changes(keyword=original.keyword)


class _FirstLocal(cst.CSTVisitor):
    def __init__(self, params: set[str]) -> None:
        self.params = params
        self.found: str | None = None
        self.declared: set[str] = set()

    def visit_Global(self, node: cst.Global) -> None:
        self.declared.update(n.name.value for n in node.names)

    def visit_Nonlocal(self, node: cst.Nonlocal) -> None:
        self.declared.update(n.name.value for n in node.names)

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return self.found is None

    def visit_Assign(self, node: cst.Assign) -> None:
        for target in node.targets:
            if self.found is None and isinstance(target.target, cst.Name):
                name = target.target.value
                if name not in self.params and name != "_":
                    self.found = name


def _params(node: cst.FunctionDef) -> set[str]:
    p = node.params
    names = [x.name.value for x in (*p.posonly_params, *p.params, *p.kwonly_params)]
    for star in (p.star_arg, p.star_kwarg):
        if isinstance(star, cst.Param):
            names.append(star.name.value)
    return set(names)


def _after_docstring(body: Sequence[cst.BaseStatement]) -> int:
    if body and isinstance(body[0], cst.SimpleStatementLine):
        first = body[0].body[0]
        if isinstance(first, cst.Expr) and isinstance(
            first.value, (cst.SimpleString, cst.ConcatenatedString)
        ):
            return 1
    return 0


def _insert_first(node: cst.FunctionDef, statement: str) -> cst.FunctionDef:
    body = node.body
    if not isinstance(body, cst.IndentedBlock):
        return node
    stmts = list(body.body)
    at = _after_docstring(stmts)
    stmts.insert(at, cst.parse_statement(statement))
    return node.with_changes(body=body.with_changes(body=stmts))


class _Drift(cst.CSTTransformer):
    def __init__(self, qualnames: set[str], drifts: set[str], classes: set[str], has_logger: bool) -> None:
        self.qualnames = qualnames
        self.drifts = drifts
        self.classes = classes  # patched classes: their __init__ reads the new config attribute
        self.has_logger = has_logger
        self.stack: list[str] = []
        self.changed: list[str] = []

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self.stack.append(node.name.value)

    def leave_ClassDef(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.ClassDef:
        qual = ".".join(self.stack)
        self.stack.pop()
        if "reordered-method" not in self.drifts or not isinstance(updated.body, cst.IndentedBlock):
            return updated
        body = list(updated.body.body)
        moved = [
            s
            for s in body
            if isinstance(s, cst.FunctionDef)
            and f"{qual}.{s.name.value}" in self.qualnames
            and s is not body[-1]
        ]
        if not moved:
            return updated
        self.changed += [f"reordered-method {qual}.{s.name.value}" for s in moved]
        rest = [s for s in body if not any(s is m for m in moved)]
        return updated.with_changes(body=updated.body.with_changes(body=[*rest, *moved]))

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.stack.append(node.name.value)

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> cst.FunctionDef:
        qual = ".".join(self.stack)
        self.stack.pop()
        owner = ".".join(self.stack)
        if (
            "new-config-attribute" in self.drifts
            and updated.name.value == "__init__"
            and owner in self.classes
            and "vllm_config" in _params(updated)
        ):
            updated = _insert_first(updated, f"self._{KNOB} = vllm_config.cache_config.{KNOB}\n")
            self.changed.append(f"new-config-attribute {qual}")
        if qual not in self.qualnames:
            return updated
        if "renamed-local" in self.drifts:
            finder = _FirstLocal(_params(updated))
            updated.body.visit(finder)
            if finder.found is not None and finder.found not in finder.declared:
                new_body = updated.body.visit(_Renamer(finder.found, f"{finder.found}_drifted"))
                assert isinstance(new_body, cst.BaseSuite)
                updated = updated.with_changes(body=new_body)
                self.changed.append(f"renamed-local {qual}: {finder.found}")
        if "new-keyword-argument" in self.drifts:
            p = updated.params
            option = cst.Param(
                cst.Name(OPTION),
                default=cst.Name("None"),
                equal=cst.AssignEqual(cst.SimpleWhitespace(""), cst.SimpleWhitespace("")),
            )
            star = p.star_arg if isinstance(p.star_arg, (cst.Param, cst.ParamStar)) else cst.ParamStar()
            updated = updated.with_changes(
                params=p.with_changes(star_arg=star, kwonly_params=[*p.kwonly_params, option])
            )
            self.changed.append(f"new-keyword-argument {qual}")
        if "new-log-line" in self.drifts:
            log = "logger" if self.has_logger else '__import__("logging").getLogger(__name__)'
            updated = _insert_first(updated, f'{log}.debug("drift drill: %s", "{qual}")\n')
            self.changed.append(f"new-log-line {qual}")
        return updated


def _add_knob(root: Path) -> None:
    path = root / CACHE_CONFIG
    module = cst.parse_module(path.read_text(encoding="utf-8"))

    class AddField(cst.CSTTransformer):
        def leave_ClassDef(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.ClassDef:
            if updated.name.value != "CacheConfig" or not isinstance(updated.body, cst.IndentedBlock):
                return updated
            body = list(updated.body.body)
            # After the last annotated field: a field with a default, as a release adds one.
            last = max((i for i, s in enumerate(body) if _is_field(s)), default=len(body) - 1)
            body.insert(last + 1, cst.parse_statement(f"{KNOB}: int = 0\n"))
            return updated.with_changes(body=updated.body.with_changes(body=body))

    _rewrite(path, module.visit(AddField()).code)


def _is_field(statement: cst.BaseStatement) -> bool:
    return isinstance(statement, cst.SimpleStatementLine) and isinstance(statement.body[0], cst.AnnAssign)


def targets_by_module(fixes: Iterable[Fix]) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for fix in fixes:
        for target in fix.targets:
            found.setdefault(target.module, set()).add(target.qualname)
    return found


def drifted_tree(
    tree: SourceTree, fixes: Iterable[Fix], drifts: Iterable[str], dest: Path
) -> tuple[SourceTree, list[str]]:
    """A scratch copy of `tree` under `dest` with `drifts` (names from :data:`BENIGN`) made in
    every patched target of `fixes`; returns it and one line per change made."""
    drifts = set(drifts)
    unknown = drifts - set(BENIGN)
    if unknown:
        raise ValueError(f"unknown drifts {sorted(unknown)}; known: {', '.join(BENIGN)}")
    copy = scratch_copy(tree, dest)
    changed: list[str] = []
    if "new-config-attribute" in drifts:
        _add_knob(copy.root)
    for module, qualnames in sorted(targets_by_module(fixes).items()):
        path = copy.path_of(module)
        if not path.exists():
            continue
        text = path.read_text(encoding="utf-8")
        classes = {q.rsplit(".", 1)[0] for q in qualnames if "." in q}
        transformer = _Drift(qualnames, drifts, classes, has_logger="\nlogger = " in text)
        new = cst.parse_module(text).visit(transformer).code
        if new != text:
            _rewrite(path, new)
            changed += [f"{module}: {line}" for line in transformer.changed]
    return copy, changed


def semantic_tree(tree: SourceTree, change: Semantic, dest: Path) -> SourceTree:
    """A scratch copy of `tree` under `dest` with `change` made (its `old` text must occur once)."""
    copy = scratch_copy(tree, dest)
    path = copy.path_of(change.module)
    text = path.read_text(encoding="utf-8")
    if text.count(change.old) != 1:
        raise ValueError(f"{change.module}: {change.old!r} occurs {text.count(change.old)} times, not once")
    _rewrite(path, text.replace(change.old, change.new))
    return copy


__all__ = [
    "BENIGN",
    "SEMANTIC",
    "Semantic",
    "drifted_tree",
    "semantic_tree",
    "targets_by_module",
]
