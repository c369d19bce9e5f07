"""The native carry: a MoRIIO listener that cannot bind its port fails start-up with the reason.

Two files, the functions the bug lives in:

* ``moriio_connector.py``: a ready event that also carries the listener's bind failure
  (``_ListenerReady``, placed before ``class MoRIIOConnectorWorker``);
  ``MoRIIOConnectorWorker._moriio_handshake_listener`` catches a failure raised before it
  set its ready event, keeps it on the event (when it is a ``_ListenerReady``) and sets the
  event, so the waiting thread wakes up; ``MoRIIOConnectorWorker.register_kv_caches`` makes its
  ready event a ``_ListenerReady`` and, right after waiting on it, raises an error naming the
  port and the ``handshake_port`` setting (before it starts the notify listener);
* ``moriio_engine.py``, ``MoRIIOWrapper.async_wait_reqid``: its listener thread reports the
  bind (an event, and the failure) and the call waits for it (``NOTIFY_BIND_TIMEOUT_S`` at
  most) and raises an error naming the port, the bind's own cause and the ``notify_port``
  setting.

The tree is recognised by the runtime patch's checks (``patch.recognize``: the listener a
static ``(metadata, ready_event, base_port, ...)``, ``async_wait_reqid(self)``,
``zmq_ctx(socket_type, addr)``), read from the tree's source, and by the statements the change
anchors to (the listener's ``with zmq_ctx(zmq.ROUTER, ...)`` block, ``register_kv_caches``'s
``X = threading.Event()`` / ``X.wait()``, ``async_wait_reqid``'s listener function and its
``self.notify_thread.start()``).
"""

from __future__ import annotations

import ast

import libcst as cst

from vllm_fix_bind_failure.declaration import CONNECTOR, ENGINE
from vllm_fix_bind_failure.patch import NOTIFY_BIND_TIMEOUT_S
from vllm_fix_core import cst as c
from vllm_fix_core.native import CannotCarry, NativeEdit, SourceTree, marker

PR = 52014
LISTENER = "MoRIIOConnectorWorker._moriio_handshake_listener"
REGISTER = "MoRIIOConnectorWorker.register_kv_caches"
NOTIFY = "MoRIIOWrapper.async_wait_reqid"
READY_CLASS = "_ListenerReady"
MARK_READY = marker("bind-failure", PR, "a listener's ready event also carries its bind failure")
MARK_LISTENER = marker("bind-failure", PR, "a port it cannot bind wakes register_kv_caches")
MARK_REGISTER = marker("bind-failure", PR, "the handshake listener could not bind: fail start-up")
MARK_NOTIFY = marker("bind-failure", PR, "wait for the notify listener's bind; raise if it failed")

READY = f'''
class {READY_CLASS}(threading.Event):
    """Set once the handshake listener listens, or once it failed to bind (``error``)."""

    error: BaseException | None = None
'''


def _function(source: str, qualname: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
    node = c.ast_of(source, qualname)
    if isinstance(node, ast.ClassDef):
        raise CannotCarry(f"{qualname} is a class, not a function")
    return node


def _recognize(tree: SourceTree) -> None:
    """CannotCarry where the runtime fix (``patch.recognize``) would refuse the tree."""
    connector, engine = tree.read(CONNECTOR), tree.read(ENGINE)
    listener = _function(connector, LISTENER)
    static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in listener.decorator_list)
    if not static or c.param_names(listener)[:3] != ["metadata", "ready_event", "base_port"]:
        raise CannotCarry(
            "MoRIIOConnectorWorker._moriio_handshake_listener is not (metadata, ready_event, base_port, ...)"
        )
    if c.param_names(_function(engine, NOTIFY)) != ["self"]:
        raise CannotCarry("MoRIIOWrapper.async_wait_reqid takes arguments")
    for module in (ENGINE, CONNECTOR):
        if "zmq_ctx" not in c.module_names(tree.read(module)):
            raise CannotCarry(f"{module} does not use zmq_ctx")
    zmq_ctx = None
    for module in (ENGINE, f"{ENGINE.rpartition('.')[0]}.moriio_common"):
        if tree.has(module):
            try:
                zmq_ctx = _function(tree.read(module), "zmq_ctx")
                break
            except CannotCarry:
                continue
    if zmq_ctx is None or c.param_names(zmq_ctx)[:2] != ["socket_type", "addr"]:
        raise CannotCarry("moriio_engine.zmq_ctx is not zmq_ctx(socket_type, addr)")
    for module, names in ((CONNECTOR, ("threading", "logger")), (ENGINE, ("threading", "logger"))):
        missing = [n for n in names if n not in c.module_names(tree.read(module))]
        if missing:
            raise CannotCarry(f"{module} has no {', '.join(missing)} for the change to use")


