"""The native carry: owner-set completion tracking written into a tree's own MultiConnector.

Changes to ``multi_connector.py`` (every MultiConnector shape the runtime fix recognises,
0.14.1 on; see ``Shape``):

* before ``class MultiConnector``: the rule's two halves as module-level code (the owner-set
  ledger of the scheduler and the gate of each worker, ``ledger.py`` / ``gate.py`` of this
  package, renamed ``_CompletionLedger`` / ``_CompletionGate``), the helpers that keep them on
  the connector, the worker's gated results and the scheduler's private views, written for
  the tree's connector output (per-child worker metadata, ``failed_recving``);
* ``MultiKVConnectorMetadata``: a field ``completion_update`` (the step's owner sets, loaders and
  scheduler-side completions, plain builtins; ``extra_async_saves`` is kept);
* the counting method (``_aggregate_request_finished``, or ``request_finished`` before 0.21.0)
  records the owner set (the children that returned True); ``register_finished_partial_tail``
  (0.30.0+) asks every child and records the ones that accept; ``get_num_new_matched_tokens``
  records a request's loader; ``build_connector_meta`` ships the update;
  ``bind_connector_metadata`` feeds it to the worker's gate (vLLM's anonymous count where none
  arrives); ``get_transfer_results`` (0.30.0+) / ``get_finished`` report through the gate once
  there is one; ``update_connector_output``'s body becomes the private-view rule.

The tree is recognised with the runtime's own fingerprints and structure checks
(``shapes.REPLACED_KNOWN``, ``shapes._STRUCTURE``, ``shapes.META_FIELDS``), read from the tree's
source: a body the runtime fix would refuse is not carried, and CannotCarry says why.
"""

from __future__ import annotations

import ast
import inspect
import re
from dataclasses import dataclass

import libcst as cst

from vllm_fix_completion_ownership import gate, ledger, rule, shapes
from vllm_fix_completion_ownership.declaration import MODULE
from vllm_fix_core import ast_fingerprint
from vllm_fix_core import cst as c
from vllm_fix_core.native import CannotCarry, NativeEdit, SourceTree, marker

PR = 60635
CLASS = "MultiConnector"
MARK_CODE = marker("completion-ownership", PR, "owner sets: free a request once, after every owner")
MARK_METHOD = marker("completion-ownership", PR, "count completions per owner")
UPDATE_FIELD = "completion_update"

# Names of the rule's code as it is written into the tree (module-private there).
RENAMES = {
    "SchedulerLedger": "_CompletionLedger",
    "WorkerGate": "_CompletionGate",
    "children_of": "_completion_children",
    "decode_update": "_completion_decode",
    "EMPTY_UPDATE": "_COMPLETION_IDLE",
    "WIRE_VERSION": "_COMPLETION_WIRE",
    "RETIRED_WINDOW": "_COMPLETION_RETIRED_WINDOW",
    "EARLY_WINDOW": "_COMPLETION_EARLY_WINDOW",
    "_CHILDREN": "_COMPLETION_MASKS",
    "_NOTHING": "_COMPLETION_NOTHING",
    "WireError": "ValueError",
}

RESULTS = '''
def _completion_results(
    connectors: list[Any], gate: _CompletionGate, finished_req_ids: set[str]
) -> KVConnectorTransferResults:
    """The children's results through the gate: a finished_sending report counts only from
    an owner of the request, the request is reported once every owner completed here;
    finished / failed recv reports only from the request's loader (where known)."""
    results = KVConnectorTransferResults()
    for index, connector in enumerate(connectors):
        child_results = connector.get_transfer_results(finished_req_ids)
        if child_results.finished_sending:
            gate.report_all(index, child_results.finished_sending)
        if child_results.finished_recving:
            results.finished_recving.update(gate.accepted_recv(index, child_results.finished_recving))
        if child_results.failed_recving:
            results.failed_recving.update(gate.accepted_recv(index, child_results.failed_recving))
    if gate.ready:
        results.finished_sending = gate.take_ready()
    return results
'''
FINISHED = '''
def _completion_finished(
    connectors: list[Any], gate: _CompletionGate, finished_req_ids: set[str]
) -> tuple[set[str] | None, set[str] | None]:
    """The children's get_finished through the gate: a finished_sending report counts only
    from an owner of the request, the request is reported once every owner completed here;
    recv reports only from the request's loader (where known)."""
    finished_recving: set[str] = set()
    for index, connector in enumerate(connectors):
        sending, recving = connector.get_finished(finished_req_ids)
        if sending:
            gate.report_all(index, sending)
        if recving:
            finished_recving.update(gate.accepted_recv(index, recving))
    sent = gate.take_ready() if gate.ready else None
    return sent or None, finished_recving or None
'''

