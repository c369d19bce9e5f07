"""What the probe needs to know about the installed MRV2 runner, read from the installed code.

All release-specific knowledge of the probe lives here, and each answer is read from the
installed vLLM (class fields, signatures, the runner's own source), never from a version
number:

* the state ``execute_model`` leaves for ``sample_tokens``: a tuple unpacked in
  ``sample_tokens`` (0.15 - 0.17) or an ``ExecuteModelState`` named tuple (0.18 onwards) whose
  fields change from release to release;
* where the step's KV connector output is collected: at the end of ``execute_model``, before
  the drafter runs (0.15 - 0.21), or in ``sample_tokens`` (0.22 onwards);
* what ``ActiveKVConnector.post_forward`` takes first: the scheduler output (0.15 - 0.21) or
  the finished request ids (0.22 onwards).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any


def _function_tree(func: Any) -> ast.AST:
    return ast.parse(textwrap.dedent(inspect.getsource(func)))


def _called_names(func: Any) -> set[str]:
    names = set()
    for node in ast.walk(_function_tree(func)):
        if isinstance(node, ast.Call):
            target = node.func
            names.add(target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", ""))
    return names


def collects_in_execute_model(runner_cls: Any) -> bool:
    """Does the installed execute_model collect the last pipeline stage's KV connector output?

    From 0.22 execute_model calls post_forward only for a non-last stage, and sample_tokens
    collects the last stage's output: that is not this shape.
    """
    return "post_forward" in _called_names(runner_cls.execute_model) and "post_forward" not in _called_names(
        runner_cls.sample_tokens
    )


def post_forward_takes_scheduler_output(active_cls: Any) -> bool:
    """Is post_forward's first argument the scheduler output (rather than the finished ids)?"""
    params = list(inspect.signature(active_cls.post_forward).parameters)
    return len(params) > 1 and params[1] == "scheduler_output"


def _unpacked_names(runner_cls: Any) -> list[str] | None:
    """The names sample_tokens unpacks ``self.execute_model_state`` into, when it unpacks a tuple."""
    for node in ast.walk(_function_tree(runner_cls.sample_tokens)):
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Tuple)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "execute_model_state"
        ):
            return [elt.id if isinstance(elt, ast.Name) else "" for elt in node.targets[0].elts]
    return None


def step_state(model_runner_module: Any, values: dict[str, Any]) -> Any:
    """The state execute_model leaves for sample_tokens, in the installed runner's form.

    Fields the probe has no value for (a release's data-parallel sync state, say) are None.
    """
    state_cls = getattr(model_runner_module, "ExecuteModelState", None)
    fields = getattr(state_cls, "_fields", None)
    if state_cls is not None and isinstance(fields, tuple):
        return state_cls(**{name: values.get(name) for name in fields})
    names = _unpacked_names(model_runner_module.GPUModelRunner)
    if names is None:
        raise RuntimeError("sample_tokens neither reads an ExecuteModelState nor unpacks a tuple")
    return tuple(values.get(name) for name in names)