def _is_router_listener(stmt: cst.BaseStatement) -> bool:
    """``with zmq_ctx(zmq.ROUTER, ...) as sock:`` (the bind of a listener)."""
    if not isinstance(stmt, cst.With) or len(stmt.items) != 1:
        return False
    call = stmt.items[0].item
    return (
        isinstance(call, cst.Call)
        and c.dotted(call.func) == "zmq_ctx"
        and bool(call.args)
        and c.dotted(call.args[0].value) == "zmq.ROUTER"
    )


def _guarded(
    func: cst.FunctionDef, ready: str, on_failure: str, set_first: bool, mark: str | None
) -> cst.FunctionDef:
    """The function's one ``with zmq_ctx(zmq.ROUTER, ...)`` block inside a try whose handler
    runs `on_failure` for an error raised before `ready` was set (later errors are re-raised);
    `set_first` adds ``ready.set()`` as the block's first statement."""
    body = c.body_statements(func)
    found = [i for i, s in enumerate(body) if _is_router_listener(s)]
    if len(found) != 1:
        raise CannotCarry(
            f"def {func.name.value}: {len(found)} `with zmq_ctx(zmq.ROUTER, ...)` blocks, not one"
        )
    block = body[found[0]]
    assert isinstance(block, cst.With)
    above = block.leading_lines
    if not isinstance(block.body, cst.IndentedBlock):
        raise CannotCarry(f"def {func.name.value}: the listener's block is not indented")
    inner = list(block.body.body)
    if set_first:
        inner = [*c.statements(f"{ready}.set()"), *inner]
    elif not (inner and c.calls(inner[0], f"{ready}.set")):
        raise CannotCarry(f"def {func.name.value}: the listener does not set {ready} first")
    block = block.with_changes(body=block.body.with_changes(body=inner), leading_lines=[])
    handler = c.statements(f"if {ready}.is_set():\n    raise\n" + on_failure)
    if mark is not None:
        handler[0] = c.with_comment(handler[0], mark)
    guard = cst.Try(
        body=cst.IndentedBlock(body=[block]),
        handlers=[
            cst.ExceptHandler(
                body=cst.IndentedBlock(body=handler),
                type=cst.Name("Exception"),
                name=cst.AsName(name=cst.Name("exc")),
            )
        ],
        leading_lines=above,
    )
    return c.with_body(func, [*body[: found[0]], guard, *body[found[0] + 1 :]])


def _listener_change(func: cst.FunctionDef) -> cst.FunctionDef:
    return _guarded(
        func,
        "ready_event",
        'logger.error("MoRIIO handshake listener cannot bind %s: %s", path, exc)\n'
        f"if isinstance(ready_event, {READY_CLASS}):\n"
        "    ready_event.error = exc\n"
        "ready_event.set()\n",
        set_first=False,
        mark=MARK_LISTENER,
    )


def _thread_args(func: cst.FunctionDef) -> tuple[str, str]:
    """(the ready event's name, the port expression) of register_kv_caches's listener thread."""
    module = cst.Module(body=[])
    found: list[tuple[str, str]] = []

    class _Thread(cst.CSTVisitor):
        def visit_Call(self, node: cst.Call) -> None:
            if c.dotted(node.func) != "threading.Thread":
                return
            kw = {a.keyword.value: a.value for a in node.args if a.keyword is not None}
            target, args = kw.get("target"), kw.get("args")
            if target is None or c.dotted(target) != "self._moriio_handshake_listener":
                return
            if not isinstance(args, cst.Tuple) or len(args.elements) < 3:
                return
            ready, port = args.elements[1].value, args.elements[2].value
            if isinstance(ready, cst.Name):
                found.append((ready.value, module.code_for_node(port)))

    func.visit(_Thread())
    if len(found) != 1:
        raise CannotCarry(f"{REGISTER}: {len(found)} handshake listener threads started, not one")
    return found[0]