HELPERS = '''
def _completion_ledger(connector: Any) -> _CompletionLedger:
    """The scheduler-side ledger of a MultiConnector (made on first use)."""
    found = connector.__dict__.get("_completion_ledger_state")
    if found is None:
        found = connector.__dict__["_completion_ledger_state"] = _CompletionLedger(
            len(connector._connectors)
        )
    return found


def _completion_gate(connector: Any) -> _CompletionGate | None:
    """The worker-side gate of a MultiConnector; None until the scheduler's first update."""
    return connector.__dict__.get("_completion_gate_state")


def _completion_feed(connector: Any, update: dict[str, Any]) -> bool:
    """Apply the scheduler's update to this worker's gate; False where it cannot be read
    (the worker then keeps vLLM's anonymous count)."""
    found = connector.__dict__.get("_completion_gate_state")
    if found is None:
        found = connector.__dict__["_completion_gate_state"] = _CompletionGate()
    try:
        found.apply_update(update)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        connector.__dict__["_completion_gate_state"] = None
        logger.warning("MultiConnector: unreadable completion update (%r); counting anonymously", exc)
        return False
    return True


{worker}

def _completion_view(ids: set[str] | None, loaders: dict[str, int], child: int) -> set[str]:
    return {r for r in ids if loaders.get(r, child) == child} if ids else set()


def _completion_edits(
    final: set[str], view: set[str], returned: set[str] | None, loaders: dict[str, int], child: int
) -> None:
    """A child may hold back or add recv ids it loads; ids it does not load stay as they are."""
    returned = returned or set()
    for req_id in view - returned:
        if loaders.get(req_id) == child:
            final.discard(req_id)
    for req_id in returned - view:
        if loaders.get(req_id, child) == child:
            final.add(req_id)


def _completion_update_output(connector: Any, connector_output: KVConnectorOutput) -> None:
    """Each child sees a private view of the step's output (the send ids it owns and has not
    let go, the recv ids it loads); what it hands back is its completion; a request reaches
    finished_sending once every owner completed on every worker."""
    ledger = _completion_ledger(connector)
    multi_meta = connector_output.kv_connector_worker_meta  #[meta]
    if multi_meta is not None:  #[meta]
        assert isinstance(multi_meta, MultiKVConnectorWorkerMetadata)  #[meta]
    if connector_output.finished_sending:
        ledger.note_workers_done(connector_output.finished_sending)
    loaders: dict[str, int] = connector._requests_to_connector
    recv = connector_output.finished_recving
    failed = connector_output.failed_recving  #[failed]
    final_recv: set[str] = set(recv) if recv else set()
    final_failed: set[str] = set(failed) if failed else set()  #[failed]
    try:
        for index, child in enumerate(connector._connectors):
            if multi_meta is not None:  #[meta]
                connector_output.kv_connector_worker_meta = multi_meta.metadata[index]  #[meta]
            connector_output.finished_sending = ledger.view(index)
            view_recv = _completion_view(recv, loaders, index)
            view_failed = _completion_view(failed, loaders, index)  #[failed]
            connector_output.finished_recving = view_recv or None
            connector_output.failed_recving = view_failed  #[failed]
            child.update_connector_output(connector_output)
            returned = connector_output.finished_sending
            if returned:
                ledger.let_go(index, returned)  # ids it does not own are ignored
            _completion_edits(final_recv, view_recv, connector_output.finished_recving, loaders, index)
            failed_edits = connector_output.failed_recving  #[failed]
            _completion_edits(final_failed, view_failed, failed_edits, loaders, index)  #[failed]
    finally:
        connector_output.kv_connector_worker_meta = multi_meta  #[meta]
        connector_output.finished_recving = final_recv or None
        connector_output.failed_recving = final_failed  #[failed]
    for req_id in final_recv:
        if req_id in ledger.entries:
            # vLLM frees this finished request through its recv path: never a second time.
            ledger.release(req_id)
    connector_output.finished_sending = ledger.surface() if ledger.done or ledger.ready else None
'''

