"""The native carry: a speculative step's output covers the draft forward's KV.

Up to three files change, each in the functions the bug lives in (vLLM's own lines stay), and
one module-level helper is added next to the runner:

* ``vllm/v1/worker/gpu/async_utils.py``, ``AsyncOutput``: a ``draft_kv_event`` attribute
  (``None`` by default), and ``get_output`` synchronizes it right after ``copy_event``;
* ``vllm/v1/worker/gpu/model_runner.py``, ``GPUModelRunner.sample_tokens``: after the step's
  KV connector output is collected (once the drafter has run), if the step drafted (the
  tree's own test around ``propose()``) and ``_publishes_for_remote_read`` says the
  worker-side connector publishes blocks for a remote READ, a ``torch.cuda.Event(blocking=True)``
  is recorded on the current stream and stored as the ``AsyncOutput``'s ``draft_kv_event``;
* the same file, right before ``class GPUModelRunner``: ``_publishes_for_remote_read(connector)``,
  the runtime rule (``readiness.publishes_for_remote_read``) written out from its own class-name
  sets (``helper_code``): an explicit ``requires_full_step_completion`` decides (the opt-in
  proposed upstream, which no release defines yet); a MultiConnector asks its children;
  otherwise a KV producer of a NIXL pull connector, or of MoRIIO in READ mode, does (class names
  anywhere in the connector's MRO), and nothing else: NIXL push, MoRIIO WRITE, consumers and
  every other connector keep vLLM's overlap of the output copy with the draft forward;
* deferred-finalize shape (0.33): ``ActiveKVConnector.post_forward(..., defer_finalize=True)``
  only starts the pending async loads and returns ``None``, and ``sample_tokens`` replaces its
  ``finalize_step()`` call after the drafter with the tree's own ``post_forward`` assignment
  without ``defer_finalize``: ``wait_for_save``, one drain, clear the metadata, as a
  non-speculative step does.

The tree is recognised as the runtime patch recognises the installed runner
(``patch.shape_of``, on functions compiled from the tree's files). Where ``execute_model``
collects the output before the drafter (0.15 - 0.21) the tree is refused with the reason.

The probe observes every part with the runtime fix off: it stands in ``torch.cuda.Event`` (in
its own thread, while it runs) with its recording events, so the event ``sample_tokens``
records must come after the draft's last kernel and ``get_output`` must wait on it.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Sequence

import libcst as cst

from vllm_fix_core import UnknownShape
from vllm_fix_core import cst as c
from vllm_fix_core.native import CannotCarry, NativeEdit, SourceTree, marker
from vllm_fix_spec_kv_readiness import patch, readiness
from vllm_fix_spec_kv_readiness.declaration import ASYNC_UTILS, KV_CONNECTOR, MODEL_RUNNER

PR = 60637
SAMPLE_TOKENS = "GPUModelRunner.sample_tokens"
POST_FORWARD = "ActiveKVConnector.post_forward"
GET_OUTPUT = "AsyncOutput.get_output"
EVENT = "draft_kv_event"
OPT_IN = readiness.OPT_IN_ATTRIBUTE
HELPER = "_publishes_for_remote_read"
RUNNER_CLASS = "GPUModelRunner"

MARK_RUNNER = marker("spec-kv-readiness", PR, "a READ publisher's output waits for the draft's KV")
MARK_COLLECT = marker(
    "spec-kv-readiness", PR, "the KV output is collected after the draft; READ publishers wait for it"
)
MARK_DEFER = marker("spec-kv-readiness", PR, "the runner collects the step's output after the draft")
MARK_HELPER = marker("spec-kv-readiness", PR, "which connectors publish blocks for a remote READ")
MARK_OUTPUT = marker("spec-kv-readiness", PR, "set by sample_tokens for a READ publisher")
MARK_WAIT = marker("spec-kv-readiness", PR, "the draft's KV is written before the output is seen")

ATTRIBUTE = f"""
{EVENT}: torch.cuda.Event | None = None
"""
WAIT = f"""
if self.{EVENT} is not None:
    self.{EVENT}.synchronize()
"""
DEFER = """
if defer_finalize:
    return None