def _register_change(func: cst.FunctionDef) -> cst.FunctionDef:
    ready, port = _thread_args(func)
    body = c.body_statements(func)
    made = [
        i
        for i, s in enumerate(body)
        if isinstance(s, cst.SimpleStatementLine)
        and len(s.body) == 1
        and isinstance(s.body[0], cst.Assign)
        and len(s.body[0].targets) == 1
        and c.dotted(s.body[0].targets[0].target) == ready
        and isinstance(s.body[0].value, cst.Call)
        and c.dotted(s.body[0].value.func) == "threading.Event"
        and not s.body[0].value.args
    ]
    if len(made) != 1:
        raise CannotCarry(f"{REGISTER}: {ready} = threading.Event() found {len(made)} times")
    stmt = body[made[0]]
    assert isinstance(stmt, cst.SimpleStatementLine) and isinstance(stmt.body[0], cst.Assign)
    assign = stmt.body[0]
    assert isinstance(assign.value, cst.Call)
    body[made[0]] = stmt.with_changes(
        body=[assign.with_changes(value=assign.value.with_changes(func=cst.Name(READY_CLASS)))]
    )
    fail = c.statements(
        f"""
        if {ready}.error is not None:
            raise RuntimeError(
                f"MoRIIO handshake listener cannot bind port {{{port}}}: "
                f"{{{ready}.error}}. "
                "Each rank listens on handshake_port plus its rank offset: set handshake_port "
                "in kv_transfer_config.kv_connector_extra_config to a block of ports that is "
                "free on this host (and give its peers the same base)"
            ) from {ready}.error
        """
    )
    fail[0] = c.with_comment(fail[0], MARK_REGISTER)
    return c.insert_after(c.with_body(func, body), lambda s: c.calls(s, f"{ready}.wait"), fail)


def _notify_change(func: cst.FunctionDef) -> cst.FunctionDef:
    body = c.body_statements(func)
    listeners = [
        i
        for i, s in enumerate(body)
        if isinstance(s, cst.FunctionDef) and any(_is_router_listener(t) for t in c.body_statements(s))
    ]
    if len(listeners) != 1:
        raise CannotCarry(f"{NOTIFY}: {len(listeners)} listener functions, not one")
    at = listeners[0]
    inner = body[at]
    assert isinstance(inner, cst.FunctionDef)
    fail = "bind_error.append(exc)\nbound.set()\n"
    body[at] = _guarded(inner, "bound", fail, set_first=True, mark=None)
    state = c.statements("bound = threading.Event()\nbind_error: list[Exception] = []\n")
    state[0] = c.with_comment(state[0], MARK_NOTIFY)
    body = [*body[:at], *state, *body[at:]]
    wait = c.statements(
        f"""
        if not bound.wait({NOTIFY_BIND_TIMEOUT_S}):
            logger.warning(
                "MoRIIO notify listener on port %s did not bind within %.0f s",
                self.notify_port,
                {NOTIFY_BIND_TIMEOUT_S},
            )
        elif bind_error:
            raise RuntimeError(
                f"MoRIIO notify listener cannot bind port {{self.notify_port}}: {{bind_error[0]}}. "
                "Each rank listens on notify_port plus its rank offset: set notify_port in "
                "kv_transfer_config.kv_connector_extra_config to a block of ports that is free "
                "on this host (and give its peers the same base)"
            ) from bind_error[0]
        """
    )
    return c.insert_after(c.with_body(func, body), lambda s: c.calls(s, "self.notify_thread.start"), wait)


def _connector(source: str) -> str:
    source = c.change_function(source, LISTENER, _listener_change)
    source = c.change_function(source, REGISTER, _register_change)
    return c.add_before(source, "MoRIIOConnectorWorker", READY, MARK_READY)


def transform(tree: SourceTree) -> list[NativeEdit]:
    _recognize(tree)
    if READY_CLASS in c.module_names(tree.read(CONNECTOR)):
        raise CannotCarry(f"{CONNECTOR} already defines {READY_CLASS}")
    return [
        tree.edit(CONNECTOR, _connector),
        tree.edit(ENGINE, lambda s: c.change_function(s, NOTIFY, _notify_change)),
    ]


__all__ = ["transform"]
