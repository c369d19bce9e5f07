"""libcst helpers for native transformations (the `backport` extra).

libcst keeps the tree's comments and formatting: a transformation changes the functions the bug
lives in and nothing else. Every helper raises `CannotCarry` (never a libcst error) when the tree's
code is not what it expects, so the backport can say why.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Callable, Sequence

import libcst as cst

from vllm_fix_core.fingerprint import node_fingerprint, parse_source, strip_docstrings
from vllm_fix_core.native import CannotCarry

FunctionChange = Callable[[cst.FunctionDef], cst.FunctionDef]


def parse(source: str, where: str = "the module") -> cst.Module:
    try:
        return cst.parse_module(source)
    except cst.ParserSyntaxError as exc:
        raise CannotCarry(f"{where} does not parse: {exc}") from exc


def statements(code: str) -> list[cst.BaseStatement]:
    """Statements from (dedented) code text, ready to place into a body."""
    return list(cst.parse_module(textwrap.dedent(code).strip("\n") + "\n").body)


def comment_line(text: str) -> cst.EmptyLine:
    """A comment line (`text` starts with '#') to put in a statement's leading_lines."""
    return cst.EmptyLine(comment=cst.Comment(text))


def with_comment(stmt: cst.BaseStatement, text: str) -> cst.BaseStatement:
    """`stmt` with a comment line before it (after the lines already there)."""
    if isinstance(stmt, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
        return stmt.with_changes(leading_lines=[*stmt.leading_lines, comment_line(text)])
    raise TypeError(f"cannot comment a {type(stmt).__name__}")


def _body_of(node: cst.CSTNode) -> Sequence[cst.BaseStatement]:
    body = getattr(node, "body", None)
    inner = getattr(body, "body", None)
    return inner if isinstance(inner, Sequence) else ()


def find_function(module: cst.Module, qualname: str) -> cst.FunctionDef:
    """The `def` at `qualname` ("func" or "Class.method"): top level and class bodies only."""
    scope: Sequence[cst.BaseStatement] = module.body
    *parents, name = qualname.split(".")
    for parent in parents:
        klass = next((s for s in scope if isinstance(s, cst.ClassDef) and s.name.value == parent), None)
        if klass is None:
            raise CannotCarry(f"no class {parent} (looking for {qualname})")
        scope = _body_of(klass)
    found = [s for s in scope if isinstance(s, cst.FunctionDef) and s.name.value == name]
    if len(found) != 1:
        raise CannotCarry(f"{'no' if not found else 'more than one'} def {qualname}")
    return found[0]


class _Replace(cst.CSTTransformer):
    def __init__(self, target: cst.FunctionDef, new: cst.FunctionDef) -> None:
        self.target, self.new, self.done = target, new, False

    def leave_FunctionDef(
        self, original_node: cst.FunctionDef, updated_node: cst.FunctionDef
    ) -> cst.FunctionDef:
        if original_node is self.target:
            self.done = True
            return self.new
        return updated_node


def change_function(source: str, qualname: str, change: FunctionChange) -> str:
    """`source` with the function at `qualname` replaced by `change(function)`."""
    module = parse(source)
    target = find_function(module, qualname)
    replacer = _Replace(target, change(target))
    result = module.visit(replacer)
    if not replacer.done:  # pragma: no cover - find_function found it in this very tree
        raise CannotCarry(f"def {qualname} could not be replaced")
    return result.code


def function_code(source: str, qualname: str) -> str:
    """The source text of one function (to check a shape, or to show it)."""
    module = parse(source)
    return module.code_for_node(find_function(module, qualname))


def body_statements(func: cst.FunctionDef) -> list[cst.BaseStatement]:
    if not isinstance(func.body, cst.IndentedBlock):
        raise CannotCarry(f"def {func.name.value} has no indented body")
    return list(func.body.body)


def is_docstring(stmt: cst.BaseStatement) -> bool:
    """The statement is a string literal on its own line (a docstring where it comes first)."""
    if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1:
        expr = stmt.body[0]
        return isinstance(expr, cst.Expr) and isinstance(
            expr.value, (cst.SimpleString, cst.ConcatenatedString)
        )
    return False


def _docstring_count(body: Sequence[cst.BaseStatement]) -> int:
    return 1 if body and is_docstring(body[0]) else 0


def code(node: cst.CSTNode) -> str:
    """The source text of `node` as it stands (its own formatting and comments)."""
    return cst.Module(body=[]).code_for_node(node)


def with_body(func: cst.FunctionDef, body: Sequence[cst.BaseStatement]) -> cst.FunctionDef:
    if not isinstance(func.body, cst.IndentedBlock):
        raise CannotCarry(f"def {func.name.value} has no indented body")
    return func.with_changes(body=func.body.with_changes(body=list(body)))


def prepend(func: cst.FunctionDef, stmts: Sequence[cst.BaseStatement]) -> cst.FunctionDef:
    """`stmts` at the start of the function's body (after its docstring)."""
    body = body_statements(func)
    at = _docstring_count(body)
    return with_body(func, [*body[:at], *stmts, *body[at:]])


def add_after_imports(source: str, code: str, comment: str | None = None) -> str:
    """`code` (module-level definitions) placed after the module's last top-level import."""
    module = parse(source)
    body = list(module.body)
    last = -1
    for i, stmt in enumerate(body):
        if (
            isinstance(stmt, cst.SimpleStatementLine)
            and any(isinstance(s, (cst.Import, cst.ImportFrom)) for s in stmt.body)
        ) or (isinstance(stmt, cst.If) and _is_type_checking(stmt)):
            last = i
    new = statements(code)
    if not new:
        return source
    first = new[0]
    lines = [cst.EmptyLine(), cst.EmptyLine()]
    if comment is not None:
        lines.append(comment_line(comment))
    if isinstance(first, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
        new[0] = first.with_changes(leading_lines=lines)
    return module.with_changes(body=[*body[: last + 1], *new, *body[last + 1 :]]).code


def _is_type_checking(stmt: cst.If) -> bool:
    test = stmt.test
    name = test.attr.value if isinstance(test, cst.Attribute) else getattr(test, "value", None)
    return name == "TYPE_CHECKING"


def names_called(func: cst.FunctionDef) -> set[str]:
    """Dotted names called anywhere in the function (`self.x.y(...)` gives "self.x.y")."""
    found: set[str] = set()

    class _Calls(cst.CSTVisitor):
        def visit_Call(self, node: cst.Call) -> None:
            name = dotted(node.func)
            if name:
                found.add(name)

    func.visit(_Calls())
    return found


def dotted(node: cst.BaseExpression) -> str:
    """ "a.b.c" for a Name/Attribute chain; "" for anything else."""
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        inner = dotted(node.value)
        return f"{inner}.{node.attr.value}" if inner else ""
    return ""


def add_before(source: str, name: str, code: str, comment: str | None = None) -> str:
    """`code` (module-level definitions) placed right before the top-level def or class
    `name` (next to the code that uses it), two blank lines either side."""
    module = parse(source)
    body = list(module.body)
    at = next(
        (
            i
            for i, stmt in enumerate(body)
            if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)) and stmt.name.value == name
        ),
        None,
    )
    if at is None:
        raise CannotCarry(f"no top-level {name} to place the change before")
    new = statements(code)
    if not new:
        return source
    anchor = body[at]
    assert isinstance(anchor, (cst.FunctionDef, cst.ClassDef))
    first = new[0]
    blank = [cst.EmptyLine(), cst.EmptyLine()]
    lines = list(anchor.leading_lines)
    if not any(line.comment is None for line in lines):  # the blank lines sit in the block before
        lines = [*blank, *lines]
    if comment is not None:
        lines.append(comment_line(comment))
    if isinstance(first, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
        new[0] = first.with_changes(leading_lines=lines)
    new = [
        s.with_changes(leading_lines=blank)
        if i and isinstance(s, (cst.FunctionDef, cst.ClassDef)) and not s.leading_lines
        else s
        for i, s in enumerate(new)
    ]
    body[at] = anchor.with_changes(leading_lines=blank)
    return module.with_changes(body=[*body[:at], *new, *body[at:]]).code


def replace_function(
    source: str, qualname: str, change: Callable[[cst.FunctionDef], Sequence[cst.BaseStatement]]
) -> str:
    """`source` with the function at `qualname` replaced by the statements `change(function)`
    returns (e.g. the original under a private name, then the fixed function calling it)."""
    module = parse(source)
    target = find_function(module, qualname)
    new = list(change(target))

    class _Split(cst.CSTTransformer):
        done = False

        def leave_FunctionDef(
            self, original_node: cst.FunctionDef, updated_node: cst.FunctionDef
        ) -> cst.BaseStatement | cst.FlattenSentinel[cst.BaseStatement]:
            if original_node is target:
                self.done = True
                return cst.FlattenSentinel(new)
            return updated_node

    splitter = _Split()
    result = module.visit(splitter)
    if not splitter.done:  # pragma: no cover - find_function found it in this very tree
        raise CannotCarry(f"def {qualname} could not be replaced")
    return result.code


def insert_after(
    func: cst.FunctionDef, match: Callable[[cst.BaseStatement], bool], stmts: Sequence[cst.BaseStatement]
) -> cst.FunctionDef:
    """`stmts` right after the one top-level statement of the body that `match` accepts."""
    body = body_statements(func)
    found = [i for i, stmt in enumerate(body) if match(stmt)]
    if len(found) != 1:
        raise CannotCarry(
            f"def {func.name.value}: {len(found)} statements where exactly one anchors the change"
        )
    at = found[0] + 1
    return with_body(func, [*body[:at], *stmts, *body[at:]])


def calls(stmt: cst.BaseStatement, name: str) -> bool:
    """The statement is a bare call of the dotted `name` (`self.x.y(...)` on its own line)."""
    if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
        return False
    expr = stmt.body[0]
    return isinstance(expr, cst.Expr) and isinstance(expr.value, cst.Call) and dotted(expr.value.func) == name


def forwarding_call(func: cst.FunctionDef, callee: str) -> str:
    """Code of a call of `callee` passing on every parameter of `func` as it was received
    (positional ones by position, keyword-only ones by name, `*args` / `**kwargs` spread);
    the first parameter (self / cls) is left out when `callee` is an attribute of it."""
    params = func.params
    positional = [p.name.value for p in (*params.posonly_params, *params.params)]
    if positional and callee.startswith(positional[0] + "."):
        positional = positional[1:]
    args = list(positional)
    if isinstance(params.star_arg, cst.Param):
        args.append("*" + params.star_arg.name.value)
    args += [f"{p.name.value}={p.name.value}" for p in params.kwonly_params]
    if params.star_kwarg is not None:
        args.append("**" + params.star_kwarg.name.value)
    return f"{callee}({', '.join(args)})"


def ast_of(source: str, qualname: str) -> ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef:
    """The stdlib AST of the def or class at `qualname` ("name" or "Class.name"), docstrings
    stripped (the AST the runtime's shape checks read of the installed function)."""
    try:
        scope: list[ast.stmt] = parse_source(source).body
    except SyntaxError as exc:
        raise CannotCarry(f"the module does not parse: {exc}") from exc
    *parents, name = qualname.split(".")
    node: ast.stmt | None = None
    for part in [*parents, name]:
        node = next(
            (
                s
                for s in scope
                if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and s.name == part
            ),
            None,
        )
        if node is None:
            raise CannotCarry(f"no {part} (looking for {qualname})")
        scope = node.body  # type: ignore[attr-defined]
    assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    if isinstance(node, ast.ClassDef):
        return node
    return strip_docstrings(node)


def known_shape(source: str, qualname: str, known: dict[str, str]) -> str:
    """The name `known` gives the normalized-AST fingerprint of the method at `qualname` (the
    runtime's `ast_fingerprint` of the installed function); CannotCarry for any other body."""
    method = ast_of(source, qualname)
    if isinstance(method, ast.ClassDef):
        raise CannotCarry(f"{qualname} is a class, not a method")
    found = node_fingerprint(method)
    if found not in known:
        raise CannotCarry(
            f"{qualname} has normalized-AST fingerprint {found}, not one of the known shapes "
            f"{sorted(known.values())}; its body is only changed for exactly known shapes"
        )
    return known[found]


def param_names(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """A def's parameter names in order: positional, *args, keyword-only, **kwargs."""
    args = node.args
    names = [a.arg for a in (*args.posonlyargs, *args.args)]
    names += [args.vararg.arg] if args.vararg else []
    names += [a.arg for a in args.kwonlyargs]
    names += [args.kwarg.arg] if args.kwarg else []
    return names


def class_names_defined(node: ast.ClassDef) -> set[str]:
    """Names a class body defines: defs, assignments and annotated fields."""
    found: set[str] = set()
    for stmt in node.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(stmt.name)
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            found.add(stmt.target.id)
        elif isinstance(stmt, ast.Assign):
            found.update(t.id for t in stmt.targets if isinstance(t, ast.Name))
    return found


def module_names(source: str) -> set[str]:
    """Top-level names of a module: imported (as bound), defined or assigned."""
    found: set[str] = set()
    for stmt in parse_source(source).body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            found.update((a.asname or a.name).split(".")[0] for a in stmt.names)
        elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(stmt.name)
        elif isinstance(stmt, ast.Assign):
            found.update(t.id for t in stmt.targets if isinstance(t, ast.Name))
    return found


__all__ = [
    "add_after_imports",
    "add_before",
    "ast_of",
    "body_statements",
    "calls",
    "change_function",
    "class_names_defined",
    "code",
    "comment_line",
    "dotted",
    "find_function",
    "forwarding_call",
    "function_code",
    "insert_after",
    "is_docstring",
    "module_names",
    "names_called",
    "parse",
    "prepend",
    "replace_function",
    "statements",
    "with_body",
    "with_comment",
]
