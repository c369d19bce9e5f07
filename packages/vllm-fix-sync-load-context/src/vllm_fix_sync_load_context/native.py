"""The native carry: the FULL-replay branch of the V2 runner opens the step's forward context.

One change, to ``vllm/v1/worker/gpu/model_runner.py``, ``GPUModelRunner.execute_model``: in
the branch that replays a FULL CUDA graph, the connector call
(``self.kv_connector.pre_forward(...)``, as the tree writes it) runs inside a
``with set_forward_context(...)`` that closes before the replay. The context is the one the
tree's own other branch opens for the same step (its attention metadata, token count, DP
counts, slot mapping and whatever else the tree passes there), told
``cudagraph_runtime_mode=CUDAGraphMode.FULL`` and described by the FULL graph's batch
descriptor: the other branch's ``BatchDescriptor(...)`` with the padded request count
(``num_reqs=<batch>.num_reqs_after_padding``), and the step's ``is_padding`` mask where the
tree's ``set_forward_context`` takes one and the other branch does not pass it.

The tree is recognised by the runtime patch's own checks (``patch.full_branch_problem`` for
0.32 on, ``shapes.caller_recipe`` for 0.15-0.31, and that ``pre_forward`` / ``_start_load_kv``
start loads in an already open context), run on function objects compiled from the tree's
source (never executed).
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Sequence

import libcst as cst

from vllm_fix_core import cst as c
from vllm_fix_core.fingerprint import parse_source
from vllm_fix_core.native import CannotCarry, NativeEdit, SourceTree, marker
from vllm_fix_sync_load_context import patch, shapes
from vllm_fix_sync_load_context.declaration import MODULE as KV_CONNECTOR

PR = 60636
RUNNER = "vllm.v1.worker.gpu.model_runner"
INPUT_BATCH = "vllm.v1.worker.gpu.input_batch"
FORWARD_CONTEXT = "vllm.forward_context"
EXECUTE = "GPUModelRunner.execute_model"
PRE_FORWARD = "self.kv_connector.pre_forward"
MARK = marker("sync-load-context", PR, "FULL-replay loads see the step's context")


def _method(tree: SourceTree, module: str, qualname: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
    node = c.ast_of(tree.read(module), qualname)
    if isinstance(node, ast.ClassDef):
        raise CannotCarry(f"{qualname} is a class, not a method")
    return node


def recognize(tree: SourceTree) -> str:
    """The runtime's shape name for the tree ("batch-in-arguments" or patch.CALLER_SHAPE), or
    CannotCarry where the runtime fix would refuse it."""
    connector = tree.read(KV_CONNECTOR)
    if "ActiveKVConnector" not in c.module_names(connector):
        raise CannotCarry(f"{tree.relpath(KV_CONNECTOR)} has no ActiveKVConnector")
    params = c.param_names(_method(tree, KV_CONNECTOR, "ActiveKVConnector.pre_forward"))
    execute = tree.function(RUNNER, EXECUTE)
    pre_forward = tree.function(KV_CONNECTOR, "ActiveKVConnector.pre_forward")
    has_start = "_start_load_kv" in c.class_names_defined(_class(tree, KV_CONNECTOR, "ActiveKVConnector"))
    start_load = tree.function(KV_CONNECTOR, "ActiveKVConnector._start_load_kv") if has_start else None
    if params in shapes.BATCH_IN_CALLER:
        recipe = shapes.caller_recipe(execute, pre_forward)
        if isinstance(recipe, str):
            raise CannotCarry(f"pre_forward carries no input batch and {recipe}")
        funcs = (pre_forward,) if start_load is None else (pre_forward, start_load)
        if "start_load_kv" not in c.function_code(connector, "ActiveKVConnector.pre_forward") or not (
            patch._uses_open_context(*funcs)
        ):
            raise CannotCarry("pre_forward does not start loads in an already open forward context")
        return patch.CALLER_SHAPE
    if params != patch.PRE_FORWARD_PARAMS:
        raise CannotCarry(f"pre_forward{tuple(params)} is not a shape this fix knows (see shapes.py)")
    if start_load is None:
        raise CannotCarry("ActiveKVConnector._start_load_kv is not defined on the class")
    problem = patch.full_branch_problem(execute)
    if problem:
        raise CannotCarry(problem)
    if not patch._uses_open_context(start_load):
        raise CannotCarry("_start_load_kv does not use an already open forward context")
    return "batch-in-arguments"


def _class(tree: SourceTree, module: str, name: str) -> ast.ClassDef:
    node = c.ast_of(tree.read(module), name)
    if not isinstance(node, ast.ClassDef):
        raise CannotCarry(f"{name} is not a class")
    return node


def _context_params(tree: SourceTree) -> set[str]:
    for stmt in parse_source(tree.read(FORWARD_CONTEXT)).body:
        if isinstance(stmt, ast.FunctionDef) and stmt.name == "set_forward_context":
            return set(c.param_names(stmt))
    raise CannotCarry(f"{tree.relpath(FORWARD_CONTEXT)} defines no set_forward_context")


# --- the change (libcst) --------------------------------------------------------------------


def _is_pre_forward(stmt: cst.CSTNode) -> bool:
    if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
        return False
    expr = stmt.body[0]
    return (
        isinstance(expr, cst.Expr)
        and isinstance(expr.value, cst.Call)
        and c.dotted(expr.value.func) == PRE_FORWARD
    )


def _calls_pre_forward(node: cst.CSTNode) -> bool:
    found: list[bool] = []

    class _Find(cst.CSTVisitor):
        def visit_Call(self, call: cst.Call) -> None:
            if c.dotted(call.func) == PRE_FORWARD:
                found.append(True)

    node.visit(_Find())
    return bool(found)


def _context_with(orelse: Sequence[cst.BaseStatement]) -> cst.With:
    """The other branch's `with set_forward_context(...)` around its pre_forward."""
    found = [
        s
        for s in orelse
        if isinstance(s, cst.With)
        and len(s.items) == 1
        and isinstance(s.items[0].item, cst.Call)
        and c.dotted(s.items[0].item.func).endswith("set_forward_context")
        and _calls_pre_forward(s.body)
    ]
    if len(found) != 1:
        raise CannotCarry(
            f"{EXECUTE}: {len(found)} set_forward_context blocks calling pre_forward in the other branch"
        )
    return found[0]


