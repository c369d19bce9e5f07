"""`vllm-fixes backport`: carry fixes natively in a fork's source tree, verified before offered.

Per fix: ask the tree (the fix's probe, in a child process with the tree first on the path and
the runtime fixes switched off) whether it needs the fix; if it does, run the fix's native
transformation (`Fix.native`), write the edits into a scratch copy of the tree, check that the
changed files compile, and ask the scratch copy again: only an answer of "fixed upstream"
("carries it already") lets the edits be offered. Nothing is ever half-applied: a fix whose edits
do not verify is left out, with its reason.

`backport(fixes, tree, workdir)` carries several fixes one after another on one scratch tree
that accumulates the verified edits, so a fix that edits a file another fix edited before it is
transformed (and verified) on the tree with those edits; its result holds the per-fix edits (the
patch's sections) and the edits against the original tree (what `--write` writes).

The child process imports a fix's declaration by the packages' convention,
`<Fix.entry_point>.declaration` (`vllm_fix_<id>.declaration`, its `FIX`); a synthetic fix in the
tests is a package of that name on PYTHONPATH.
"""

from __future__ import annotations

import enum
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from vllm_fix_core.declaration import Fix
from vllm_fix_core.native import CannotCarry, NativeEdit, SourceTree, merge


class Carried(str, enum.Enum):
    """What `backport` says of one fix for one tree (`--json` key "result"): one answer each."""

    WRITTEN = "written and verified"  # the change was written; the changed tree's probe sees no bug
    CARRIES_IT = "carries it already"  # the tree behaves correctly as it is: nothing written
    NOT_APPLICABLE = "not applicable"  # the code the bug lives in is not in the tree
    REFUSED = "refused"  # the tree needs it (or may) but no change is offered: the reason says why

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Result:
    fix_id: str
    result: Carried
    reason: str
    edits: tuple[NativeEdit, ...] = field(default=(), repr=False)
    # What a tree carrying the written change needs beyond its own code (Fix.native_requires).
    requires: tuple[str, ...] = ()

    def record(self) -> dict[str, object]:
        return {
            "fix": self.fix_id,
            "result": self.result.value,
            "reason": self.reason,
            "files": [e.path for e in self.edits],
            "requires": list(self.requires),
        }


def scratch_copy(tree: SourceTree, dest: Path) -> SourceTree:
    """The tree's `vllm/` package under `dest`, hard-linked where the file system allows.

    Edits are always written by replacing a file (never through it), so the original tree's
    files are never changed through a shared link.
    Links in the tree are followed: the copy holds real folders only, so an edit written into it
    can never reach a folder outside it (a tree whose folders link to an installed vLLM).
    Compiled modules (`__pycache__/`) come along, so a child process importing vLLM from the copy
    does not compile it again: Python checks each one against its source's mtime and size (an
    edited file is new, so its bytecode is rebuilt) and replaces a stale one, never writing
    through the link. Stray `.pyc` files beside the sources are left out."""
    shutil.copytree(tree.root / "vllm", dest / "vllm", copy_function=_link_or_copy, ignore=_stray_bytecode)
    return SourceTree(dest)


def _stray_bytecode(folder: str, names: list[str]) -> set[str]:
    """`.pyc` files outside `__pycache__/` (imported without a source: never copied)."""
    if os.path.basename(folder) == "__pycache__":
        return set()
    return {n for n in names if n.endswith((".pyc", ".pyo"))}


