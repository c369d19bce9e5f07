"""The native carry: ``MoRIIOConnectorWorker._pop_done_transfers`` fails a hybrid READ closed.

One file, ``moriio_connector.py``, one method, ``MoRIIOConnectorWorker._pop_done_transfers``;
vLLM's own lines stay, four places gain lines (the ownership table of ``rule.py``):

* at its start, ``fail_closed: list[str] = []``;
* first in the branch for a FAILED batch, and first under the timeout test of the branch for a
  READ still in flight: on a hybrid model (``self._has_mamba``) the request and what went wrong
  are noted and the loop ``continue``s, so nothing is released, nothing is reported through
  ``_record_failed_recv`` and the transfer stays tracked (vLLM's attention-only handling follows
  unchanged);
* before its ``return``, still under the wrapper's lock and after vLLM has dropped the transfers
  that completed in the same poll: if any READ failed closed, one ERROR line and
  ``raise TransferError(...)`` naming them.

The tree is recognised as the runtime patch recognises the installed method
(``patch.recognize``): the method's normalized AST is exactly one of ``patch.KNOWN_SHAPES``,
read from the tree's source, and the worker has the helpers that shape calls.
"""

from __future__ import annotations

import ast

import libcst as cst

from vllm_fix_core import cst as c
from vllm_fix_core.native import CannotCarry, NativeEdit, SourceTree, marker
from vllm_fix_read_failure_ownership.declaration import MODULE
from vllm_fix_read_failure_ownership.patch import _HELPERS, KNOWN_SHAPES, TARGET

PR = 60640
QUALNAME = f"MoRIIOConnectorWorker.{TARGET}"
MARK = marker("read-failure-ownership", PR, "a hybrid READ fails closed")
# Names the written code uses from the connector module's own namespace.
MODULE_NAMES = ("TransferError", "TransferBatchState", "logger")
# The tests of the two branches the guards go into (vLLM's own code, the same in every shape).
FAILED_TEST = "state is TransferBatchState.FAILED"
TIMEOUT_TEST = "_age > _xfer_timeout"

START = """
fail_closed: list[str] = []
"""
FAILED_GUARD = """
if self._has_mamba:
    failed = next((s for s in statuses if s.Failed()), None)
    reason = "unknown"
    if failed is not None:
        reason = f"{failed.Message()} (code={failed.Code()})"
    fail_closed.append(f"{req_id}: READ failed: {reason}")
    continue
"""
TIMEOUT_GUARD = """
if self._has_mamba:
    fail_closed.append(
        f"{req_id}: READ timed out after {_age:.1f}s "
        f"(recv_abort_timeout={_xfer_timeout:.0f}s)"
    )
    continue
"""
RAISE = """
if fail_closed:
    # Hybrid: RDMA may still write into these blocks and the scheduler's
    # recovery cannot handle several KV cache groups, so nothing was
    # released or reported and the transfers stay tracked (the producer
    # reclaims its blocks through its own timeout).
    message = "MoRIIO hybrid READ cannot complete, failing the step: "
    message += "; ".join(fail_closed)
    logger.error("%s", message)
    raise TransferError(message)
"""


def recognize(tree: SourceTree) -> str:
    """The shape's name, or CannotCarry where the runtime fix would not patch the tree."""
    source = tree.read(MODULE)
    shape = c.known_shape(source, QUALNAME, KNOWN_SHAPES)
    worker = c.ast_of(source, "MoRIIOConnectorWorker")
    assert isinstance(worker, ast.ClassDef)
    missing = [name for name in _HELPERS[shape] if name not in c.class_names_defined(worker)]
    if missing:
        raise CannotCarry(f"{shape} shape without the worker helpers {missing}")
    names = c.module_names(source)
    missing = [name for name in MODULE_NAMES if name not in names]
    if missing:
        raise CannotCarry(f"{tree.relpath(MODULE)} has no module-level {', '.join(missing)}")
    return shape


class _Guards(cst.CSTTransformer):
    """The fail-closed guard first in each of the two branches (each found exactly once)."""

    def __init__(self) -> None:
        self.found = {FAILED_TEST: 0, TIMEOUT_TEST: 0}

    def leave_If(self, original_node: cst.If, updated_node: cst.If) -> cst.If:
        test = cst.Module([]).code_for_node(original_node.test)
        if test not in self.found:
            return updated_node
        self.found[test] += 1
        guard = c.statements(FAILED_GUARD if test == FAILED_TEST else TIMEOUT_GUARD)
        body = updated_node.body
        if not isinstance(body, cst.IndentedBlock):
            raise CannotCarry(f"the branch `if {test}:` has no indented body")
        return updated_node.with_changes(body=body.with_changes(body=[*guard, *body.body]))


class _RaiseBeforeReturn(cst.CSTTransformer):
    """The fail-closed raise right before the method's one ``return`` (found exactly once)."""

    def __init__(self) -> None:
        self.found = 0

    def leave_IndentedBlock(
        self, original_node: cst.IndentedBlock, updated_node: cst.IndentedBlock
    ) -> cst.IndentedBlock:
        body: list[cst.BaseStatement] = []
        for stmt in updated_node.body:
            if isinstance(stmt, cst.SimpleStatementLine) and isinstance(stmt.body[0], cst.Return):
                self.found += 1
                first, *rest = c.statements(RAISE)
                assert isinstance(first, cst.If)
                # The blank line before vLLM's return now comes before the raise.
                body += [first.with_changes(leading_lines=stmt.leading_lines), *rest]
                stmt = stmt.with_changes(leading_lines=[])
            body.append(stmt)
        return updated_node.with_changes(body=body)

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return False  # a nested function's return is its own


def _fail_closed(func: cst.FunctionDef) -> cst.FunctionDef:
    guards = _Guards()
    guarded = func.visit(guards)
    for test, count in guards.found.items():
        if count != 1:
            raise CannotCarry(f"{QUALNAME}: {count} branches `if {test}:` where exactly one is expected")
    assert isinstance(guarded, cst.FunctionDef)
    raises = _RaiseBeforeReturn()
    body = c.body_statements(guarded)
    last = body[-1].visit(raises)  # vLLM returns under the wrapper's lock, in its last statement
    assert isinstance(last, cst.BaseStatement)
    result = c.with_body(guarded, [*body[:-1], last])
    if raises.found != 1:
        raise CannotCarry(f"{QUALNAME}: {raises.found} returns where exactly one is expected")
    start = c.statements(START)
    return c.prepend(result, [c.with_comment(start[0], MARK), *start[1:]])


def transform(tree: SourceTree) -> list[NativeEdit]:
    recognize(tree)
    return [tree.edit(MODULE, lambda source: c.change_function(source, QUALNAME, _fail_closed))]


__all__ = ["recognize", "transform"]
