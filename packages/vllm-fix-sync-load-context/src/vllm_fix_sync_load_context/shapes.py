"""Release-specific knowledge of this fix, in one place: how a FULL-replay step reaches pre_forward.

Two shapes of vLLM's V2 runner carry the bug:

- ``batch-in-arguments`` (vLLM 0.32 on): the FULL branch calls
  ``self.kv_connector.pre_forward(scheduler_output, input_batch, attn_metadata=...)``, so the
  step's input batch and attention metadata are the call's own arguments.
- ``batch-in-caller`` (vLLM 0.15-0.31): the FULL branch calls ``pre_forward(scheduler_output)``
  (0.30/0.31: ``pre_forward(**connector_kwargs, attn_metadata=attn_metadata)``) and the step's
  input batch and attention metadata are only local variables of ``execute_model``. The other
  branch names them in its own ``set_forward_context(<attn>, ..., num_tokens=<batch>.
  num_tokens_after_padding, ...)``; :func:`caller_recipe` reads those names from that call's
  AST, and at run time the step is read (never written) from the ``execute_model`` frame that
  is executing exactly that FULL-branch call.

0.15/0.16's runner has only FULL graphs (``if use_cudagraph:`` ... ``cudagraph_manager.run(n)``)
and an eager branch told ``CUDAGraphMode.NONE``; 0.17 on name ``CUDAGraphMode.FULL`` in the test.
Anything else (a FULL branch that already opens a context, names the other branch does not
pass as plain names) is not recognised.
"""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
import types
from dataclasses import dataclass
from typing import Any

from vllm_fix_core import unwrap

BATCH_IN_ARGUMENTS = ["self", "scheduler_output", "input_batch", "attn_metadata"]
BATCH_IN_CALLER = (["self", "scheduler_output"], ["self", "scheduler_output", "kwargs"])
# How far up from the wrapper the runner's frame may be (wrapt and other fixes' layers between).
MAX_DEPTH = 12


def dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{dotted(node.value)}.{node.attr}"
    if isinstance(node, ast.Name):
        return node.id
    return ""


def _is_path(node: ast.AST) -> bool:
    """A plain name or attribute chain on a name (nothing that runs code when read)."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name)


@dataclass(frozen=True)
class CallerRecipe:
    """Where the step lives in the runner's frame while the FULL branch calls pre_forward."""

    code: types.CodeType
    first_line: int  # absolute line range of the FULL branch's pre_forward call
    last_line: int
    attn_metadata: tuple[str, ...]  # e.g. ("attn_metadata",)
    input_batch: str  # e.g. "input_batch"
    sync_only: bool  # pre_forward starts loads only for steps with synchronous loads

    def step(self, start: types.FrameType | None) -> tuple[Any, Any] | None:
        """(attn_metadata, input_batch) of the step whose FULL branch is calling, or None."""
        frame = start
        for _ in range(MAX_DEPTH):
            if frame is None:
                return None
            if frame.f_code is self.code:
                if not self.first_line <= frame.f_lineno <= self.last_line:
                    return None  # execute_model is elsewhere (e.g. no_forward), not the FULL call
                local = frame.f_locals
                if self.input_batch not in local or self.attn_metadata[0] not in local:
                    return None
                attn = local[self.attn_metadata[0]]
                for attr in self.attn_metadata[1:]:
                    attn = getattr(attn, attr, None)
                return attn, local[self.input_batch]
            frame = frame.f_back
        return None


# The FULL graph replay after the branch's pre_forward: run_fullgraph (0.17 on), run (0.15/0.16,
# whose manager captures only FULL graphs).
REPLAYS = ("self.cudagraph_manager.run_fullgraph", "self.cudagraph_manager.run")