AGGREGATE_RECORD = "_completion_ledger(self).record_finished({request}.request_id, owners)"


def _fields(node: ast.ClassDef) -> list[str]:
    return [s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]


@dataclass(frozen=True)
class Shape:
    """Where this tree's MultiConnector counts, and what its connector output carries."""

    counting: str  # "_aggregate_request_finished" (0.21.0+) or "request_finished"
    worker: str  # "get_transfer_results" (0.30.0+) or "get_finished"
    per_child_meta: bool  # each child gets its own worker metadata (0.18.1+)
    has_failed: bool  # KVConnectorOutput.failed_recving (0.30.0+)
    partial_tail: bool  # register_finished_partial_tail (0.30.0+)

    def changes(self) -> list[tuple[str, c.FunctionChange]]:
        found: list[tuple[str, c.FunctionChange]] = [
            (self.counting, _aggregate),
            ("get_num_new_matched_tokens", _matched),
            ("build_connector_meta", _build_meta),
            ("bind_connector_metadata", _bind),
            (self.worker, _gated_worker(self.worker)),
            ("update_connector_output", _update_output),
        ]
        if self.partial_tail:
            found.insert(1, ("register_finished_partial_tail", _partial_tail))
        return found

    def module_names(self) -> list[str]:
        names = ["Any", "Iterable", "KVConnectorOutput", "MultiKVConnectorMetadata", "logger"]
        names += ["KVConnectorTransferResults"] if self.worker == "get_transfer_results" else []
        names += ["MultiKVConnectorWorkerMetadata"] if self.per_child_meta else []
        return names


def _fingerprint_known(tree: SourceTree, name: str) -> str:
    found = ast_fingerprint(tree.function(MODULE, f"{CLASS}.{name}"))
    if found not in shapes.REPLACED_KNOWN[name]:
        raise CannotCarry(
            f"MultiConnector.{name} changed (fingerprint {found}, known "
            f"{sorted(shapes.REPLACED_KNOWN[name])}); it is rewritten, so only a known shape is carried"
        )
    return found


def _check_structure(source: str, defined: set[str]) -> None:
    """The runtime's structure checks of the methods it re-implements or wraps."""
    for name, (params, needle) in shapes._STRUCTURE.items():
        if name not in defined:
            if name == "_aggregate_request_finished":
                continue
            raise CannotCarry(f"MultiConnector.{name} is not defined on the class")
        method = c.ast_of(source, f"{CLASS}.{name}")
        assert not isinstance(method, ast.ClassDef)
        if c.param_names(method) != params or needle not in c.function_code(source, f"{CLASS}.{name}"):
            raise CannotCarry(f"MultiConnector.{name} no longer has the expected structure ({needle!r})")


def recognize(tree: SourceTree) -> Shape:
    """The tree's shape, or CannotCarry where the runtime fix would refuse it (the same
    fingerprints and structure checks as ``shapes.recognize``, read from the tree's source)."""
    source = tree.read(MODULE)
    meta = c.ast_of(source, "MultiKVConnectorMetadata")
    klass = c.ast_of(source, CLASS)
    assert isinstance(meta, ast.ClassDef) and isinstance(klass, ast.ClassDef)
    if _fields(meta) != shapes.META_FIELDS:
        raise CannotCarry(
            f"MultiKVConnectorMetadata fields are {_fields(meta)}, expected {shapes.META_FIELDS}"
        )
    defined = c.class_names_defined(klass)
    counting = "_aggregate_request_finished"
    if counting not in defined:
        # vLLM 0.14.1-0.20.2: request_finished counts the children itself.
        if "request_finished_all_groups" in defined:
            raise CannotCarry(
                "MultiConnector has request_finished_all_groups but no _aggregate_request_finished"
            )
        _fingerprint_known(tree, "request_finished")
        counting = "request_finished"
    _check_structure(source, defined)
    per_child = _fingerprint_known(tree, "update_connector_output") not in shapes.SHARED_OUTPUT_KNOWN
    partial_tail = "register_finished_partial_tail" in defined
    if partial_tail:
        _fingerprint_known(tree, "register_finished_partial_tail")
    worker = "get_finished"
    if "get_transfer_results" in defined:
        _fingerprint_known(tree, "get_transfer_results")
        if "self.get_transfer_results(" not in c.function_code(source, f"{CLASS}.get_finished"):
            raise CannotCarry("MultiConnector.get_finished does not delegate to get_transfer_results")
        worker = "get_transfer_results"
    else:
        _fingerprint_known(tree, "get_finished")
    output = c.ast_of(tree.read("vllm.v1.outputs"), "KVConnectorOutput")
    assert isinstance(output, ast.ClassDef)
    shape = Shape(counting, worker, per_child, "failed_recving" in _fields(output), partial_tail)
    names = c.module_names(source)
    missing = [n for n in shape.module_names() if n not in names]
    if missing:
        raise CannotCarry(f"{tree.relpath(MODULE)} has no module-level {', '.join(missing)}")
    if "_CompletionLedger" in names:
        raise CannotCarry(f"{tree.relpath(MODULE)} already defines _CompletionLedger")
    return shape