def _keyword(call: cst.Call, name: str) -> cst.Arg | None:
    return next((a for a in call.args if a.keyword is not None and a.keyword.value == name), None)


def _with_arg_after(call: cst.Call, after: str | None, new: cst.Arg) -> cst.Call:
    """`call` with `new` inserted after the keyword `after` (at the end when None), written
    in the call's own layout (the separator of the argument before it)."""
    args = list(call.args)
    at = (
        len(args)
        if after is None
        else next(i for i, a in enumerate(args) if a.keyword and a.keyword.value == after) + 1
    )
    before = args[at - 1]
    if at == len(args):
        # The last argument: the new one takes its comma (or none), it takes the one before it.
        sep = args[-2].comma if len(args) > 1 else cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
        args[-1] = before.with_changes(comma=sep)
        args.append(new.with_changes(comma=before.comma))
    else:
        args.insert(at, new.with_changes(comma=before.comma))
    return call.with_changes(args=args)


def _arg(name: str, value: str) -> cst.Arg:
    return cst.Arg(
        keyword=cst.Name(name),
        value=cst.parse_expression(value),
        equal=cst.AssignEqual(
            whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")
        ),
    )


def _assigned_names(stmts: Sequence[ast.stmt]) -> set[str]:
    return {
        n.id for s in stmts for n in ast.walk(s) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
    }


def _names_read(node: cst.CSTNode) -> set[str]:
    code = cst.Module(body=[]).code_for_node(node)
    return {
        n.id for n in ast.walk(ast.parse("(" + code.strip() + "\n)", mode="eval")) if isinstance(n, ast.Name)
    }


