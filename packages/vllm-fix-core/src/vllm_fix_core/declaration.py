"""The single declaration of a fix: everything else (runtime, CLI, docs, tests) reads it."""

from __future__ import annotations

import enum
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_fix_core.native import NativeEdit, SourceTree
    from vllm_fix_core.patching import PatchSet


class ProcessKind(str, enum.Enum):
    """The vLLM process that runs a target (general plugins load in all three)."""

    API_SERVER = "api-server"
    ENGINE_CORE = "engine-core"
    WORKER = "worker"


class UpstreamStatus(str, enum.Enum):
    """DEP-3 flavoured lifecycle of the upstream change."""

    PENDING = "pending"  # submitted upstream, not merged
    CLOSED = "closed"  # upstream attempt closed without merging; we carry it
    MERGED = "merged"  # merged upstream; `merged_in` says from which release
    NOT_SUBMITTED = "not-submitted"


@dataclass(frozen=True)
class Upstream:
    pr: int
    status: UpstreamStatus
    merged_in: str | None = None
    note: str = ""

    @property
    def url(self) -> str:
        return f"https://github.com/vllm-project/vllm/pull/{self.pr}"


@dataclass(frozen=True)
class Target:
    """One vLLM object the fix changes: `module` + dotted `qualname` inside it."""

    module: str
    qualname: str
    process: ProcessKind
    # An optional target exists only in some vLLM releases (a method added later, say): where it
    # is absent the fix patches the others and does not count the release as "not applicable".
    optional: bool = False

    @property
    def path(self) -> str:
        return f"{self.module}:{self.qualname}"

    def resolve(self) -> tuple[Any, str, Any]:
        """Import the module and return (owner, attribute name, raw attribute).

        The raw attribute is looked up statically through the MRO, so a
        classmethod or staticmethod comes back as its descriptor.
        """
        owner, attr = resolve_qualname(importlib.import_module(self.module), self.qualname)
        return owner, attr, static_lookup(owner, attr)


def resolve_qualname(root: Any, qualname: str) -> tuple[Any, str]:
    """(owner, attribute name) of the dotted `qualname` inside `root` (a module or a class):
    ``resolve_qualname(module, "Class.method")`` is ``(module.Class, "method")``.

    AttributeError when a parent on the way is absent; the attribute itself is not looked up.
    """
    owner: Any = root
    *parents, attr = qualname.split(".")
    for name in parents:
        owner = getattr(owner, name)
    return owner, attr


_MISSING = object()


def static_lookup(owner: Any, attr: str) -> Any:
    """`owner.attr` without running descriptors; AttributeError when absent."""
    if isinstance(owner, type):
        for klass in owner.__mro__:
            if attr in klass.__dict__:
                return klass.__dict__[attr]
        raise AttributeError(f"{owner.__qualname__} has no attribute {attr!r}")
    value = getattr(owner, "__dict__", {}).get(attr, _MISSING)
    if value is _MISSING:
        raise AttributeError(f"{owner!r} has no attribute {attr!r}")
    return value


@dataclass(frozen=True)
class Check:
    """One observable symptom the probe looked for.

    `affected` means the symptom is present. A `guard` check is not a symptom
    of the bug but a behaviour that must stay correct (a real remote prefill
    still loads, say): `affected` on a guard means that behaviour is broken.
    """

    name: str
    affected: bool
    detail: str = ""
    guard: bool = False


@dataclass(frozen=True)
class ProbeReport:
    checks: tuple[Check, ...]

    @property
    def affected(self) -> bool:
        """This vLLM shows at least one symptom of the bug."""
        return any(c.affected for c in self.checks if not c.guard)

    @property
    def broken_guards(self) -> list[str]:
        return [c.name for c in self.checks if c.guard and c.affected]

    def names(self, affected: bool) -> list[str]:
        return [c.name for c in self.checks if not c.guard and c.affected is affected]

    def summary(self) -> str:
        def state(c: Check) -> str:
            if c.guard:
                return "BROKEN" if c.affected else "ok"
            return "affected" if c.affected else "ok"

        return ", ".join(f"{c.name}={state(c)}" for c in self.checks)


class UnknownShape(Exception):
    """Raised by a fix's `recognize` when the target is not a shape it knows."""


class NotApplicable(Exception):
    """Raised by a fix's `probe` or `recognize` when this vLLM lacks the code the bug lives in.

    Only for a *feature* that is absent (no shared memory region, no hybrid READ, no Kimi K3
    parser): the bug cannot happen here, so the answer is "not applicable", logged at DEBUG.
    A target that exists but looks unfamiliar is UnknownShape, never this.
    """


@dataclass(frozen=True)
class Links:
    """What a fix runs, typed (mypy checks each declaration's links against these):

    * probe() -> ProbeReport: CPU-only behavioural check against the real, currently installed
      target; `affected` means "this vLLM has the bug".
    * recognize() -> str: the name of the known target shape, or raises UnknownShape (the
      answer is then "refused").
    * apply(patch, shape) -> None: install the fix through `patch` (which records everything,
      so that revert is exact).
    """

    probe: Callable[[], ProbeReport]
    recognize: Callable[[], str]
    apply: Callable[[PatchSet, str], None]


@dataclass(frozen=True)
class Fix:
    """A fix, declared once.

    `probe`, `recognize` and `apply` are "module:function" references so that
    loading the declaration (at vLLM plugin load) imports nothing heavy:

    * probe() -> ProbeReport: CPU-only behavioural check against the real,
      currently installed target; `affected` means "this vLLM has the bug".
    * recognize() -> str: the name of the known target shape, or raises
      UnknownShape (the answer is then "refused").
    * apply(patch: PatchSet, shape: str) -> None: install the fix through
      `patch` (which records everything so revert is exact).
    """

    id: str
    title: str
    distribution: str
    upstream: tuple[Upstream, ...]
    why: str
    how: str
    retire_when: str
    targets: tuple[Target, ...]
    links: Callable[[], Links]
    # Module whose import triggers the decision in a process (defaults to the
    # first target's module). It must import every other target module itself.
    trigger: str = ""
    notes: tuple[str, ...] = field(default=())
    # How a fork carries the fix in its own source (`vllm-fixes backport`): the edits for a tree,
    # or CannotCarry saying why (see vllm_fix_core.native). None: no native transformation.
    native: Callable[[SourceTree], list[NativeEdit]] | None = None
    # What a tree carrying the native change needs beyond its own code, one line each (a MORI
    # version, say): `backport` reports it with every change it writes (JSON "requires", the
    # patch's header).
    native_requires: tuple[str, ...] = ()

    @property
    def trigger_module(self) -> str:
        return self.trigger or self.targets[0].module

    @property
    def entry_point(self) -> str:
        return "vllm_fix_" + self.id.replace("-", "_")

    @property
    def processes(self) -> tuple[ProcessKind, ...]:
        seen: dict[ProcessKind, None] = {}
        for t in self.targets:
            seen.setdefault(t.process)
        return tuple(seen)

    def run_probe(self) -> ProbeReport:
        report = self.links().probe()
        if not isinstance(report, ProbeReport):
            raise TypeError(f"probe of {self.id} returned {type(report).__name__}")
        return report

    def run_recognize(self) -> str:
        return str(self.links().recognize())

    def run_apply(self, patch: PatchSet, shape: str) -> None:
        self.links().apply(patch, shape)
