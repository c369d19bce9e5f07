"""The native carry: one injective per-rank port offset at every MoRIIO bind and dial site, and a
check that the two port blocks fit and do not overlap.

Every call ``get_port_offset(dp, tp)`` that omits the TP size gets the TP size of the engine
that listens on the port, as the runtime fix's wrappers supply it (``sites.classify`` places each
caller; the same places are read here from the tree's source):

* listener sites, this engine's TP size: ``MoRIIOConfig.from_vllm_config`` its own ``tp_size``
  (read from ``get_tensor_model_parallel_world_size()`` there), ``MoRIIOConnectorWorker.__init__``
  ``get_tensor_model_parallel_world_size()``;
* scheduler senders (``MoRIIOConnectorScheduler``), the peer's TP size: the bound of the
  ``for tp_index in range(...)`` loop the call sits in (the sender's own count of peer ranks);
* the WRITE notify writer (``MoRIIOWriter``), the decode engine's TP size: ``task.remote_tp_size``
  where the task carries it, else the worker's ``world_size`` (vLLM's own assumption), read with
  ``getattr(self.worker, "world_size", 1)``: a worker without one keeps vLLM's offset, as the
  runtime fix does (vLLM's own writer tests build such workers);
* the handshake dialer (``MoRIIOConnectorWorker`` with a ``remote_tp_size``):
  ``remote_tp_size or self.world_size``.

Calls that pass a TP size are kept. ``MoRIIOConfig.from_vllm_config`` also rejects handshake /
notify bases whose blocks of ``DP_local x TP`` ports overflow or overlap (``ValueError``), checked
on the config it built, before returning it.

The tree is recognised by the runtime patch's checks (``patch.recognize``): ``get_port_offset``
is ``(dp_rank, tp_rank, tp_size=1)`` returning ``dp_rank * tp_size + tp_rank`` in
``moriio_common`` and imported from there by the other modules; every caller is one of the places
above (``sites.LISTENER_SITES`` among them), else the tree is not carried.
"""

from __future__ import annotations

import ast
import functools

import libcst as cst

from vllm_fix_core import cst as c
from vllm_fix_core.native import CannotCarry, NativeEdit, SourceTree, marker
from vllm_fix_handshake_port.rule import MAX_PORT
from vllm_fix_handshake_port.sites import (
    COMMON,
    CONNECTOR,
    ENGINE,
    LISTENER_SITES,
    SENDER_CLASS,
    WORKER_CLASS,
    WRITER_CLASS,
)

PR = 52014
MODULES = {"moriio_common": COMMON, "moriio_connector": CONNECTOR, "moriio_engine": ENGINE}
CONFIG = "MoRIIOConfig.from_vllm_config"
MARK_OFFSET = marker("handshake-port", PR, "size the port offset with the listening engine's TP size")
MARK_LAYOUT = marker("handshake-port", PR, "the handshake and notify port blocks must fit and not overlap")
TP_GETTER = "get_tensor_model_parallel_world_size"

LAYOUT = f"""
ports_per_base = max(vllm_config.parallel_config.data_parallel_size_local or 0, 1) * max(tp_size, 1)
port_bases = {{"handshake_port": int(moriio_config.handshake_port), "notify_port": base_notify_port}}
for port_name, port_base in port_bases.items():
    if not 1 <= port_base <= {MAX_PORT} - ports_per_base + 1:
        raise ValueError(
            f"MoRIIO {{port_name}}={{port_base}} leaves no room for {{ports_per_base}} ranks "
            f"(DP local x TP): ports {{port_base}}..{{port_base + ports_per_base - 1}} must lie in "
            f"1..{MAX_PORT}; change {{port_name}} in kv_transfer_config.kv_connector_extra_config"
        )
if abs(port_bases["handshake_port"] - port_bases["notify_port"]) < ports_per_base:
    raise ValueError(
        f"MoRIIO handshake_port={{port_bases['handshake_port']}} and "
        f"notify_port={{port_bases['notify_port']}} overlap: each needs {{ports_per_base}} "
        "consecutive ports (DP local x TP), so one rank's handshake port would be another "
        "rank's notify port; move one base in kv_transfer_config.kv_connector_extra_config"
    )
"""