def _link_or_copy(src: str, dst: str) -> None:
    """A hard link to `src`'s file (a link is followed), or a copy across file systems."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def write_edits(root: Path, edits: Iterable[NativeEdit]) -> None:
    """Each edit's new text replaces its file (a new file moved into place, so links stay intact).

    Every file is checked before any is written: it still holds the edit's `before` text, and
    its folder lies inside the tree's `vllm/` (not behind a link to another tree). The file's
    compiled modules in `__pycache__/` are removed."""
    edits = list(edits)
    package = (root / "vllm").resolve()
    for edit in edits:
        path = root / edit.path
        if not path.parent.resolve().is_relative_to(package):
            raise CannotCarry(f"{edit.path} lies behind a link out of the tree ({path.parent.resolve()})")
        if path.read_text(encoding="utf-8") != edit.before:
            raise CannotCarry(f"{edit.path} changed since the edit was made")
    for edit in edits:
        path = root / edit.path
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
        # Its compiled form is stale now: removed (only this tree's link to it), so that no
        # bytecode compiled without a source check can stand in for the new text.
        for compiled in (path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"):
            compiled.unlink(missing_ok=True)


def compile_edits(root: Path, edits: Iterable[NativeEdit]) -> None:
    for edit in edits:
        path = root / edit.path
        try:  # compiled in memory: py_compile refuses cfile=os.devnull (not a regular file)
            compile(path.read_text(encoding="utf-8"), str(path), "exec", dont_inherit=True)
        except SyntaxError as exc:
            raise CannotCarry(f"the changed {edit.path} does not compile: {exc}") from exc


def ask_tree(tree: SourceTree, fix: Fix, timeout: float = 900) -> dict[str, str]:
    """The fix's dry-run answer for `tree` ({fix, answer, reason}), from a child process that
    imports vLLM from the tree, with every runtime fix switched off."""
    return ask_tree_all(tree, [fix], timeout)[fix.id]


def ask_tree_all(tree: SourceTree, fixes: Sequence[Fix], timeout: float = 900) -> dict[str, dict[str, str]]:
    """Each fix's dry-run answer for `tree` (by fix id), from one child process that imports vLLM
    from the tree once, with every runtime fix switched off (as `vllm-fixes status` asks them)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree.root), env.get("PYTHONPATH", "")) if p)
    env["VLLM_FIXES_DISABLE"] = "all"
    cmd = [sys.executable, "-m", "vllm_fix_core.backport", "--child"]
    for fix in fixes:
        cmd += [fix.id, f"{fix.entry_point}.declaration"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or len(records) != len(fixes):
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise CannotCarry(
            f"the check of the tree did not complete (exit {proc.returncode}): {' | '.join(tail)}"
        )
    answers: dict[str, dict[str, str]] = {}
    for record in records:
        imported = Path(record.pop("vllm", "") or "/")
        if not imported.is_relative_to(tree.root.resolve()):
            raise CannotCarry(f"the check imported vLLM from {imported}, not from the tree {tree.root}")
        answers[record["fix"]] = record
    return answers


def carry(fix: Fix, tree: SourceTree, workdir: Path, before: dict[str, str] | None = None) -> Result:
    """Decide, transform, verify: the Result for one fix (never raises for the tree's sake).
    `before`: the tree's answer for the fix, when it was asked already (`ask_tree_all`)."""
    try:
        return _carry(fix, tree, workdir, before)
    except CannotCarry as exc:
        return Result(fix.id, Carried.REFUSED, str(exc))


# The tree's own answer, when it needs nothing: the backport answer and what it says.
_NOT_NEEDED = {
    "fixed upstream": (Carried.CARRIES_IT, "the tree behaves correctly already; nothing written"),
    "not applicable": (Carried.NOT_APPLICABLE, "the code the bug lives in is not in this tree"),
}


def _carry(fix: Fix, tree: SourceTree, workdir: Path, before: dict[str, str] | None) -> Result:
    if before is None:
        before = ask_tree(tree, fix)
    if before["answer"] in _NOT_NEEDED:
        answer, said = _NOT_NEEDED[before["answer"]]
        return Result(fix.id, answer, f"{said} ({before['reason']})")
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
        fix.id,
        Carried.WRITTEN,
        "written; on the changed tree the fix's probe no longer sees the bug",
        tuple(edits),
        fix.native_requires,
    )


