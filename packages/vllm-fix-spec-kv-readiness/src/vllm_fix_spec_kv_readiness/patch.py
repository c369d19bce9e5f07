"""Apply: wrappers around ActiveKVConnector.post_forward / finalize_step and AsyncOutput.get_output.

Two shapes of MRV2 ``sample_tokens`` exist:

* ``deferred-finalize`` (0.33.0): ``post_forward(..., defer_finalize=True)`` runs before the
  draft forward and drains the step's transfer results there; ``finalize_step()`` runs
  ``wait_for_save`` after the draft. Patched, the deferred ``post_forward`` starts pending
  async loads (as vLLM does) and returns an empty output object that the runner stores in its
  ``ModelRunnerOutput``; ``finalize_step`` then runs vLLM's own non-deferred ``post_forward``
  (``wait_for_save``, one drain, clear metadata: exactly a non-speculative step's order) and
  fills that object in.
* ``post-forward-after-draft`` (0.22 - 0.32.0): ``post_forward`` already runs after the draft;
  only readiness is missing.
* ``collected-in-execute-model`` (0.15 - 0.21 and forks built from them): ``execute_model``
  ends with ``post_forward(scheduler_output)`` (``wait_for_save``, the drain, clear metadata)
  before ``sample_tokens`` runs the drafter. Patched, with speculative decoding on (and no
  pipeline parallelism), that call returns an empty output object that execute_model stores in
  its state; when ``GPUModelRunner.sample_tokens`` returns (the draft submitted), vLLM's own
  ``post_forward`` runs with the same arguments and fills that object in: the order of the
  0.22+ runners.

Readiness (both shapes): for connectors that publish blocks for a remote READ, a device event
is recorded after the step's last draft kernel and ``AsyncOutput.get_output`` waits on it.
"""

from __future__ import annotations

import ast
import inspect
import weakref
from collections.abc import Callable
from typing import Any

from vllm_fix_core import PatchSet, UnknownShape, ast_fingerprint, function_ast, get_logger, original_of
from vllm_fix_spec_kv_readiness.readiness import (
    STEP_DONE,
    copy_into,
    defers_collection,
    needs_step_done,
    record_step_done,
)

DEFERRED = "deferred-finalize"
AFTER_DRAFT = "post-forward-after-draft"
IN_EXECUTE = "collected-in-execute-model"

# Normalized-AST fingerprints (vllm_fix_core.ast_fingerprint) of ActiveKVConnector.post_forward.
KNOWN_SHAPES = {
    "bac407be37d1c7cb": "vllm-0.24.0..0.28.0",
    "0ff3ef7dac6338fe": "vllm-0.31.0..0.32.0",
    "3199ac3deda0aedb": "vllm-0.33.0",
}
_logger = get_logger("spec-kv-readiness")


def _modules() -> tuple[Any, Any, Any]:
    from vllm.v1.worker.gpu import async_utils, kv_connector, model_runner

    return kv_connector, async_utils, model_runner


def call_order(func: Any) -> list[tuple[str, frozenset[str]]]:
    """Calls in `func`'s body in source order: (called name, keyword names)."""
    calls = []
    for node in ast.walk(function_ast(func)):
        if isinstance(node, ast.Call):
            target = node.func
            name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
            keywords = frozenset(k.arg for k in node.keywords if k.arg)
            calls.append((node.lineno, node.col_offset, name, keywords))
    calls.sort(key=lambda c: (c[0], c[1]))
    return [(name, keywords) for _, _, name, keywords in calls]


def _index(
    order: list[tuple[str, frozenset[str]]], name: str, *, keyword: str = "", last: bool = False
) -> int:
    found = [i for i, (n, kw) in enumerate(order) if n == name and (not keyword or keyword in kw)]
    if not found:
        return -1
    return found[-1] if last else found[0]


def recognize() -> str:
    kvc, au, mr = _modules()
    cls = kvc.ActiveKVConnector
    if "post_forward" not in cls.__dict__:
        raise UnknownShape("ActiveKVConnector.post_forward is not defined on the class")
    if "get_output" not in au.AsyncOutput.__dict__:
        raise UnknownShape("AsyncOutput.get_output is not defined on the class")
    return shape_of(
        original_of(cls, "post_forward"),
        original_of(mr.GPUModelRunner, "sample_tokens"),
        lambda: original_of(mr.GPUModelRunner, "execute_model"),
        has_finalize_step="finalize_step" in cls.__dict__,
    )