"""
# {connector}: the runner's KV connector attribute; {drafted}: the tree's own test around the
# drafter's propose(); {output}: the AsyncOutput sample_tokens builds.
RECORD = """
if {drafted} and {helper}(
    getattr({connector}, "kv_connector", None)
):
    {event} = torch.cuda.Event(blocking=True)
    {event}.record()
    {output}.{event} = {event}
"""
# The runtime rule (readiness.publishes_for_remote_read), rendered by helper_code from the
# rule's own names; `Any` is the runner module's own import.
HELPER_CODE = '''
def {helper}(connector: Any) -> bool:
    """Does this worker-side KV connector publish blocks that a remote instance READs
    once a request finishes? Then a speculative step's output must not reach the
    scheduler before the draft forward's KV is written.

    An explicit `{opt_in}` decides; a MultiConnector asks its
    children; otherwise a KV producer of a connector the remote side pulls from does
    (class names anywhere in the MRO), and nothing else.
    """
    explicit = getattr(connector, "{opt_in}", None)
    if explicit is not None:
        return bool(explicit)
    names = {{klass.__name__ for klass in type(connector).__mro__}}
    children = getattr(connector, "_connectors", None)
    if "{multi}" in names and isinstance(children, (list, tuple)):
        return any({helper}(child) for child in children)
    config = getattr(connector, "_kv_transfer_config", None) or getattr(
        connector, "kv_transfer_config", None
    )
    if not getattr(config, "is_kv_producer", False) or names & {push_only}:
        return False  # a consumer publishes nothing; a push connector writes remotely
    if names & {read_publishers}:
        return True
    if names & {mode_dependent}:
        # The remote side READs only in READ mode (in WRITE mode this side pushes).
        return getattr(getattr(connector, "mode", None), "name", None) == "{read_mode}"
    return False
'''


def _names(names: frozenset[str]) -> str:
    return "{" + ", ".join(f'"{name}"' for name in sorted(names)) + "}"


def helper_code() -> str:
    """``_publishes_for_remote_read`` as written into the tree: the runtime rule, from the same
    class-name sets."""
    return HELPER_CODE.format(
        helper=HELPER,
        opt_in=OPT_IN,
        multi=readiness.MULTI_CONNECTOR,
        push_only=_names(readiness.PUSH_ONLY),
        read_publishers=_names(readiness.READ_PUBLISHERS),
        mode_dependent=_names(readiness.MODE_DEPENDENT),
        read_mode=readiness.READ_MODE,
    )


def recognize(tree: SourceTree) -> str:
    """The runtime's shape for the tree (``patch.DEFERRED`` / ``patch.AFTER_DRAFT``), or
    CannotCarry saying what the tree lacks."""
    connector = c.ast_of(tree.read(KV_CONNECTOR), "ActiveKVConnector")
    output = c.ast_of(tree.read(ASYNC_UTILS), "AsyncOutput")
    if not isinstance(connector, ast.ClassDef) or not isinstance(output, ast.ClassDef):
        raise CannotCarry("ActiveKVConnector or AsyncOutput is not a class")
    if "post_forward" not in c.class_names_defined(connector):
        raise CannotCarry("ActiveKVConnector.post_forward is not defined on the class")
    if "get_output" not in c.class_names_defined(output):
        raise CannotCarry("AsyncOutput.get_output is not defined on the class")
    try:
        shape = patch.shape_of(
            tree.function(KV_CONNECTOR, POST_FORWARD),
            tree.function(MODEL_RUNNER, SAMPLE_TOKENS),
            lambda: tree.function(MODEL_RUNNER, "GPUModelRunner.execute_model"),
            has_finalize_step="finalize_step" in c.class_names_defined(connector),
        )
    except UnknownShape as exc:
        raise CannotCarry(f"the runtime fix does not recognise this runner: {exc}") from exc
    if shape.startswith(patch.IN_EXECUTE):
        raise CannotCarry(
            "the tree's sample_tokens collects no KV connector output after the drafter: "
            "execute_model collects the step's KV connector output (post_forward(scheduler_output)) "
            "before sample_tokens runs the drafter. Carrying the fix natively moves that collection "
            "into sample_tokens after propose() (README 'Native carry', step 3: execute_model, the "
            "state it leaves and sample_tokens), which this transformation does not write: carry "
            "it by hand, or load the runtime fix"
        )
    runner_names = c.module_names(tree.read(MODEL_RUNNER))
    missing = [name for name in ("torch", "Any", RUNNER_CLASS) if name not in runner_names]
    if missing:
        raise CannotCarry(f"{tree.relpath(MODEL_RUNNER)} has no module-level {', '.join(missing)}")
    if HELPER in runner_names:
        raise CannotCarry(f"{tree.relpath(MODEL_RUNNER)} already defines {HELPER}")
    if "torch" not in c.module_names(tree.read(ASYNC_UTILS)):
        raise CannotCarry(f"{tree.relpath(ASYNC_UTILS)} does not import torch")
    return shape


# --- what the changed functions are built from -------------------------------------------


def _calls(node: cst.CSTNode, suffix: str) -> list[cst.Call]:
    """Calls in `node` whose dotted callee ends with `suffix` ("propose" matches
    "self.speculator.propose")."""
    found: list[cst.Call] = []

    class _Find(cst.CSTVisitor):
        def visit_Call(self, call: cst.Call) -> None:
            name = c.dotted(call.func)
            if name == suffix or name.endswith("." + suffix):
                found.append(call)

    node.visit(_Find())
    return found


def _one(found: Sequence[int], what: str) -> int:
    if len(found) != 1:
        raise CannotCarry(f"{SAMPLE_TOKENS}: {len(found)} {what} where exactly one is expected")
    return found[0]


def _assigned_call(stmt: cst.BaseStatement, callee_suffix: str) -> tuple[cst.Assign, cst.Call] | None:
    """`stmt` as `<target> = <...callee_suffix>(...)`."""
    if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
        return None
    assign = stmt.body[0]
    if not isinstance(assign, cst.Assign) or len(assign.targets) != 1:
        return None
    value = assign.value
    if not isinstance(value, cst.Call):
        return None
    name = c.dotted(value.func)
    if name != callee_suffix and not name.endswith("." + callee_suffix):
        return None
    return assign, value


def _drafted(body: Sequence[cst.BaseStatement]) -> tuple[int, cst.BaseExpression]:
    """(index of the top-level `if` that runs the drafter, its test as the tree writes it)."""
    at = _one(
        [i for i, s in enumerate(body) if _calls(s, "propose") or _calls(s, "propose_draft")],
        "top-level statements running the drafter",
    )
    stmt = body[at]
    if not isinstance(stmt, cst.If) or stmt.orelse is not None:
        raise CannotCarry(f"{SAMPLE_TOKENS}: the drafter does not run under one `if` of its own")
    return at, stmt.test


def _async_output(body: Sequence[cst.BaseStatement]) -> str:
    """The name sample_tokens binds its AsyncOutput to."""
    found = [a for a in (_assigned_call(s, "AsyncOutput") for s in body) if a is not None]
    if len(found) != 1:
        raise CannotCarry(f"{SAMPLE_TOKENS}: {len(found)} AsyncOutput(...) assignments where one is expected")
    target = found[0][0].targets[0].target
    if not isinstance(target, cst.Name):
        raise CannotCarry(f"{SAMPLE_TOKENS}: the AsyncOutput is not bound to a plain name")
    return target.value


def _record(connector: str, drafted: cst.BaseExpression, output: str) -> list[cst.BaseStatement]:
    test = c.code(drafted).strip()
    if isinstance(drafted, (cst.BooleanOperation, cst.IfExp, cst.Lambda, cst.NamedExpr)):
        test = f"({test})"
    code = RECORD.format(connector=connector, helper=HELPER, drafted=test, event=EVENT, output=output)
    return c.statements(code)


def _without_defer(call: cst.Call) -> cst.Call:
    """The deferred `post_forward(..., defer_finalize=...)` call, as a full (non-deferred) one."""
    args = [a for a in call.args if not (a.keyword is not None and a.keyword.value == "defer_finalize")]
    if len(args) != len(call.args) - 1 or not args or call.args[-1] in args:
        raise CannotCarry(
            f"{SAMPLE_TOKENS}: the deferred call is not post_forward(..., defer_finalize=...), "
            "defer_finalize last"
        )
    # The new last argument ends as the dropped one did (no comma; its line break, if any).
    args[-1] = args[-1].with_changes(
        comma=cst.MaybeSentinel.DEFAULT, whitespace_after_arg=call.args[-1].whitespace_after_arg
    )
    return call.with_changes(args=args)


def _defers(stmt: cst.BaseStatement) -> tuple[cst.Assign, cst.Call] | None:
    """`stmt` as `<target> = <connector>.post_forward(..., defer_finalize=...)`."""
    found = _assigned_call(stmt, "post_forward")
    if found is None or not any(
        a.keyword is not None and a.keyword.value == "defer_finalize" for a in found[1].args
    ):
        return None
    return found


def _collect_after_draft(body: list[cst.BaseStatement], draft: int) -> tuple[int, str]:
    """Deferred-finalize shape: the `finalize_step()` call after the drafter becomes the tree's
    own deferred `post_forward` assignment, made in full. (its index, the connector)"""
    at = _one(
        [i for i, s in enumerate(body) if _defers(s) is not None],
        "post_forward(defer_finalize=...) assignments",
    )
    deferred = _defers(body[at])
    assert deferred is not None
    assign, call = deferred
    connector = c.dotted(call.func).rpartition(".")[0]
    finalize = _one(
        [i for i, s in enumerate(body) if i > draft and _calls(s, "finalize_step")],
        "finalize_step() calls after the drafter",
    )
    block = body[finalize]
    if (
        not isinstance(block, cst.If)
        or block.orelse is not None
        or not isinstance(block.body, cst.IndentedBlock)
        or len(block.body.body) != 1
        or not c.calls(block.body.body[0], f"{connector}.finalize_step")
    ):
        raise CannotCarry(
            f"{SAMPLE_TOKENS}: {connector}.finalize_step() is not the one call under its own `if`"
        )
    finalize_call = block.body.body[0]
    assert isinstance(finalize_call, cst.SimpleStatementLine)
    collect = finalize_call.with_changes(body=[assign.with_changes(value=_without_defer(call))])
    marked = c.with_comment(collect, MARK_COLLECT)
    body[finalize] = block.with_changes(body=block.body.with_changes(body=[marked]))
    return finalize, connector


def _collected_after_draft(body: Sequence[cst.BaseStatement], draft: int) -> tuple[int, str]:
    """Post-forward-after-draft shape: (index of the statement after which the step's output
    holds its KV connector output, the connector)."""
    at = _one(
        [i for i, s in enumerate(body) if i > draft and _calls(s, "post_forward")],
        "post_forward calls after the drafter",
    )
    (call,) = _calls(body[at], "post_forward")
    connector = c.dotted(call.func).rpartition(".")[0]
    # `x = <connector>.post_forward(...)` then `<output>.kv_connector_output = x`: after both.
    target = _assigned_target(body[at])
    following = body[at + 1] if at + 1 < len(body) else None
    if target is not None and isinstance(following, cst.SimpleStatementLine) and len(following.body) == 1:
        handed = following.body[0]
        if (
            isinstance(handed, cst.Assign)
            and isinstance(handed.value, cst.Name)
            and handed.value.value == target
        ):
            at += 1
    return at, connector


def _assigned_target(stmt: cst.BaseStatement) -> str | None:
    if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1:
        assign = stmt.body[0]
        if isinstance(assign, cst.Assign) and len(assign.targets) == 1:
            target = assign.targets[0].target
            if isinstance(target, cst.Name):
                return target.value
    return None


def _sample_tokens(shape: str) -> Callable[[cst.FunctionDef], cst.FunctionDef]:
    def change(func: cst.FunctionDef) -> cst.FunctionDef:
        code = c.code(func)
        taken = [name for name in (HELPER, EVENT) if name in code]
        if taken:
            raise CannotCarry(f"{SAMPLE_TOKENS} already uses the names {taken}")
        body = c.body_statements(func)
        draft, drafted = _drafted(body)
        output = _async_output(body)
        if shape.startswith(patch.DEFERRED):
            anchor, connector = _collect_after_draft(body, draft)
        else:
            anchor, connector = _collected_after_draft(body, draft)
        if not connector.startswith("self."):
            raise CannotCarry(
                f"{SAMPLE_TOKENS}: the KV connector ({connector}) is not an attribute of the runner"
            )
        record = _record(connector, drafted, output)
        if not shape.startswith(patch.DEFERRED):  # there the collection after the draft carries it
            record[0] = c.with_comment(record[0], MARK_RUNNER)
        return c.with_body(func, _inserted(body, anchor + 1, record))

    return change


def _post_forward(func: cst.FunctionDef) -> cst.FunctionDef:
    """The deferred call only starts the pending loads (vLLM's lines before the output is built)."""
    body = c.body_statements(func)
    at = _one(
        [i for i, s in enumerate(body) if _assigned_call(s, "KVConnectorOutput") is not None],
        "KVConnectorOutput() assignments in post_forward",
    )
    defer = c.statements(DEFER)
    defer[0] = c.with_comment(defer[0], MARK_DEFER)
    return c.with_body(func, _inserted(body, at, defer))


def _inserted(
    body: Sequence[cst.BaseStatement], at: int, stmts: Sequence[cst.BaseStatement]
) -> list[cst.BaseStatement]:
    """`stmts` placed before `body[at]`, set off by the same blank lines as that statement."""
    new, rest = list(stmts), list(body[at:])
    first = rest[0] if rest else None
    if isinstance(first, (cst.SimpleStatementLine, cst.BaseCompoundStatement)) and first.leading_lines:
        lead = [line for line in first.leading_lines if line.comment is None]
        if len(lead) == len(first.leading_lines):  # blank lines only: the change between two
            head = new[0]
            assert isinstance(head, (cst.SimpleStatementLine, cst.BaseCompoundStatement))
            new[0] = head.with_changes(leading_lines=[*lead, *head.leading_lines])
    return [*body[:at], *new, *rest]


def _get_output(func: cst.FunctionDef) -> cst.FunctionDef:
    wait = c.statements(WAIT)
    wait[0] = c.with_comment(wait[0], MARK_WAIT)
    return c.insert_after(func, lambda s: c.calls(s, "self.copy_event.synchronize"), wait)


def _async_output_class(source: str) -> str:
    """AsyncOutput with its `draft_kv_event` attribute (first in the class body)."""
    module = c.parse(source)
    found = [s for s in module.body if isinstance(s, cst.ClassDef) and s.name.value == "AsyncOutput"]
    if len(found) != 1 or not isinstance(found[0].body, cst.IndentedBlock):
        raise CannotCarry(f"{ASYNC_UTILS}: no single AsyncOutput class")
    klass = found[0]
    assert isinstance(klass.body, cst.IndentedBlock)
    attribute = c.statements(ATTRIBUTE)
    attribute[0] = c.with_comment(attribute[0], MARK_OUTPUT)
    body = list(klass.body.body)
    at = 1 if body and c.is_docstring(body[0]) else 0  # after the class's docstring
    if at < len(body):  # one blank line between the attribute and what follows it
        after = body[at]
        if not isinstance(after, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
            raise CannotCarry(f"{ASYNC_UTILS}: AsyncOutput's body is not made of statements")
        body[at] = after.with_changes(leading_lines=[cst.EmptyLine(indent=False), *after.leading_lines])
    new = klass.with_changes(body=klass.body.with_changes(body=[*body[:at], *attribute, *body[at:]]))
    return module.with_changes(body=[new if s is klass else s for s in module.body]).code


def transform(tree: SourceTree) -> list[NativeEdit]:
    shape = recognize(tree)
    output = c.ast_of(tree.read(ASYNC_UTILS), "AsyncOutput")
    if isinstance(output, ast.ClassDef) and EVENT in c.class_names_defined(output):
        raise CannotCarry(f"AsyncOutput already has a {EVENT} attribute")

    def runner(source: str) -> str:
        changed = c.change_function(source, SAMPLE_TOKENS, _sample_tokens(shape))
        return c.add_before(changed, RUNNER_CLASS, helper_code(), MARK_HELPER)

    edits = [
        tree.edit(MODEL_RUNNER, runner),
        tree.edit(ASYNC_UTILS, lambda s: c.change_function(_async_output_class(s), GET_OUTPUT, _get_output)),
    ]
    if shape.startswith(patch.DEFERRED):
        edits.append(tree.edit(KV_CONNECTOR, lambda s: c.change_function(s, POST_FORWARD, _post_forward)))
    return edits


__all__ = ["helper_code", "recognize", "transform"]