def _replays_full_graph(node: ast.If) -> bool:
    """The branch is the FULL replay: its test names CUDAGraphMode.FULL (0.17 on), or (0.15/0.16)
    the runner knows only a graph and an eager branch, the eager one told CUDAGraphMode.NONE."""
    if "CUDAGraphMode.FULL" in ast.unparse(node.test):
        return True
    eager = [
        k.value
        for stmt in node.orelse
        for c in ast.walk(stmt)
        if isinstance(c, ast.Call) and dotted(c.func).endswith("set_forward_context")
        for k in c.keywords
        if k.arg == "cudagraph_runtime_mode"
    ]
    body_calls = {dotted(c.func) for c in _calls(node.body)}
    return (
        isinstance(node.test, ast.Name)
        and "self.cudagraph_manager.run" in body_calls
        and len(eager) == 1
        and dotted(eager[0]) == "CUDAGraphMode.NONE"
    )


def _function(obj: Any) -> Any:
    return unwrap(obj)


def _parsed(func: Any) -> tuple[ast.FunctionDef | ast.AsyncFunctionDef, int]:
    lines, start = inspect.getsourcelines(func)
    node = ast.parse(textwrap.dedent("".join(lines))).body[0]
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise TypeError(f"{func!r} is not a function")
    return node, start - 1


def _calls(nodes: list[ast.stmt]) -> list[ast.Call]:
    return [n for stmt in nodes for n in ast.walk(stmt) if isinstance(n, ast.Call)]


def _no_with_around(nodes: list[ast.stmt], target: ast.Call) -> bool:
    for stmt in nodes:
        for w in ast.walk(stmt):
            if isinstance(w, (ast.With, ast.AsyncWith)) and any(n is target for n in ast.walk(w)):
                return False
    return True


def caller_recipe(execute_model: Any, pre_forward: Any) -> CallerRecipe | str:
    """The recipe for the ``batch-in-caller`` shape, or why `execute_model` is not that shape."""
    func = _function(execute_model)
    tree, offset = _parsed(func)
    for node in ast.walk(tree):
        if not isinstance(node, ast.If):
            continue
        pre = [c for c in _calls(node.body) if dotted(c.func) == "self.kv_connector.pre_forward"]
        if not pre or not _replays_full_graph(node):
            continue
        if len(pre) != 1 or not _no_with_around(node.body, pre[0]):
            return "the FULL branch already opens a context around pre_forward"
        call = pre[0]
        if len(call.args) > 1 or any(k.arg == "input_batch" for k in call.keywords):
            return "the FULL branch passes pre_forward an input batch its signature does not take"
        body_calls = [dotted(c.func) for c in _calls(node.body)]
        if not any(name in REPLAYS for name in body_calls[body_calls.index(dotted(call.func)) :]):
            return "the FULL branch does not replay after pre_forward"
        for w in (w for stmt in node.orelse for w in ast.walk(stmt) if isinstance(w, ast.With)):
            ctx = w.items[0].context_expr
            if not (isinstance(ctx, ast.Call) and dotted(ctx.func).endswith("set_forward_context")):
                continue
            if "self.kv_connector.pre_forward" not in [dotted(c.func) for c in _calls(w.body)]:
                continue
            num_tokens = next((k.value for k in ctx.keywords if k.arg == "num_tokens"), None)
            if not ctx.args or not _is_path(ctx.args[0]):
                return "the other branch's set_forward_context has no plain attention-metadata argument"
            if not (
                isinstance(num_tokens, ast.Attribute)
                and num_tokens.attr == "num_tokens_after_padding"
                and isinstance(num_tokens.value, ast.Name)
            ):
                return (
                    "the other branch's set_forward_context is not sized by <batch>.num_tokens_after_padding"
                )
            return CallerRecipe(
                code=func.__code__,
                first_line=call.lineno + offset,
                last_line=(call.end_lineno or call.lineno) + offset,
                attn_metadata=tuple(dotted(ctx.args[0]).split(".")),
                input_batch=num_tokens.value.id,
                sync_only="has_sync_kv_loads" in inspect.getsource(_function(pre_forward)),
            )
        return "the non-FULL branch no longer calls pre_forward inside set_forward_context"
    return "no FULL branch calling self.kv_connector.pre_forward in execute_model"


def caller_frame() -> types.FrameType | None:
    """The wrapper's caller's frame (the wrapper itself is one frame up from here)."""
    return sys._getframe(2)
