"""`vllm-fixes backport`: carry fixes natively in a fork's source tree, verified before offered.

Per fix: ask the tree (the fix's probe, in a child process with the tree first on the path and
the runtime fixes switched off) whether it needs the fix; if it does, run the fix's native
transformation (`Fix.native`), write the edits into a scratch copy of the tree, check that the
changed files compile, and ask the scratch copy again: only an answer of "fixed upstream"
("carries it already") lets the edits be offered. Nothing is ever half-applied: a fix whose edits
do not verify is left out, with its reason.
"""

from __future__ import annotations

import enum
import json
import os
import py_compile
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from vllm_fix_core.declaration import Fix
from vllm_fix_core.native import CannotCarry, NativeEdit, SourceTree, merge


class Carried(str, enum.Enum):
    """What `backport` says of one fix for one tree (`--json` key "result")."""

    WRITTEN = "written and verified"
    NOT_NEEDED = "not needed"
    CANNOT = "cannot be carried natively here"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Result:
    fix_id: str
    result: Carried
    reason: str
    edits: tuple[NativeEdit, ...] = field(default=(), repr=False)

    def record(self) -> dict[str, object]:
        return {
            "fix": self.fix_id,
            "result": self.result.value,
            "reason": self.reason,
            "files": [e.path for e in self.edits],
        }


def scratch_copy(tree: SourceTree, dest: Path) -> SourceTree:
    """The tree's `vllm/` package under `dest`, hard-linked where the file system allows.

    Edits are always written by replacing a file (never through it), so the original tree's
    files are never changed through a shared link."""
    target = dest / "vllm"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    try:
        shutil.copytree(tree.root / "vllm", target, copy_function=os.link, ignore=ignore, symlinks=True)
    except OSError:
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(tree.root / "vllm", target, ignore=ignore, symlinks=True)
    return SourceTree(dest)


def write_edits(root: Path, edits: Iterable[NativeEdit]) -> None:
    """Each edit's new text replaces its file (a new file moved into place, so links stay intact)."""
    for edit in edits:
        path = root / edit.path
        current = path.read_text(encoding="utf-8")
        if current != edit.before:
            raise CannotCarry(f"{edit.path} changed since the edit was made")
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(edit.after)
            shutil.copymode(path, tmp)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise


def compile_edits(root: Path, edits: Iterable[NativeEdit]) -> None:
    for edit in edits:
        try:
            py_compile.compile(str(root / edit.path), doraise=True, cfile=os.devnull)
        except py_compile.PyCompileError as exc:
            raise CannotCarry(f"the changed {edit.path} does not compile: {exc.msg}") from exc


def ask_tree(tree: SourceTree, fix: Fix, timeout: float = 900) -> dict[str, str]:
    """The fix's dry-run answer for `tree` ({fix, answer, reason}), from a child process that
    imports vLLM from the tree, with every runtime fix switched off."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree.root), env.get("PYTHONPATH", "")) if p)
    env["VLLM_FIXES_DISABLE"] = "all"
    cmd = [
        sys.executable,
        "-m",
        "vllm_fix_core.backport",
        "--child",
        fix.id,
        f"{fix.entry_point}.declaration",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise CannotCarry(
            f"the check of the tree did not complete (exit {proc.returncode}): {' | '.join(tail)}"
        )
    record: dict[str, str] = json.loads(lines[-1])
    imported = Path(record.pop("vllm", "") or "/")
    if not imported.is_relative_to(tree.root.resolve()):
        raise CannotCarry(f"the check imported vLLM from {imported}, not from the tree {tree.root}")
    return record


def carry(fix: Fix, tree: SourceTree, workdir: Path) -> Result:
    """Decide, transform, verify: the Result for one fix (never raises for the tree's sake)."""
    try:
        return _carry(fix, tree, workdir)
    except CannotCarry as exc:
        return Result(fix.id, Carried.CANNOT, str(exc))


_NOT_NEEDED = {
    "fixed upstream": "the tree carries it already",
    "not applicable": "not applicable to this tree",
}


def _carry(fix: Fix, tree: SourceTree, workdir: Path) -> Result:
    before = ask_tree(tree, fix)
    if before["answer"] in _NOT_NEEDED:
        return Result(fix.id, Carried.NOT_NEEDED, f"{_NOT_NEEDED[before['answer']]} ({before['reason']})")
    if before["answer"] != "would fix" and before["answer"] != "refused":
        raise CannotCarry(f"the tree's answer is {before['answer']}: {before['reason']}")
    if fix.native is None:
        raise CannotCarry("this fix has no native transformation")
    try:
        edits = merge(fix.native(tree))
    except CannotCarry:
        raise
    except Exception as exc:
        raise CannotCarry(f"the transformation failed on this tree: {exc!r}") from exc
    if not edits:
        raise CannotCarry("the transformation changed nothing, yet the tree needs the fix")
    scratch = scratch_copy(tree, workdir / fix.id)
    write_edits(scratch.root, edits)
    compile_edits(scratch.root, edits)
    after = ask_tree(scratch, fix)
    if after["answer"] != "fixed upstream":
        raise CannotCarry(
            f"the change did not verify: the changed tree answers {after['answer']}: {after['reason']}"
        )
    return Result(
        fix.id, Carried.WRITTEN, "the changed tree carries it already (probe verified)", tuple(edits)
    )


def _child(fix_id: str, declaration: str) -> int:
    """In the child: import the declaration, run the ladder without applying, print the record."""
    import importlib

    from vllm_fix_core.ladder import evaluate
    from vllm_fix_core.settings import Settings

    fix = importlib.import_module(declaration).FIX
    if fix.id != fix_id:
        raise SystemExit(f"{declaration} declares {fix.id}, not {fix_id}")
    decision = evaluate(fix, Settings(disabled=frozenset(), strict=False), apply=False, honour_disable=False)
    vllm = sys.modules.get("vllm")
    where = str(Path(vllm.__file__).resolve()) if vllm is not None and vllm.__file__ else ""
    sys.stdout.write(json.dumps({**decision.record(), "vllm": where}, ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":  # pragma: no cover - the child process
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        raise SystemExit(_child(sys.argv[2], sys.argv[3]))
    raise SystemExit("usage: python -m vllm_fix_core.backport --child FIX_ID DECLARATION_MODULE")