@dataclass(frozen=True)
class Backport:
    """The results for several fixes carried one after another on one tree.

    Each WRITTEN result's edits were made (and verified) on the tree with the edits of the fixes
    before it; `edits` are all of them against the original tree, one per file."""

    tree: SourceTree
    results: tuple[Result, ...]
    edits: tuple[NativeEdit, ...]

    @property
    def failed(self) -> list[str]:
        """The fixes the tree needs (or may need) that could not be carried."""
        return [r.fix_id for r in self.results if r.result is Carried.REFUSED]

    def patch(self) -> str:
        """The unified diff, one section per fix: a comment line naming the fix and what was
        decided, then the fix's file diffs (made on the tree with the sections before it)."""
        out: list[str] = []
        for r in self.results:
            reason = " ".join(r.reason.split())
            out.append(f"# vllm-fixes backport {r.fix_id}: {r.result.value} ({reason})\n")
            out += [f"# vllm-fixes backport {r.fix_id}: requires {need}\n" for need in r.requires]
            out += [e.diff() for e in r.edits]
        return "".join(out)

    def summary(self) -> str:
        counts = {c: sum(r.result is c for r in self.results) for c in Carried}
        parts = ", ".join(f"{n} {c.value}" for c, n in counts.items())
        return f"backport of {self.tree.root}: {len(self.results)} fixes — {parts}"


def backport(
    fixes: Iterable[Fix],
    tree: SourceTree,
    workdir: Path,
    on_result: Callable[[Result], None] | None = None,
) -> Backport:
    """Carry each fix in turn (`carry`) on a scratch copy of `tree` that accumulates the
    verified edits; `tree` itself is never written (see `write_edits` for that). Whether a fix
    is needed is asked of the tree as given, for every fix in one child process; each change is
    made and verified on the tree with the changes before it. `on_result` hears of each fix as
    soon as it is decided (progress)."""
    fixes = list(fixes)
    work = scratch_copy(tree, workdir / "tree")
    try:  # whether each fix is needed: asked of the tree as given, in one child for all
        needs: dict[str, dict[str, str]] = ask_tree_all(work, fixes) if fixes else {}
    except CannotCarry:
        needs = {}  # each carry asks on its own, and says why it could not
    results: list[Result] = []
    for fix in fixes:
        result = carry(fix, work, workdir / "fixes", needs.get(fix.id))
        if result.edits:
            write_edits(work.root, result.edits)
        results.append(result)
        if on_result is not None:
            on_result(result)
    edits = merge(e for r in results for e in r.edits)
    return Backport(tree, tuple(results), tuple(edits))


def _child(pairs: Sequence[str]) -> int:
    """In the child: for each (fix id, declaration module) pair, import the declaration, run the
    ladder without applying, print the record (one JSON line per fix, in order)."""
    import importlib

    from vllm_fix_core.ladder import evaluate
    from vllm_fix_core.settings import Settings

    for fix_id, declaration in zip(pairs[::2], pairs[1::2], strict=True):
        fix = importlib.import_module(declaration).FIX
        if fix.id != fix_id:
            raise SystemExit(f"{declaration} declares {fix.id}, not {fix_id}")
        settings = Settings(disabled=frozenset(), strict=False)
        decision = evaluate(fix, settings, apply=False, honour_disable=False)
        vllm = sys.modules.get("vllm")
        where = str(Path(vllm.__file__).resolve()) if vllm is not None and vllm.__file__ else ""
        sys.stdout.write(json.dumps({**decision.record(), "vllm": where}, ensure_ascii=False) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":  # pragma: no cover - the child process
    if len(sys.argv) >= 4 and len(sys.argv) % 2 == 0 and sys.argv[1] == "--child":
        raise SystemExit(_child(sys.argv[2:]))
    raise SystemExit("usage: python -m vllm_fix_core.backport --child FIX_ID DECLARATION_MODULE ...")