class _CarryFull(cst.CSTTransformer):
    def __init__(self, takes: set[str], batch: str) -> None:
        self.takes, self.batch, self.done = takes, batch, 0

    def leave_If(self, original_node: cst.If, updated_node: cst.If) -> cst.If:
        if not isinstance(updated_node.body, cst.IndentedBlock):
            return updated_node
        body = list(updated_node.body.body)
        pre = [i for i, s in enumerate(body) if _is_pre_forward(s)]
        if not pre or not isinstance(updated_node.orelse, cst.Else):
            return updated_node
        if not isinstance(updated_node.orelse.body, cst.IndentedBlock):
            raise CannotCarry(f"{EXECUTE}: the other branch is not an indented block")
        orelse = list(updated_node.orelse.body.body)
        if not any(_calls_pre_forward(s) for s in orelse):
            return updated_node
        if len(pre) != 1:
            raise CannotCarry(f"{EXECUTE}: the FULL branch calls pre_forward {len(pre)} times")
        self.done += 1
        other = _context_with(orelse)
        assert isinstance(other.items[0].item, cst.Call)
        call = self._full_call(other.items[0].item, orelse)
        stmts = list(body)
        at = pre[0]
        connector_call = stmts[at]
        assert isinstance(connector_call, cst.SimpleStatementLine)  # _is_pre_forward
        descriptor = self._descriptor(call, orelse)
        with_stmt = other.with_changes(
            items=[other.items[0].with_changes(item=call)],
            body=other.body.with_changes(body=[connector_call.with_changes(leading_lines=[])]),
        )
        # The FULL graph's descriptor, then the connector call in the step's context; the
        # call's own comments, then the fix's, stay in front.
        stmts[at : at + 1] = [
            descriptor.with_changes(leading_lines=[*connector_call.leading_lines, c.comment_line(MARK)]),
            with_stmt.with_changes(leading_lines=[]),
        ]
        return updated_node.with_changes(body=updated_node.body.with_changes(body=stmts))

    def _full_call(self, call: cst.Call, orelse: Sequence[cst.BaseStatement]) -> cst.Call:
        mode = _keyword(call, "cudagraph_runtime_mode")
        if mode is None:
            raise CannotCarry(
                f"{EXECUTE}: the other branch's set_forward_context passes no cudagraph_runtime_mode"
            )
        args = [
            a.with_changes(value=cst.parse_expression("CUDAGraphMode.FULL")) if a is mode else a
            for a in call.args
        ]
        call = call.with_changes(args=args)
        if "is_padding" in self.takes and _keyword(call, "is_padding") is None:
            call = _with_arg_after(call, None, _arg("is_padding", f"{self.batch}.is_padding"))
        # Every name the FULL branch's context reads must be bound before the branch (not only
        # in the other one), except batch_descriptor, which the FULL branch builds itself.
        local = _assigned_names(_ast_statements(orelse)) - {"batch_descriptor"}
        used = {n for a in call.args for n in _names_read(a.value)}
        if local & used:
            raise CannotCarry(
                f"{EXECUTE}: the other branch's context reads {sorted(local & used)}, "
                "bound only in that branch"
            )
        return call

    def _descriptor(self, call: cst.Call, orelse: Sequence[cst.BaseStatement]) -> cst.SimpleStatementLine:
        """The FULL graph's `batch_descriptor = BatchDescriptor(...)`: the other branch's, with
        the padded request count."""
        arg = _keyword(call, "batch_descriptor")
        if arg is None or not (isinstance(arg.value, cst.Name) and arg.value.value == "batch_descriptor"):
            raise CannotCarry(f"{EXECUTE}: the other branch's set_forward_context passes no batch_descriptor")
        assigns = [s for s in orelse if isinstance(s, cst.SimpleStatementLine) and _assigns_descriptor(s)]
        if len(assigns) != 1:
            raise CannotCarry(f"{EXECUTE}: the other branch assigns batch_descriptor {len(assigns)} times")
        stmt = assigns[0]
        assign = stmt.body[0]
        assert isinstance(assign, cst.Assign) and isinstance(assign.value, cst.Call)
        built = assign.value
        if c.dotted(built.func) != "BatchDescriptor" or _keyword(built, "num_tokens") is None:
            raise CannotCarry(f"{EXECUTE}: batch_descriptor is not BatchDescriptor(num_tokens=...)")
        if _keyword(built, "num_reqs") is not None:
            raise CannotCarry(f"{EXECUTE}: the other branch's BatchDescriptor already passes num_reqs")
        padded = _with_arg_after(
            built, "num_tokens", _arg("num_reqs", f"{self.batch}.num_reqs_after_padding")
        )
        return stmt.with_changes(body=[assign.with_changes(value=padded)])


def _assigns_descriptor(stmt: cst.SimpleStatementLine) -> bool:
    if len(stmt.body) != 1 or not isinstance(stmt.body[0], cst.Assign):
        return False
    targets = stmt.body[0].targets
    return (
        len(targets) == 1
        and isinstance(targets[0].target, cst.Name)
        and targets[0].target.value == "batch_descriptor"
    )


def _ast_statements(stmts: Sequence[cst.BaseStatement]) -> list[ast.stmt]:
    body = [s for s in stmts if isinstance(s, (cst.SimpleStatementLine, cst.BaseCompoundStatement))]
    code = textwrap.dedent(cst.Module(body=body).code)
    return parse_source(code).body


def transform(tree: SourceTree) -> list[NativeEdit]:
    recognize(tree)
    takes = _context_params(tree)
    batch_fields = c.class_names_defined(_class(tree, INPUT_BATCH, "InputBatch"))
    if "num_reqs_after_padding" not in batch_fields:
        raise CannotCarry(
            "InputBatch has no num_reqs_after_padding: the FULL graph's batch descriptor cannot "
            "name its padded request count"
        )
    names = c.module_names(tree.read(RUNNER))
    missing = [n for n in ("BatchDescriptor", "CUDAGraphMode", "set_forward_context") if n not in names]
    if missing:
        raise CannotCarry(f"{tree.relpath(RUNNER)} does not import {', '.join(missing)}")

    def change(func: cst.FunctionDef) -> cst.FunctionDef:
        # The batch's name, from the other branch's context (the runtime recipe's source too).
        module_code = cst.Module(body=[]).code_for_node(func)
        contexts = [
            n
            for n in ast.walk(parse_source(textwrap.dedent(module_code)))
            if isinstance(n, ast.Call) and shapes.dotted(n.func).endswith("set_forward_context")
        ]
        batches = {
            k.value.value.id
            for n in contexts
            for k in n.keywords
            if k.arg == "num_tokens"
            and isinstance(k.value, ast.Attribute)
            and k.value.attr == "num_tokens_after_padding"
            and isinstance(k.value.value, ast.Name)
        }
        if len(batches) != 1:
            raise CannotCarry(f"{EXECUTE}: the step's input batch is not one name ({sorted(batches)})")
        carry = _CarryFull(takes, batches.pop())
        changed = func.visit(carry)
        if carry.done != 1 or not isinstance(changed, cst.FunctionDef):
            raise CannotCarry(f"{EXECUTE}: {carry.done} FULL branches calling pre_forward, expected one")
        return changed

    return [tree.edit(RUNNER, lambda s: c.change_function(s, EXECUTE, change))]


__all__ = ["recognize", "transform"]
