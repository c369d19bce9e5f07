"""The native carry: the RDMA kv port is allocated atomically, by MORI's listener binding port 0.

Two changes:

* ``moriio_common.py``, ``MoRIIOConfig.from_vllm_config``: ``local_kv_port=get_open_port()``
  (a port probed and released before MORI binds it) becomes ``0`` for the RDMA backend, so the
  kernel picks a free port at the moment MORI's listener binds (XGMI, which opens no TCP
  listener, keeps vLLM's value);
* ``moriio_connector.py``, ``MoRIIOConnectorWorker.__init__``: right after
  ``self.moriio_wrapper.set_backend_type(...)`` (the native bind), the worker and its config
  take the port MORI's engine descriptor reports; an RDMA engine that reports 0 (a MORI older
  than v0.1.0, ROCm/mori#125) stops the worker with a clear error instead of publishing 0.

The tree is recognised by the runtime patch's own checks (``patch.kv_port_value_in``,
``patch.is_released_probe``, ``patch.worker_shape``), read from the tree's source.
"""

from __future__ import annotations

import ast

import libcst as cst

from vllm_fix_core import UnknownShape
from vllm_fix_core import cst as c
from vllm_fix_core.native import CannotCarry, NativeEdit, SourceTree, marker
from vllm_fix_listener_port.declaration import COMMON, CONNECTOR
from vllm_fix_listener_port.patch import is_released_probe, kv_port_value_in, worker_shape

PR = 60641
CONFIG = "MoRIIOConfig.from_vllm_config"
WORKER = "MoRIIOConnectorWorker.__init__"
MARK_CONFIG = marker("listener-port", PR, "port 0: MORI's RDMA listener binds a kernel-chosen port")
MARK_WORKER = marker("listener-port", PR, "take the port MORI's RDMA listener bound")

ADOPT = """
bound_port = self.moriio_engine.get_engine_desc().port
if not bound_port:
    raise RuntimeError(
        "MoRIIO: the RDMA listener reports port 0 after start-up, so peers could not "
        "reach this worker; this MORI does not report an auto-bound port "
        "(IOEngineConfig(port=0), ROCm/mori#125, MORI v0.1.0 and later)"
    )
self.local_kv_port = self.moriio_config.local_kv_port = bound_port
"""


def _recognize(tree: SourceTree) -> bool:
    """Whether MoRIIOConfig has a backend field (RDMA and XGMI), or CannotCarry where the
    runtime fix would refuse the tree."""
    config = c.ast_of(tree.read(COMMON), "MoRIIOConfig")
    assert isinstance(config, ast.ClassDef)
    fields = c.class_names_defined(config)
    for name in ("local_ip", "local_kv_port"):
        if name not in fields:
            raise CannotCarry(f"MoRIIOConfig has no {name} field")
    method = c.ast_of(tree.read(COMMON), CONFIG)
    assert not isinstance(method, ast.ClassDef)
    if not any(isinstance(d, ast.Name) and d.id == "classmethod" for d in method.decorator_list):
        raise CannotCarry("MoRIIOConfig.from_vllm_config is no longer a classmethod")
    try:
        value = kv_port_value_in(method)
        if not is_released_probe(value):
            raise UnknownShape(
                f"from_vllm_config sets local_kv_port={ast.unparse(value)}, not get_open_port()"
            )
        worker_shape(c.ast_of(tree.read(CONNECTOR), WORKER))
    except UnknownShape as exc:
        raise CannotCarry(str(exc)) from exc
    return "backend" in fields


class _PortZero(cst.CSTTransformer):
    """``local_kv_port=get_open_port()`` in the ``cls(...)`` call becomes the RDMA port 0."""

    def __init__(self, value: str) -> None:
        self.value, self.done = cst.parse_expression(value), 0

    def leave_Arg(self, original_node: cst.Arg, updated_node: cst.Arg) -> cst.Arg:
        if original_node.keyword is not None and original_node.keyword.value == "local_kv_port":
            self.done += 1
            return updated_node.with_changes(value=self.value)
        return updated_node


def _config_change(has_backend: bool) -> c.FunctionChange:
    def change(func: cst.FunctionDef) -> cst.FunctionDef:
        value = '0 if backend == "rdma" else get_open_port()' if has_backend else "0"
        body = c.body_statements(func)
        module = cst.Module(body=[])
        at = [i for i, s in enumerate(body) if "local_kv_port=" in module.code_for_node(s)]
        if len(at) != 1:
            raise CannotCarry(f"{CONFIG}: local_kv_port= is passed in {len(at)} statements")
        if has_backend and "backend = " not in module.code_for_node(func):
            raise CannotCarry(f"{CONFIG} has no local backend to tell RDMA from XGMI")
        swap = _PortZero(value)
        stmt = body[at[0]].visit(swap)
        if swap.done != 1 or not isinstance(stmt, cst.BaseStatement):
            raise CannotCarry(f"{CONFIG}: local_kv_port= found {swap.done} times")
        body[at[0]] = c.with_comment(stmt, MARK_CONFIG)
        return c.with_body(func, body)

    return change


def _worker_change(has_backend: bool) -> c.FunctionChange:
    def change(func: cst.FunctionDef) -> cst.FunctionDef:
        adopt = c.statements(ADOPT)
        if has_backend:  # XGMI opens no TCP listener: its port stays as vLLM set it
            code = 'if self.moriio_config.backend == "rdma":\n' + "".join(
                "    " + line + "\n" if line else "\n" for line in ADOPT.strip("\n").splitlines()
            )
            adopt = c.statements(code)
        adopt[0] = c.with_comment(adopt[0], MARK_WORKER)
        return c.insert_after(func, lambda s: c.calls(s, "self.moriio_wrapper.set_backend_type"), adopt)

    return change


def transform(tree: SourceTree) -> list[NativeEdit]:
    has_backend = _recognize(tree)
    return [
        tree.edit(COMMON, lambda s: c.change_function(s, CONFIG, _config_change(has_backend))),
        tree.edit(CONNECTOR, lambda s: c.change_function(s, WORKER, _worker_change(has_backend))),
    ]


__all__ = ["transform"]
