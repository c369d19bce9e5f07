"""The hostile-wrapper checks themselves, on a synthetic fix (no vLLM): they must catch a probe
that does not observe one of the patched targets, and pass one that observes them all."""

from __future__ import annotations

import importlib
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_fix_core import Answer, Settings, evaluate
from vllm_fix_core.declaration import Fix, Links, ProcessKind, Target, Upstream, UpstreamStatus
from vllm_fix_core.patching import layers_of
from vllm_fix_testing.hostile import (
    assert_every_target_observed,
    assert_hostile_wrapper_fails,
    patched_targets,
)

TARGET_SRC = """
def scale(x):
    return 10 * x  # the second bug: should be 100 * x


class Widget:
    def compute(self, x):
        return x + 1  # the first bug: should be x + 2

    def total(self, x):
        return self.compute(x) + scale(x)
"""

FIX_SRC = """
import importlib
from vllm_fix_core import Check, ProbeReport

MODULE = "{module}"
SEES = {{"scale": True}}


def probe():
    mod = importlib.import_module(MODULE)
    checks = [Check("compute", mod.Widget().compute(1) != 3)]
    if SEES["scale"]:
        checks.append(Check("scale", mod.scale(1) != 100))
    return ProbeReport(tuple(checks))


def recognize():
    return "demo"


def apply(patch, shape):
    mod = importlib.import_module(MODULE)
    patch.wrap(mod.Widget, "compute", lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs) + 1)
    # Patched, but not declared as a target: the per-target check still finds it.
    patch.wrap(mod, "scale", lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs) * 10)
"""


class Synthetic:
    def __init__(self, root: Path) -> None:
        tag = uuid.uuid4().hex[:8]
        self.module = f"hostile_target_{tag}"
        self.fix_module = f"hostile_fix_{tag}"
        (root / f"{self.module}.py").write_text(textwrap.dedent(TARGET_SRC))
        (root / f"{self.fix_module}.py").write_text(FIX_SRC.format(module=self.module))
        self.fix = Fix(
            id=f"hostile-demo-{tag}",
            title="demo",
            distribution="vllm-fix-demo",
            upstream=(Upstream(1, UpstreamStatus.PENDING),),
            why="w",
            how="h",
            retire_when="r",
            targets=(Target(self.module, "Widget.compute", ProcessKind.WORKER),),
            links=self.links,
        )

    def links(self) -> Links:
        module = importlib.import_module(self.fix_module)
        return Links(module.probe, module.recognize, module.apply)

    def sees_scale(self, value: bool) -> None:
        importlib.import_module(self.fix_module).SEES["scale"] = value

    def untouched(self) -> bool:
        mod = importlib.import_module(self.module)
        return layers_of(mod.Widget, "compute") == [] and layers_of(mod, "scale") == []


@pytest.fixture
def synthetic(tmp_path: Path) -> Iterator[Synthetic]:
    sys.path.insert(0, str(tmp_path))
    demo = Synthetic(tmp_path)
    yield demo
    sys.path.remove(str(tmp_path))
    for name in (demo.module, demo.fix_module):
        sys.modules.pop(name, None)


def test_patched_targets_are_what_apply_patched_declared_or_not(synthetic: Synthetic) -> None:
    assert patched_targets(synthetic.fix) == ["Widget.compute", f"{synthetic.module}.scale"]
    assert synthetic.untouched()


def test_a_probe_that_observes_every_target_passes(synthetic: Synthetic) -> None:
    decisions = assert_every_target_observed(synthetic.fix)
    assert set(decisions) == {"Widget.compute", f"{synthetic.module}.scale"}
    assert all(d.answer is Answer.FAILED_TO_FIX for d in decisions.values())
    assert synthetic.untouched()


def test_a_probe_blind_to_one_target_is_named_while_the_all_at_once_form_misses_it(
    synthetic: Synthetic,
) -> None:
    synthetic.sees_scale(False)
    # Every target undone at once: the probe notices (compute), so this form cannot tell.
    assert_hostile_wrapper_fails(synthetic.fix)
    with pytest.raises(AssertionError) as caught:
        assert_every_target_observed(synthetic.fix)
    message = str(caught.value)
    assert f"{synthetic.module}.scale" in message and "'affected → fixed'" in message
    assert "Widget.compute" not in message
    # The check reverted what the blind decision left applied.
    assert synthetic.untouched()
    real = evaluate(synthetic.fix, Settings(disabled=frozenset(), strict=False), apply=True)
    assert real.answer is Answer.AFFECTED_FIXED and real.patch is not None
    real.patch.revert()
    assert synthetic.untouched()