def shape_of(
    post: Any, sample_tokens: Any, execute_model: Callable[[], Any], *, has_finalize_step: bool
) -> str:
    """The shape of the MRV2 runner these functions (imported, or compiled from a source tree's
    files: the native carry asks the same question) make up; UnknownShape for any other."""
    params = list(inspect.signature(post).parameters)
    order = call_order(sample_tokens)
    drafts = [i for i in (_index(order, "propose"), _index(order, "propose_draft")) if i >= 0]
    propose = min(drafts) if drafts else -1
    output = _index(order, "AsyncOutput")
    if propose < 0 or output < 0 or output > propose:
        raise UnknownShape("sample_tokens no longer builds AsyncOutput before the drafter's propose()")
    source = inspect.getsource(post)
    for needed in ("wait_for_save", "clear_connector_metadata", "self._disabled"):
        if needed not in source:
            raise UnknownShape(f"post_forward no longer calls/reads {needed}")
    if params[:2] == ["self", "scheduler_output"]:
        executes = call_order(execute_model())
        if _index(executes, "post_forward") < 0 or _index(order, "post_forward") >= 0:
            raise UnknownShape(
                "post_forward takes the scheduler output but execute_model does not collect the "
                "KV connector output (or sample_tokens collects it too)"
            )
        shape = IN_EXECUTE
    elif params[:2] != ["self", "finished_req_ids"]:
        raise UnknownShape(f"unexpected signature post_forward{tuple(params)}")
    elif has_finalize_step:
        deferred = _index(order, "post_forward", keyword="defer_finalize")
        finalize = _index(order, "finalize_step")
        if "defer_finalize" not in params or not 0 <= deferred < propose < finalize:
            raise UnknownShape(
                "ActiveKVConnector.finalize_step exists but sample_tokens does not run "
                "post_forward(defer_finalize=...) -> propose() -> finalize_step()"
            )
        shape = DEFERRED
    else:
        if _index(order, "post_forward", last=True) < propose:
            raise UnknownShape("sample_tokens collects the KV connector output before the drafter runs")
        shape = AFTER_DRAFT
    return f"{shape}, {KNOWN_SHAPES.get(ast_fingerprint(post), 'structural')}"


# Per ActiveKVConnector: the output handed out by a deferred post_forward, and its finished ids.
# (0.15 - 0.21: the deferred post_forward call itself, to run once the drafter has run.)
_PENDING: weakref.WeakKeyDictionary[Any, tuple[Any, Any]] = weakref.WeakKeyDictionary()


def _post_forward_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, bool]:
    if len(args) == 1 and not kwargs:  # post_forward(finished_req_ids): the common call
        return args[0], False
    finished = args[0] if args else kwargs.get("finished_req_ids")
    defer = args[1] if len(args) > 1 else kwargs.get("defer_finalize", False)
    return finished, bool(defer)


def _deferred_post_forward(output_cls: Any, starts_loads: bool) -> Any:
    def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if instance is None:
            return wrapped(*args, **kwargs)
        finished, defer = _post_forward_args(args, kwargs)
        if not defer or instance._disabled:
            return wrapped(*args, **kwargs)
        # Async loads start now, as vLLM does; the drain waits for finalize_step.
        if starts_loads and instance._pending_load_kwargs is not None:
            instance._start_load_kv()
        placeholder = output_cls()
        # A step whose draft raised never finalized: its results were not drained, so they
        # are still in the connector and the next drain reports them.
        _PENDING[instance] = (placeholder, finished)
        return placeholder

    return wrapper