def _offset_calls(node: ast.AST) -> list[ast.Call]:
    return [
        n
        for n in ast.walk(node)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "get_port_offset"
    ]


def _callers(source: str) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    """Top-level functions and methods (by qualname) that call get_port_offset."""
    found: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = {}
    for stmt in ast.parse(source).body:
        owners = [(stmt.name + ".", s) for s in stmt.body] if isinstance(stmt, ast.ClassDef) else [("", stmt)]
        for prefix, node in owners:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _offset_calls(node):
                found[prefix + node.name] = node
    return found


def _omits_tp(call: ast.Call | cst.Call) -> bool:
    if isinstance(call, ast.Call):
        return len(call.args) == 2 and not call.keywords
    return len(call.args) == 2 and all(a.keyword is None and not a.star for a in call.args)


def _classify(module: str, qualname: str, node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """'listener', 'sender', 'writer', 'dialer' or 'explicit' (sites.classify, on the source)."""
    owner = qualname.rpartition(".")[0]
    if (module, qualname) in LISTENER_SITES:
        return "listener"
    if owner == SENDER_CLASS:
        return "sender"
    if owner == WRITER_CLASS:
        return "writer"
    if not any(_omits_tp(call) for call in _offset_calls(node)):
        return "explicit"
    if owner == WORKER_CLASS and (
        "remote_tp_size" in c.param_names(node) or qualname.endswith("._moriio_handshake")
    ):
        return "dialer"
    raise CannotCarry(
        f"{module}:{qualname} calls get_port_offset without a TP size, and it is neither a listener "
        "site, a scheduler sender, the WRITE notify sender nor a worker dial with a remote_tp_size: "
        "the listening engine's TP size there is unknown"
    )


def _recognize(tree: SourceTree) -> dict[tuple[str, str], str]:
    """Each caller site's kind; CannotCarry where the runtime fix would refuse the tree."""
    sources = {short: tree.read(module) for short, module in MODULES.items()}
    offset = c.ast_of(sources["moriio_common"], "get_port_offset")
    if isinstance(offset, ast.ClassDef):
        raise CannotCarry("moriio_common.get_port_offset is a class")
    defaults = offset.args.defaults
    if (
        c.param_names(offset) != ["dp_rank", "tp_rank", "tp_size"]
        or len(defaults) != 1
        or not isinstance(defaults[0], ast.Constant)
        or defaults[0].value != 1
    ):
        raise CannotCarry("get_port_offset is not get_port_offset(dp_rank, tp_rank, tp_size=1)")
    returns = [s for s in offset.body if isinstance(s, ast.Return)]
    if len(offset.body) != 1 or len(returns) != 1 or returns[0].value is None:
        raise CannotCarry("get_port_offset is no longer one return of dp * tp_size + tp")
    if ast.unparse(returns[0].value).replace("(dp_rank)", "dp_rank") != "dp_rank * tp_size + tp_rank":
        raise CannotCarry("get_port_offset(dp, tp, tp_size) is no longer dp * tp_size + tp")
    for short in ("moriio_connector", "moriio_engine"):
        tree_ = ast.parse(sources[short])
        defined = "get_port_offset" in {
            s.name for s in tree_.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        } | {
            t.id
            for s in tree_.body
            if isinstance(s, ast.Assign)
            for t in s.targets
            if isinstance(t, ast.Name)
        }
        imported = any(
            isinstance(s, ast.ImportFrom)
            and s.module == COMMON
            and any(a.name == "get_port_offset" and a.asname is None for a in s.names)
            for s in tree_.body
        )
        uses = "get_port_offset" in sources[short]
        if uses and (defined or not imported):
            raise CannotCarry(f"{short}.get_port_offset is not moriio_common.get_port_offset")
    kinds = {
        (short, qualname): _classify(short, qualname, node)
        for short, source in sources.items()
        for qualname, node in _callers(source).items()
    }
    missing = sorted(LISTENER_SITES - set(kinds))
    if missing:
        names = ", ".join(f"{m}:{q}" for m, q in missing)
        raise CannotCarry(f"the listener sites moved: {names} no longer calls get_port_offset")
    return kinds


class _Offsets(cst.CSTTransformer):
    """Adds the listening engine's TP size to each get_port_offset(dp, tp) in the callers."""

    def __init__(self, kinds: dict[str, str], listener_tp: dict[str, str], writer_task_tp: bool) -> None:
        self.kinds, self.listener_tp, self.writer_task_tp = kinds, listener_tp, writer_task_tp
        self.scope: list[str] = []
        self.params: list[list[str]] = []
        self.loops: list[tuple[str, str]] = []
        self.pending = 0  # calls changed inside the current simple statement
        self.changed: set[str] = set()

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self.scope.append(node.name.value)

    def leave_ClassDef(self, original_node: cst.ClassDef, updated_node: cst.ClassDef) -> cst.ClassDef:
        self.scope.pop()
        return updated_node

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.scope.append(node.name.value)
        p = node.params
        self.params.append([x.name.value for x in (*p.posonly_params, *p.params, *p.kwonly_params)])

    def leave_FunctionDef(
        self, original_node: cst.FunctionDef, updated_node: cst.FunctionDef
    ) -> cst.FunctionDef:
        self.scope.pop()
        self.params.pop()
        return updated_node

    def visit_For(self, node: cst.For) -> None:
        target = c.dotted(node.target) if isinstance(node.target, cst.Name) else ""
        it = node.iter
        bound = ""
        if isinstance(it, cst.Call) and c.dotted(it.func) == "range" and len(it.args) == 1:
            bound = cst.Module(body=[]).code_for_node(it.args[0].value)
        self.loops.append((target, bound))

    def leave_For(self, original_node: cst.For, updated_node: cst.For) -> cst.For:
        self.loops.pop()
        return updated_node

    def _site(self) -> str:
        # the top-level function or method the call sits in (nested defs belong to it)
        if len(self.scope) >= 2 and self.scope[0][:1].isupper():
            return ".".join(self.scope[:2])
        return self.scope[0] if self.scope else ""

    def _tp_size(self, call: cst.Call) -> str:
        site = self._site()
        kind = self.kinds.get(site)
        if kind == "listener":
            return self.listener_tp[site]
        if kind == "sender":
            tp = call.args[1].value
            name = tp.value if isinstance(tp, cst.Name) else ""
            bound = next((b for t, b in reversed(self.loops) if t == name and name), "")
            if not bound:
                raise CannotCarry(f"{site}: the peer TP index is not a `for ... in range(...)` loop variable")
            return bound
        if kind == "writer":
            if self.writer_task_tp and "task" in (self.params[0] if self.params else []):
                return 'task.remote_tp_size or getattr(self.worker, "world_size", 1)'
            return 'getattr(self.worker, "world_size", 1)'
        if kind == "dialer":
            if "remote_tp_size" in (self.params[0] if self.params else []):
                return "remote_tp_size or self.world_size"
            return "self.world_size"
        raise CannotCarry(f"{site} calls get_port_offset without a TP size, at no place known")

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.Call:
        if c.dotted(updated_node.func) != "get_port_offset" or not _omits_tp(updated_node):
            return updated_node
        size = cst.parse_expression(self._tp_size(updated_node))
        last = updated_node.args[-1]
        args = [  # the new argument after the last one, on its line; the closing layout kept
            *updated_node.args[:-1],
            last.with_changes(
                comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")),
                whitespace_after_arg=cst.SimpleWhitespace(""),
            ),
            cst.Arg(value=size, whitespace_after_arg=last.whitespace_after_arg),
        ]
        self.pending += 1
        self.changed.add(self._site())
        return updated_node.with_changes(args=args)

    def leave_SimpleStatementLine(
        self, original_node: cst.SimpleStatementLine, updated_node: cst.SimpleStatementLine
    ) -> cst.SimpleStatementLine:
        if not self.pending:
            return updated_node
        self.pending = 0
        return updated_node.with_changes(
            leading_lines=[*updated_node.leading_lines, c.comment_line(MARK_OFFSET)]
        )


def _listener_tp(short: str, source: str, kinds: dict[str, str]) -> dict[str, str]:
    """The expression of this engine's TP size at each listener site of the module."""
    found: dict[str, str] = {}
    for site, kind in kinds.items():
        if kind != "listener":
            continue
        func = c.ast_of(source, site)
        assert not isinstance(func, ast.ClassDef)
        assigned = any(
            isinstance(s, ast.Assign)
            and [ast.unparse(t) for t in s.targets] == ["tp_size"]
            and ast.unparse(s.value) == f"{TP_GETTER}()"
            for s in func.body
        )
        if assigned:
            found[site] = "tp_size"
        elif TP_GETTER in c.module_names(source):
            found[site] = f"{TP_GETTER}()"
        else:
            raise CannotCarry(f"{short}:{site} has no {TP_GETTER} to read this engine's TP size from")
    return found


def _layout_change(func: cst.FunctionDef) -> cst.FunctionDef:
    """``return cls(...)`` becomes ``moriio_config = cls(...)``, the layout check, the return."""
    code = cst.Module(body=[]).code_for_node(func)
    for name in ("moriio_config", "ports_per_base", "port_bases", "port_name", "port_base"):
        if name in code:
            raise CannotCarry(f"{CONFIG} already uses the name {name}")
    for name in ("tp_size", "base_notify_port"):
        if f"{name} = " not in code:
            raise CannotCarry(f"{CONFIG} has no local {name} for the layout check")
    body = c.body_statements(func)
    last = body[-1] if body else None
    if not (
        isinstance(last, cst.SimpleStatementLine)
        and len(last.body) == 1
        and isinstance(last.body[0], cst.Return)
        and isinstance(last.body[0].value, cst.Call)
        and c.dotted(last.body[0].value.func) == "cls"
    ):
        raise CannotCarry(f"{CONFIG} does not end with `return cls(...)`")
    built = last.with_changes(
        body=[cst.Assign(targets=[cst.AssignTarget(cst.Name("moriio_config"))], value=last.body[0].value)]
    )
    check = c.statements(LAYOUT)
    check[0] = c.with_comment(check[0], MARK_LAYOUT)
    return c.with_body(func, [*body[:-1], built, *check, *c.statements("return moriio_config")])


def _changed(
    source: str, *, short: str, here: dict[str, str], listener_tp: dict[str, str], writer_task_tp: bool
) -> str:
    """One module's source with its offsets sized (and, in moriio_common, the layout check)."""
    result = c.parse(source).visit(_Offsets(here, listener_tp, writer_task_tp)).code
    if short == "moriio_common":
        result = c.change_function(result, CONFIG, _layout_change)
    return result


def transform(tree: SourceTree) -> list[NativeEdit]:
    kinds = _recognize(tree)
    writer_task_tp = False
    task = c.ast_of(tree.read(COMMON), "WriteTask")
    if isinstance(task, ast.ClassDef):
        writer_task_tp = "remote_tp_size" in c.class_names_defined(task)
    edits = []
    for short, module in MODULES.items():
        here = {site: kind for (m, site), kind in kinds.items() if m == short}
        if not here:
            continue
        listener_tp = _listener_tp(short, tree.read(module), here)

        change = functools.partial(
            _changed, short=short, here=here, listener_tp=listener_tp, writer_task_tp=writer_task_tp
        )
        edits.append(tree.edit(module, change))
    return edits


__all__ = ["transform"]
