"""Apply: a wrapper around ActiveKVConnector.pre_forward that opens the FULL step's context."""

from __future__ import annotations

import ast
import inspect
from typing import Any

from vllm_fix_core import NotApplicable, PatchSet, UnknownShape, ast_fingerprint, function_ast, get_logger
from vllm_fix_core.fingerprint import call_params
from vllm_fix_sync_load_context import shapes
from vllm_fix_sync_load_context.rule import full_step_context

_logger = get_logger("sync-load-context")

# Normalized-AST fingerprints (vllm_fix_core.ast_fingerprint) of the known targets:
# ActiveKVConnector.pre_forward and the _start_load_kv it calls (identical in both).
KNOWN_SHAPES = {
    ("686d1266f7486650", "0376dd87d5351188"): "vllm-0.32.0/0.33.0",
}
PRE_FORWARD_PARAMS = shapes.BATCH_IN_ARGUMENTS
CONTEXT_PARAMS = {
    "dp_metadata",
    "cudagraph_runtime_mode",
    "batch_descriptor",
    "additional_kwargs",
}
# The shape name apply() is handed for vLLM 0.15-0.31 (see shapes.py).
CALLER_SHAPE = "batch-in-caller"


def _modules() -> tuple[Any, Any, Any]:
    import vllm.forward_context as fc

    try:
        from vllm.v1.worker.gpu import kv_connector, model_runner
    except ImportError as exc:  # vLLM 0.14: the V2 runner has no KV connector
        raise NotApplicable(f"the V2 model runner has no KV connector: {exc}") from exc

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


def _context_problem(fc: Any, *, padding: bool) -> str | None:
    wanted = CONTEXT_PARAMS | ({"is_padding"} if padding else set())
    missing = wanted - set(inspect.signature(fc.create_forward_context).parameters)
    if missing or not hasattr(fc, "override_forward_context") or not hasattr(fc, "DPMetadata"):
        return f"vllm.forward_context lacks {sorted(missing) or 'override_forward_context'}"
    return None


def _uses_open_context(*funcs: Any) -> bool:
    calls = {_dotted(c.func) for f in funcs for c in ast.walk(function_ast(f)) if isinstance(c, ast.Call)}
    return {"is_forward_context_available", "get_forward_context"} <= calls


def _recognize_caller(cls: Any, fc: Any, model_runner: Any) -> str:
    """vLLM 0.15-0.31: pre_forward gets no input batch; the step is read from the runner's frame."""
    pre_forward = cls.__dict__["pre_forward"]
    recipe = shapes.caller_recipe(model_runner.GPUModelRunner.execute_model, pre_forward)
    if isinstance(recipe, str):
        raise UnknownShape(f"pre_forward carries no input batch and {recipe}")
    start_load = cls.__dict__.get("_start_load_kv")
    funcs = (pre_forward,) if start_load is None else (pre_forward, start_load)
    if "start_load_kv" not in inspect.getsource(pre_forward) or not _uses_open_context(*funcs):
        raise UnknownShape("pre_forward does not start loads in an already open forward context")
    problem = _context_problem(fc, padding=False)
    if problem:
        raise UnknownShape(problem)
    return CALLER_SHAPE


def recognize() -> str:
    kv_connector, fc, model_runner = _modules()
    cls = kv_connector.ActiveKVConnector
    pre_forward = cls.__dict__.get("pre_forward")
    if pre_forward is None:
        raise UnknownShape("ActiveKVConnector.pre_forward is not defined on the class")
    # A keyword-only parameter with a default that a release adds is passed through.
    known = {name for shape in (*shapes.BATCH_IN_CALLER, PRE_FORWARD_PARAMS) for name in shape}
    params = call_params(pre_forward, known)
    if params in shapes.BATCH_IN_CALLER:
        return _recognize_caller(cls, fc, model_runner)
    if params != PRE_FORWARD_PARAMS:
        raise UnknownShape(
            f"pre_forward{tuple(params)} carries no input batch this fix knows how to find (see shapes.py)"
        )
    start_load = cls.__dict__.get("_start_load_kv")
    if start_load is None:
        raise UnknownShape("ActiveKVConnector._start_load_kv is not defined on the class")
    problem = full_branch_problem(model_runner.GPUModelRunner.execute_model) or _context_problem(
        fc, padding=True
    )
    if problem:
        raise UnknownShape(problem)
    shape = KNOWN_SHAPES.get((ast_fingerprint(pre_forward), ast_fingerprint(start_load)))
    if shape:
        return shape
    # A wrapper only needs pre_forward to start sync loads through _start_load_kv, and
    # _start_load_kv to use an already open context instead of opening its own.
    if "has_sync_kv_loads" not in inspect.getsource(pre_forward) or "_start_load_kv" not in inspect.getsource(
        pre_forward
    ):
        raise UnknownShape("pre_forward no longer starts sync loads through _start_load_kv")
    if not _uses_open_context(start_load):
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


def _run_in_step_context(
    override: Any,
    wrapped: Any,
    instance: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    step: tuple[Any, Any],
) -> Any:
    """`wrapped(*args, **kwargs)` inside the FULL step's context; vLLM's own path where it cannot be built."""
    attn_metadata, input_batch = step
    # A batch without a padded token count has no FULL graph size to describe: vLLM's
    # own fallback context, as unpatched.
    if getattr(input_batch, "num_tokens_after_padding", None) is None:
        _WARN.warn(
            "no-padding",
            "a FULL-replay step's input batch has no num_tokens_after_padding: its synchronous "
            "KV load runs in vLLM's fallback context (as without the fix)",
        )
        return wrapped(*args, **kwargs)
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


def _make_wrapper(fc: Any) -> Any:
    """vLLM 0.32 on: the step's input batch and attn_metadata are pre_forward's arguments."""
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
        attn_metadata = args[2] if len(args) > 2 else kwargs.get("attn_metadata")
        return _run_in_step_context(override, wrapped, instance, args, kwargs, (attn_metadata, input_batch))

    return wrapper


def _make_caller_wrapper(fc: Any, recipe: shapes.CallerRecipe) -> Any:
    """vLLM 0.15-0.31: the step is read from the runner frame executing the FULL branch's call."""
    available = fc.is_forward_context_available
    override = fc.override_forward_context

    def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if instance is None or available() or getattr(instance, "_disabled", False):
            return wrapped(*args, **kwargs)
        if recipe.sync_only:
            scheduler_output = args[0] if args else kwargs.get("scheduler_output")
            if not getattr(scheduler_output, "has_sync_kv_loads", False):
                return wrapped(*args, **kwargs)
        try:
            step = recipe.step(shapes.caller_frame())
        except Exception:  # a frame we cannot read is vLLM's own path, never a new exception
            step = None
        # Not called from the FULL branch (no_forward, a dummy run without the names): untouched.
        if step is None:
            return wrapped(*args, **kwargs)
        return _run_in_step_context(override, wrapped, instance, args, kwargs, step)

    return wrapper


def apply(patch: PatchSet, shape: str) -> None:
    kv_connector, fc, model_runner = _modules()
    cls = kv_connector.ActiveKVConnector
    if shape != CALLER_SHAPE:
        patch.wrap(cls, "pre_forward", _make_wrapper(fc))
        return
    recipe = shapes.caller_recipe(model_runner.GPUModelRunner.execute_model, cls.__dict__["pre_forward"])
    if isinstance(recipe, str):  # recognize() saw the same code a moment ago
        raise UnknownShape(recipe)
    patch.wrap(cls, "pre_forward", _make_caller_wrapper(fc, recipe))