def rule_code(shape: Shape) -> str:
    """The rule's code (this package's ``rule.py`` / ``ledger.py`` / ``gate.py``) as the tree's
    module-level code, then the helpers that attach it to MultiConnector."""
    constants = "\n".join(
        (
            f"_COMPLETION_WIRE = {rule.WIRE_VERSION}",
            "# The update of a step with nothing to ship: one shared object, never mutated.",
            '_COMPLETION_IDLE: dict[str, Any] = {"v": _COMPLETION_WIRE}',
            "_COMPLETION_NOTHING: dict[str, Any] = {}",
            "_COMPLETION_MASKS: dict[int, tuple[int, ...]] = {}",
            f"_COMPLETION_RETIRED_WINDOW = {gate.RETIRED_WINDOW}  # steps a settled id is remembered",
            f"_COMPLETION_EARLY_WINDOW = {gate.EARLY_WINDOW}  # steps a report before its owners is kept",
        )
    )
    parts = [
        constants,
        inspect.getsource(rule.children_of),
        inspect.getsource(rule.decode_update),
        inspect.getsource(ledger.SchedulerLedger),
        inspect.getsource(gate.WorkerGate),
    ]
    code = "\n\n\n".join(p.strip("\n") for p in parts) + "\n"
    for old, new in RENAMES.items():
        code = re.sub(rf"\b{old}\b", new, code)
    code = code.replace("(see ``rule.py``)", "")
    worker = RESULTS if shape.worker == "get_transfer_results" else FINISHED
    helpers = HELPERS.replace("{worker}", worker.strip("\n"))
    kept = []
    for line in helpers.strip("\n").splitlines():
        tag = re.search(r"  #\[(meta|failed)\]$", line)
        if tag is None:
            kept.append(line)
        elif shape.per_child_meta if tag.group(1) == "meta" else shape.has_failed:
            kept.append(line[: tag.start()])
    return code + "\n\n" + "\n".join(kept) + "\n"


# --- method changes ---------------------------------------------------------------------------


def _stmt(code: str) -> cst.BaseStatement:
    (only,) = c.statements(code)
    return only