def _finalize_step(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    pending = _PENDING.pop(instance, None) if instance is not None else None
    if pending is None or instance._disabled:
        return wrapped(*args, **kwargs)
    placeholder, finished = pending
    # vLLM's own non-deferred post_forward: wait_for_save, one drain, clear the metadata.
    fresh = instance.post_forward(finished)
    if fresh is not None:
        copy_into(placeholder, fresh)
    if needs_step_done(instance):
        STEP_DONE.attach(placeholder, record_step_done())
    return None


def _post_forward_after_draft(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    output = wrapped(*args, **kwargs)
    if output is not None and instance is not None and needs_step_done(instance):
        STEP_DONE.attach(output, record_step_done())
    return output


def _collect_in_execute(output_cls: Any) -> Any:
    """post_forward as execute_model calls it (0.15 - 0.21): on a speculative step, hand out an
    empty output now and keep the call for when sample_tokens has run the drafter."""

    def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if instance is None or instance._disabled or not defers_collection(instance):
            return wrapped(*args, **kwargs)
        # Only the full call (wait_for_save and clear the metadata): no_forward's is not deferred.
        if len(args) + len(kwargs) > 1 or not (args or "scheduler_output" in kwargs):
            return wrapped(*args, **kwargs)
        placeholder = output_cls()
        # A deferred call never collected (no sample_tokens followed) is dropped: its results
        # are still in the connector, and this step's collection reports them.
        _PENDING[instance] = (placeholder, (wrapped, args, kwargs))
        return placeholder

    return wrapper


def _collect_after_draft(active: Any, result: Any) -> None:
    pending = _PENDING.pop(active, None)
    if pending is None:
        return
    placeholder, (collect, args, kwargs) = pending
    fresh = collect(*args, **kwargs)  # vLLM's own post_forward: wait_for_save, drain, clear
    if fresh is not None:
        copy_into(placeholder, fresh)
    if needs_step_done(active):
        event = record_step_done()
        if event is None:
            return
        if hasattr(result, "get_output"):  # async scheduling: whoever takes the output waits
            STEP_DONE.attach(placeholder, event)
        else:  # the output was taken inside sample_tokens: wait before it leaves the worker
            event.synchronize()


def _sample_tokens(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # Called through the class (GPUModelRunner.sample_tokens(runner, ...)), the runner is args[0].
    runner = instance if instance is not None else (args[0] if args else None)
    active = getattr(runner, "kv_connector", None)
    try:
        listed = active is not None and active in _PENDING
    except TypeError:  # not weak-referenceable: nothing of it is ever deferred
        listed = False
    if not listed:
        return wrapped(*args, **kwargs)
    try:
        result = wrapped(*args, **kwargs)
    except BaseException:
        try:  # still wait for the saves and clear the metadata, as vLLM had before the draft
            _collect_after_draft(active, None)
        except Exception:
            _logger.exception("collecting the KV connector output after a failed sample_tokens")
        raise
    _collect_after_draft(active, result)
    return result


def _get_output(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    result = wrapped(*args, **kwargs)
    runner_output = getattr(instance, "model_runner_output", None)
    event = STEP_DONE.take(getattr(runner_output, "kv_connector_output", None))
    if event is not None:
        event.synchronize()  # the step's draft KV is on the device before anyone sees the output
    return result


def apply(patch: PatchSet, shape: str) -> None:
    kvc, au, model_runner = _modules()
    cls = kvc.ActiveKVConnector
    if shape.startswith(IN_EXECUTE):
        from vllm.v1.outputs import KVConnectorOutput

        patch.wrap(cls, "post_forward", _collect_in_execute(KVConnectorOutput))
        patch.wrap(model_runner.GPUModelRunner, "sample_tokens", _sample_tokens)
    elif shape.startswith(DEFERRED):
        from vllm.v1.outputs import KVConnectorOutput

        starts_loads = "_pending_load_kwargs" in inspect.getsource(original_of(cls, "post_forward"))
        patch.wrap(cls, "post_forward", _deferred_post_forward(KVConnectorOutput, starts_loads))
        patch.wrap(cls, "finalize_step", _finalize_step)
    else:
        patch.wrap(cls, "post_forward", _post_forward_after_draft)
    patch.wrap(au.AsyncOutput, "get_output", _get_output)
    patch.on_revert(_forget)


def _forget() -> None:
    """Reverted, vLLM's own methods take nothing from these tables: drop what is still listed
    (outputs and their events, a deferred output never finalized)."""
    STEP_DONE.clear()
    _PENDING.clear()
