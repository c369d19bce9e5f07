"""The native carry: ``MoRIIOConnectorScheduler.build_connector_meta`` keeps zeroing off READ blocks.

One file, ``moriio_connector.py``:

* in ``MoRIIOConnectorScheduler.build_connector_meta``, right after the loop that drains
  ``self._reqs_need_recv`` into the metadata (before vLLM clears it), the exclusion rule of
  ``rule.py``: on a READ-mode consumer of a hybrid model, the aligned attention destinations
  (``block_ids[0]``) of the READs drained into this step are removed from
  ``scheduler_output.new_block_ids_to_zero``, under a KV-cache layout whose pages a READ
  rewrites entirely (the tree's own ``KVCacheLayout.is_block_compact``, what a raw block-copy
  READ covers); an unresolved layout keeps zeroing;
* the import of ``KVCacheLayout`` (``vllm.v1.kv_cache_layout``, a leaf module), where the module
  lacks it, next to its other ``vllm.v1`` imports.

The tree is recognised as the runtime patch recognises the installed connector
(``patch.recognize``, build-connector-meta shape): ``build_connector_meta(self,
scheduler_output)`` draining ``_reqs_need_recv``. A tree with the #59164 API
(``MoRIIOConnector.get_sync_load_block_ids``) is not written natively, nor one whose
``build_connector_meta`` already filters the zeroing list.
"""

from __future__ import annotations

import ast

import libcst as cst

from vllm_fix_core import cst as c
from vllm_fix_core.native import CannotCarry, NativeEdit, SourceTree, marker
from vllm_fix_sync_load_zeroing.declaration import MODULE

PR = 59164
QUALNAME = "MoRIIOConnectorScheduler.build_connector_meta"
LAYOUT_MODULE = "vllm.v1.kv_cache_layout"
DRAIN = "self._reqs_need_recv.items"
MARK = marker("sync-load-zeroing", PR, "READ blocks skip zeroing")

EXCLUSION = """
if (
    self.mode == MoRIIOMode.READ
    and not self.is_producer
    and self._has_mamba
    and scheduler_output.new_block_ids_to_zero
):
    # The hybrid READ is posted before this step's forward into blocks the
    # step also zeroes, with nothing ordering the two on the device. Skip
    # zeroing its aligned attention destinations (never the recomputed tail,
    # never Mamba state) where the READ rewrites every byte the zeroer would
    # clear: a block-compact layout. An unresolved layout keeps zeroing.
    layout = getattr(self.kv_cache_config, "kv_cache_layout", None) or (
        self.vllm_config.cache_config.kv_cache_layout
    )
    compact = layout in KVCacheLayout.__members__ and (
        KVCacheLayout[layout].is_block_compact
    )
    if compact:
        read_dst_block_ids = {
            b
            for _, block_ids in self._reqs_need_recv.values()
            for b in block_ids[0]
        }
        scheduler_output.new_block_ids_to_zero = [
            b
            for b in scheduler_output.new_block_ids_to_zero
            if b not in read_dst_block_ids
        ]
"""


def _drains_recv(stmt: cst.BaseStatement) -> bool:
    """The statement is vLLM's ``for ... in self._reqs_need_recv.items():`` loop."""
    return isinstance(stmt, cst.For) and isinstance(stmt.iter, cst.Call) and c.dotted(stmt.iter.func) == DRAIN


def recognize(tree: SourceTree) -> None:
    """CannotCarry where the runtime fix would refuse the tree, or attach elsewhere."""
    source = tree.read(MODULE)
    connector = c.ast_of(source, "MoRIIOConnector")
    assert isinstance(connector, ast.ClassDef)
    if "get_sync_load_block_ids" in c.class_names_defined(connector):
        raise CannotCarry(
            "MoRIIOConnector has get_sync_load_block_ids (the #59164 API): the runtime fix "
            "replaces its layout guard there; that guard is not rewritten natively"
        )
    method = c.ast_of(source, QUALNAME)
    if isinstance(method, ast.ClassDef):
        raise CannotCarry(f"{QUALNAME} is a class, not a method")
    params = c.param_names(method)
    if params != ["self", "scheduler_output"]:
        raise CannotCarry(f"unexpected signature build_connector_meta{tuple(params)}")
    code = ast.unparse(method)
    if "_reqs_need_recv" not in code:
        raise CannotCarry("build_connector_meta no longer drains _reqs_need_recv")
    if "new_block_ids_to_zero" in code:
        raise CannotCarry("build_connector_meta already changes new_block_ids_to_zero itself")
    if "MoRIIOMode" not in c.module_names(source):
        raise CannotCarry(f"{tree.relpath(MODULE)} has no module-level MoRIIOMode")
    layout = c.ast_of(tree.read(LAYOUT_MODULE), "KVCacheLayout")
    if not isinstance(layout, ast.ClassDef) or "is_block_compact" not in c.class_names_defined(layout):
        raise CannotCarry("KVCacheLayout has no is_block_compact (which layouts a READ rewrites)")


def _exclude(func: cst.FunctionDef) -> cst.FunctionDef:
    block = c.statements(EXCLUSION)
    first = block[0]
    assert isinstance(first, cst.If)
    first = first.with_changes(leading_lines=[cst.EmptyLine(indent=False), c.comment_line(MARK)])
    return c.insert_after(func, _drains_recv, [first, *block[1:]])


def _import_layout(source: str) -> str:
    """``from vllm.v1.kv_cache_layout import KVCacheLayout`` after the module's last top-level
    ``from vllm...`` import that sorts before it (the module's import order)."""
    if "KVCacheLayout" in c.module_names(source):
        return source
    module = c.parse(source)
    at = None
    for i, stmt in enumerate(module.body):
        if isinstance(stmt, (cst.ClassDef, cst.FunctionDef)):
            break  # the module's import block has ended
        if isinstance(stmt, cst.SimpleStatementLine) and isinstance(stmt.body[0], cst.ImportFrom):
            imp = stmt.body[0]
            name = c.dotted(imp.module) if imp.module is not None else ""
            if name.startswith("vllm.") and name < LAYOUT_MODULE:
                at = i
    if at is None:
        raise CannotCarry(f"{MODULE} has no top-level vllm import to place the KVCacheLayout import after")
    new = c.statements(f"from {LAYOUT_MODULE} import KVCacheLayout")
    return module.with_changes(body=[*module.body[: at + 1], *new, *module.body[at + 1 :]]).code


def transform(tree: SourceTree) -> list[NativeEdit]:
    recognize(tree)

    def change(source: str) -> str:
        return _import_layout(c.change_function(source, QUALNAME, _exclude))

    return [tree.edit(MODULE, change)]


__all__ = ["recognize", "transform"]
