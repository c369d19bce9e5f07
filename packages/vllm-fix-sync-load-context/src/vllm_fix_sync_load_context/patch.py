"""Apply: a wrapper around ActiveKVConnector.pre_forward that opens the FULL step's context."""

from __future__ import annotations

import ast
import inspect
from typing import Any

from vllm_fix_core import PatchSet, UnknownShape, ast_fingerprint, function_ast, get_logger
from vllm_fix_sync_load_context.rule import full_step_context

_logger = get_logger("sync-load-context")

# Normalized-AST fingerprints (vllm_fix_core.ast_fingerprint) of the known targets:
# ActiveKVConnector.pre_forward and the _start_load_kv it calls (identical in both).
KNOWN_SHAPES = {
    ("686d1266f7486650", "0376dd87d5351188"): "vllm-0.32.0/0.33.0",
}
PRE_FORWARD_PARAMS = ["self", "scheduler_output", "input_batch", "attn_metadata"]
CONTEXT_PARAMS = {
    "dp_metadata",
    "cudagraph_runtime_mode",
    "batch_descriptor",
    "additional_kwargs",
    "is_padding",
}


def _modules() -> tuple[Any, Any, Any]:
    import vllm.forward_context as fc
    from vllm.v1.worker.gpu import kv_connector, model_runner

    return kv_connector, fc, model_runner


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    if isinstance(node, ast.Name):
        return node.id
    return ""


def _calls(nodes: list[ast.stmt]) -> list[ast.Call]:
    return [n for stmt in nodes for n in ast.walk(stmt) if isinstance(n, ast.Call)]


def full_branch_problem(execute_model: Any) -> str | None:
    """Why execute_model's FULL branch is not the shape this fix assumes, or None if it is.

    The shape: an `if ... CUDAGraphMode.FULL` whose body calls
    `self.kv_connector.pre_forward(<scheduler_output>, <input_batch>, attn_metadata=...)` outside
    any `with`, then `self.cudagraph_manager.run_fullgraph(...)`; the other branch calls
    `pre_forward` inside `with set_forward_context(...)`.
    """
    tree = function_ast(execute_model)
    for node in ast.walk(tree):
        if not isinstance(node, ast.If) or "CUDAGraphMode.FULL" not in ast.unparse(node.test):
            continue
        body_calls = [_dotted(c.func) for c in _calls(node.body)]
        if "self.kv_connector.pre_forward" not in body_calls:
            continue
        if any(isinstance(stmt, (ast.With, ast.AsyncWith)) for stmt in node.body):
            return "the FULL branch already opens a context around pre_forward"
        pre = next(c for c in _calls(node.body) if _dotted(c.func) == "self.kv_connector.pre_forward")
        if len(pre.args) != 2 or [k.arg for k in pre.keywords] != ["attn_metadata"]:
            return f"the FULL branch calls {ast.unparse(pre)}, without the input batch and attn_metadata"
        if body_calls.index("self.kv_connector.pre_forward") > max(
            (i for i, name in enumerate(body_calls) if name.endswith(".run_fullgraph")), default=-1
        ):
            return "the FULL branch does not replay after pre_forward"
        others = [w for stmt in node.orelse for w in ast.walk(stmt) if isinstance(w, ast.With)]
        if not any(
            "set_forward_context" in ast.unparse(w.items[0].context_expr)
            and "self.kv_connector.pre_forward" in [_dotted(c.func) for c in _calls(w.body)]
            for w in others
        ):
            return "the non-FULL branch no longer calls pre_forward inside set_forward_context"
        return None
    return "no FULL branch calling self.kv_connector.pre_forward in execute_model"