def _code(stmt: cst.BaseStatement) -> str:
    """A statement's code without the comment lines before it."""
    if isinstance(stmt, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
        stmt = stmt.with_changes(leading_lines=[])
    return cst.Module(body=[]).code_for_node(stmt).strip()


def _marked(stmts: list[cst.BaseStatement]) -> list[cst.BaseStatement]:
    return [c.with_comment(stmts[0], MARK_METHOD), *stmts[1:]]


class _OwnersLoop(cst.CSTTransformer):
    """`for c in self._connectors:` -> `for index, c in enumerate(...)`, and `owners |= 1 << index`
    where a child's answer says it keeps the blocks (`if async_save:`)."""

    def __init__(self) -> None:
        self.loops = self.marks = 0

    def leave_For(self, original_node: cst.For, updated_node: cst.For) -> cst.For:
        if c.dotted(updated_node.iter) != "self._connectors" or not isinstance(updated_node.target, cst.Name):
            return updated_node
        self.loops += 1
        target = cst.parse_expression(f"(index, {updated_node.target.value})")
        assert isinstance(target, cst.Tuple)
        return updated_node.with_changes(
            target=target.with_changes(lpar=[], rpar=[]),
            iter=cst.parse_expression("enumerate(self._connectors)"),
        )

    def leave_If(self, original_node: cst.If, updated_node: cst.If) -> cst.If:
        if not (isinstance(updated_node.test, cst.Name) and updated_node.test.value == "async_save"):
            return updated_node
        if not isinstance(updated_node.body, cst.IndentedBlock):
            return updated_node
        self.marks += 1
        body = [*updated_node.body.body, _stmt("owners |= 1 << index")]
        return updated_node.with_changes(body=updated_node.body.with_changes(body=body))


def _aggregate(func: cst.FunctionDef) -> cst.FunctionDef:
    request = func.params.params[1].name.value
    taken = re.findall(r"\b(index|owners)\b", cst.Module(body=[]).code_for_node(func))
    if taken:
        raise CannotCarry(f"MultiConnector.{func.name.value} already uses the name {taken[0]!r}")
    loop = _OwnersLoop()
    changed = func.visit(loop)
    assert isinstance(changed, cst.FunctionDef)
    if loop.loops != 1 or loop.marks != 1:
        raise CannotCarry(
            f"MultiConnector.{func.name.value} does not count the children's answers "
            f"in one `for c in self._connectors` loop with `if async_save:` ({loop.loops} loops, "
            f"{loop.marks} counts)"
        )
    body = c.body_statements(changed)
    loops = [i for i, s in enumerate(body) if isinstance(s, cst.For)]
    if len(loops) != 1:
        raise CannotCarry(f"MultiConnector.{func.name.value}: the loop is not a top-level statement")
    at = loops[0]
    start = _marked(c.statements("owners = 0  # the children that keep the blocks (child i is bit 1 << i)"))
    record = c.statements(AGGREGATE_RECORD.format(request=request))
    return c.with_body(changed, [*body[:at], *start, body[at], *record, *body[at + 1 :]])


def _partial_tail(func: cst.FunctionDef) -> cst.FunctionDef:
    request, blocks, offloads = (p.name.value for p in func.params.params[1:4])
    code = f"""
        ledger = _completion_ledger(self)
        accepted = False
        for index, c in enumerate(self._connectors):
            if c.register_finished_partial_tail({request}, {blocks}, {offloads}):
                ledger.accept_partial_tail({request}.request_id, index)  # an owner too
                accepted = True
        return accepted
    """
    return c.with_body(func, _marked(c.statements(code)))


class _LoaderRecord(cst.CSTTransformer):
    def __init__(self, request: str) -> None:
        self.request, self.done = request, 0

    def leave_IndentedBlock(
        self, original_node: cst.IndentedBlock, updated_node: cst.IndentedBlock
    ) -> cst.IndentedBlock:
        body = list(updated_node.body)
        needle = f"self._requests_to_connector[{self.request}.request_id] = i"
        at = [i for i, s in enumerate(body) if _code(s) == needle]
        if len(at) != 1:
            return updated_node
        self.done += 1
        record = c.statements(
            f"""
            if self._requests_to_connector.get({self.request}.request_id) != i:
                _completion_ledger(self).record_loader({self.request}.request_id, i)
            """
        )
        return updated_node.with_changes(body=[*body[: at[0]], *_marked(record), *body[at[0] :]])


def _matched(func: cst.FunctionDef) -> cst.FunctionDef:
    record = _LoaderRecord(func.params.params[1].name.value)
    changed = func.visit(record)
    if record.done != 1 or not isinstance(changed, cst.FunctionDef):
        raise CannotCarry(
            "MultiConnector.get_num_new_matched_tokens: the loader assignment is not one statement"
        )
    return changed


def _build_meta(func: cst.FunctionDef) -> cst.FunctionDef:
    body = c.body_statements(func)
    last = body[-1] if body else None
    code = _code(last) if last is not None else ""
    if not code.startswith("return "):
        raise CannotCarry("MultiConnector.build_connector_meta does not end with `return <metadata>`")
    name = code.removeprefix("return ").strip()
    if not name.isidentifier():
        raise CannotCarry("MultiConnector.build_connector_meta does not return a named metadata object")
    ship = _marked(c.statements(f"{name}.{UPDATE_FIELD} = _completion_ledger(self).take_update()"))
    return c.with_body(func, [*body[:-1], *ship, body[-1]])


def _bind(func: cst.FunctionDef) -> cst.FunctionDef:
    meta = func.params.params[1].name.value
    body = c.body_statements(func)
    needle = f"{meta}.extra_async_saves"
    at = [i for i, s in enumerate(body) if isinstance(s, cst.If) and c.dotted(s.test) == needle]
    if len(at) != 1:
        raise CannotCarry(f"MultiConnector.bind_connector_metadata: no one `if {needle}:`")
    counted = body[at[0]]
    assert isinstance(counted, cst.If)
    gated = _stmt(
        f"""
        if {meta}.{UPDATE_FIELD} is None or not _completion_feed(self, {meta}.{UPDATE_FIELD}):
            pass
        """
    )
    assert isinstance(gated, cst.If) and isinstance(gated.body, cst.IndentedBlock)
    # Owner sets arrived: the gate counts; otherwise vLLM's anonymous count, as before.
    gated = gated.with_changes(
        body=gated.body.with_changes(body=[counted.with_changes(leading_lines=[])]),
        leading_lines=[*counted.leading_lines, c.comment_line(MARK_METHOD)],
    )
    return c.with_body(func, [*body[: at[0]], gated, *body[at[0] + 1 :]])


def _gated_worker(name: str) -> c.FunctionChange:
    helper = "_completion_results" if name == "get_transfer_results" else "_completion_finished"

    def change(func: cst.FunctionDef) -> cst.FunctionDef:
        finished = func.params.params[1].name.value
        gated = c.statements(
            f"""
            gate = _completion_gate(self)
            if gate is not None:  # owner sets arrive: report each request once, after its owners
                return {helper}(self._connectors, gate, {finished})
            """
        )
        return c.prepend(func, _marked(gated))

    return change


def _update_output(func: cst.FunctionDef) -> cst.FunctionDef:
    output = func.params.params[1].name.value
    return c.with_body(func, _marked(c.statements(f"_completion_update_output(self, {output})")))


def _meta_field(source: str) -> str:
    module = c.parse(source)

    class _Field(cst.CSTTransformer):
        done = 0

        def leave_ClassDef(self, original_node: cst.ClassDef, updated_node: cst.ClassDef) -> cst.ClassDef:
            if updated_node.name.value != "MultiKVConnectorMetadata" or not isinstance(
                updated_node.body, cst.IndentedBlock
            ):
                return updated_node
            self.done += 1
            field = c.with_comment(
                _stmt(f"{UPDATE_FIELD}: dict[str, Any] | None = None"),
                marker("completion-ownership", PR, "owner sets for the workers"),
            )
            return updated_node.with_changes(
                body=updated_node.body.with_changes(body=[*updated_node.body.body, field])
            )

    adder = _Field()
    result = module.visit(adder)
    if adder.done != 1:
        raise CannotCarry("no one class MultiKVConnectorMetadata to carry the owner sets")
    return result.code


def _with_ordered_dict(source: str) -> str:
    """`from collections import OrderedDict` (the gate's memory) next to the module's imports."""
    if "OrderedDict" in c.module_names(source):
        return source
    module = c.parse(source)
    body = list(module.body)
    at = next(
        (
            i
            for i, s in enumerate(body)
            if isinstance(s, cst.SimpleStatementLine)
            and any(isinstance(x, cst.ImportFrom) for x in s.body)
            and not _code(s).startswith("from __future__")
        ),
        None,
    )
    if at is None:
        raise CannotCarry("the module has no imports to place `from collections import OrderedDict` next to")
    new = _stmt("from collections import OrderedDict")
    assert isinstance(new, cst.SimpleStatementLine)
    body.insert(at, new)
    return module.with_changes(body=body).code


def transform(tree: SourceTree) -> list[NativeEdit]:
    shape = recognize(tree)

    def change(source: str) -> str:
        for name, edit in shape.changes():
            source = c.change_function(source, f"{CLASS}.{name}", edit)
        source = _meta_field(_with_ordered_dict(source))
        return c.add_before(source, CLASS, rule_code(shape), MARK_CODE)

    return [tree.edit(MODULE, change)]


__all__ = ["Shape", "recognize", "rule_code", "transform"]
