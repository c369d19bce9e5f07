"""Native carry: the change a fix makes, written into a fork's vLLM source tree.

A fix that can be carried natively declares `native=_native` in its declaration: a function that
takes the tree (`SourceTree`) and returns the edits (`NativeEdit`) that carry the fix's rule in
that tree's own code, or raises `CannotCarry` saying why it cannot here. The transformation
recognises the tree's code by the same shapes its runtime patch recognises, and changes only the
functions the bug lives in. `vllm_fix_core.backport` runs it on a scratch copy, verifies the
result with the fix's probe, and writes the diff.

This module imports nothing heavy; the source transformations themselves use libcst through
`vllm_fix_core.cst` (the `backport` extra).
"""

from __future__ import annotations

import difflib
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path


class CannotCarry(Exception):
    """This tree's code cannot carry the fix natively (the message says why, for the maintainer)."""


@dataclass(frozen=True)
class SourceTree:
    """A vLLM source tree: `root` is the folder that holds the `vllm/` package."""

    root: Path

    def path_of(self, module: str) -> Path:
        """The file of a dotted module name (a package's `__init__.py`)."""
        base = self.root.joinpath(*module.split("."))
        if base.is_dir():
            return base / "__init__.py"
        return base.with_suffix(".py")

    def relpath(self, module: str) -> str:
        return self.path_of(module).relative_to(self.root).as_posix()

    def has(self, module: str) -> bool:
        return self.path_of(module).is_file()

    def read(self, module: str) -> str:
        """The module's source; CannotCarry when the tree does not have it."""
        path = self.path_of(module)
        if not path.is_file():
            raise CannotCarry(f"the tree has no {module} ({self.relpath(module)})")
        return path.read_text(encoding="utf-8")

    def function(self, module: str, qualname: str) -> types.FunctionType:
        """The function at `qualname` compiled from the tree's file, never executed: what the
        runtime's shape checks (fingerprints, `inspect`) read of an imported function."""
        source = self.read(module)
        try:
            code = compile(source, str(self.path_of(module)), "exec", dont_inherit=True)
        except SyntaxError as exc:
            raise CannotCarry(f"{self.relpath(module)} does not compile: {exc}") from exc
        stack = [code]
        while stack:
            for const in stack.pop().co_consts:
                if isinstance(const, types.CodeType):
                    if const.co_qualname == qualname:
                        return types.FunctionType(const, {})
                    stack.append(const)
        raise CannotCarry(f"{self.relpath(module)} has no {qualname}")

    def edit(self, module: str, change: Callable[[str], str]) -> NativeEdit:
        """The edit that applies `change` to the module's source text."""
        before = self.read(module)
        return NativeEdit(self.relpath(module), before, change(before))


@dataclass(frozen=True)
class NativeEdit:
    """One file of the tree, before and after (paths relative to the tree's root)."""

    path: str
    before: str
    after: str

    @property
    def changed(self) -> bool:
        return self.before != self.after

    def diff(self) -> str:
        """A unified diff with a/ b/ prefixes (`git apply` and `patch -p1` accept it)."""
        lines = difflib.unified_diff(
            self.before.splitlines(keepends=True),
            self.after.splitlines(keepends=True),
            fromfile=f"a/{self.path}",
            tofile=f"b/{self.path}",
        )
        out = []
        for line in lines:
            out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
        return "".join(out)


Transform = Callable[[SourceTree], list[NativeEdit]]


def marker(fix_id: str, pr: int, what: str) -> str:
    """The one comment a native change carries: which fix, which upstream PR, what it does."""
    return f"# vllm-fixes {fix_id} (vllm-project/vllm#{pr}): {what}"


def merge(edits: Iterable[NativeEdit]) -> list[NativeEdit]:
    """Edits of the same file, chained in order (each one made on the previous one's result)."""
    merged: dict[str, NativeEdit] = {}
    for edit in edits:
        first = merged.get(edit.path)
        if first is not None and first.after != edit.before:
            raise ValueError(f"edits of {edit.path} do not chain")
        merged[edit.path] = NativeEdit(edit.path, first.before if first else edit.before, edit.after)
    return [e for e in merged.values() if e.changed]


__all__ = ["CannotCarry", "NativeEdit", "SourceTree", "Transform", "marker", "merge"]