def recognize() -> str:
    kv_connector, fc, model_runner = _modules()
    cls = kv_connector.ActiveKVConnector
    pre_forward = cls.__dict__.get("pre_forward")
    if pre_forward is None:
        raise UnknownShape("ActiveKVConnector.pre_forward is not defined on the class")
    params = list(inspect.signature(pre_forward).parameters)
    if params != PRE_FORWARD_PARAMS:
        raise UnknownShape(
            f"pre_forward{tuple(params)} carries no input batch: the step's padded token count and "
            "padding mask cannot be recovered"
        )
    start_load = cls.__dict__.get("_start_load_kv")
    if start_load is None:
        raise UnknownShape("ActiveKVConnector._start_load_kv is not defined on the class")
    problem = full_branch_problem(model_runner.GPUModelRunner.execute_model)
    if problem:
        raise UnknownShape(problem)
    missing = CONTEXT_PARAMS - set(inspect.signature(fc.create_forward_context).parameters)
    if missing or not hasattr(fc, "override_forward_context") or not hasattr(fc, "DPMetadata"):
        raise UnknownShape(f"vllm.forward_context lacks {sorted(missing) or 'override_forward_context'}")
    shape = KNOWN_SHAPES.get((ast_fingerprint(pre_forward), ast_fingerprint(start_load)))
    if shape:
        return shape
    # A wrapper only needs pre_forward to start sync loads through _start_load_kv, and
    # _start_load_kv to use an already open context instead of opening its own.
    if "has_sync_kv_loads" not in inspect.getsource(pre_forward) or "_start_load_kv" not in inspect.getsource(
        pre_forward
    ):
        raise UnknownShape("pre_forward no longer starts sync loads through _start_load_kv")
    calls = {_dotted(c.func) for c in ast.walk(function_ast(start_load)) if isinstance(c, ast.Call)}
    if not {"is_forward_context_available", "get_forward_context"} <= calls:
        raise UnknownShape("_start_load_kv does not use an already open forward context")
    return "structural"


class _Once:
    """One WARNING per kind of problem per process (a FULL step runs many times a second)."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def warn(self, kind: str, message: str, *args: Any) -> None:
        if kind not in self.seen:
            self.seen.add(kind)
            _logger.warning(message, *args)


_WARN = _Once()


def _make_wrapper(fc: Any) -> Any:
    available = fc.is_forward_context_available
    override = fc.override_forward_context

    def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # Inside a context (PIECEWISE/NONE), no forward (no input batch), async loads only, or
        # a class-level call: vLLM's own code path, untouched.
        if instance is None or available():
            return wrapped(*args, **kwargs)
        input_batch = args[1] if len(args) > 1 else kwargs.get("input_batch")
        if input_batch is None or getattr(instance, "_disabled", False):
            return wrapped(*args, **kwargs)
        scheduler_output = args[0] if args else kwargs.get("scheduler_output")
        if not getattr(scheduler_output, "has_sync_kv_loads", False):
            return wrapped(*args, **kwargs)
        # A batch without a padded token count has no FULL graph size to describe: vLLM's
        # own fallback context, as unpatched.
        if getattr(input_batch, "num_tokens_after_padding", None) is None:
            _WARN.warn(
                "no-padding",
                "a FULL-replay step's input batch has no num_tokens_after_padding: its synchronous "
                "KV load runs in vLLM's fallback context (as without the fix)",
            )
            return wrapped(*args, **kwargs)
        attn_metadata = args[2] if len(args) > 2 else kwargs.get("attn_metadata")
        try:
            context = full_step_context(instance.vllm_config, attn_metadata, input_batch)
        except Exception as exc:  # never raise where vLLM does not: fall back to vLLM's path
            _WARN.warn(
                "context",
                "could not build the FULL-replay step's forward context (%r): its synchronous KV "
                "load runs in vLLM's fallback context (as without the fix)",
                exc,
            )
            return wrapped(*args, **kwargs)
        # Closed before the runner replays, also when the connector raises.
        with override(context):
            return wrapped(*args, **kwargs)

    return wrapper


def apply(patch: PatchSet, shape: str) -> None:
    kv_connector, fc, _ = _modules()
    patch.wrap(kv_connector.ActiveKVConnector, "pre_forward", _make_wrapper(fc))
