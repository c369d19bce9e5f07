"""Fork-shaped source trees for the native-carry tests: a release's `vllm/` package as a tree.

`installed_tree(dest)` copies (hard links, where the file system allows) the `vllm/` package of
the vLLM installed in this environment into `dest`, so that a test can run `vllm-fixes backport`
on exactly the release its session targets. The copy is a tree a fork could have; edits replace
files (vllm_fix_core.backport.write_edits), so the installed vLLM is never changed through a link.

`assert_git_applies(edits, workdir)` checks a carry's diff the way a fork maintainer applies it:
`git apply --check` then `git apply` on a clean copy of the files it changes (and `patch -p1
--dry-run` where `patch` is installed). `run_in_tree(tree, code)` runs a scenario in a child
process that imports vLLM from the tree with every runtime fix off, and returns the JSON object
its last output line prints.

`carried_trees(fix, mktemp)` builds what each fix's native tests share (a module fixture):
the tree, the carry's result and a copy of the tree with the edits written.
`rewritten(tree, dest, module, change)` and `replaced(tree, dest, module, old, new)` make a
drifted tree: a scratch copy whose module file is replaced (unlinked, then written: the copy is
hard-linked to the installed vLLM). `assert_probe_tells` checks the probe's answers on the plain
and the changed tree, `assert_cannot_carry` a refused carry that writes nothing, and
`assert_needs_nothing_more` that a carried tree is not carried again.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from vllm_fix_core.backport import Carried, Result, ask_tree, carry, scratch_copy, write_edits
from vllm_fix_core.declaration import Fix
from vllm_fix_core.native import NativeEdit, SourceTree

# (the tree carried, the carry's result, a copy of the tree with the edits written)
Carry = tuple[SourceTree, Result, SourceTree]


def installed_vllm_root() -> Path:
    """The folder holding the installed `vllm/` package, found without importing vLLM."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("no vLLM is installed in this environment")
    return Path(next(iter(spec.submodule_search_locations))).parent


def installed_tree(dest: Path) -> SourceTree:
    """A tree under `dest` holding a copy of the installed release's `vllm/` package."""
    return scratch_copy(SourceTree(installed_vllm_root()), dest)


def assert_git_applies(edits: Iterable[NativeEdit], workdir: Path) -> None:
    """The edits' diff applies to a clean copy of the files they change (`git apply --check`,
    then `git apply`, each file then holding the edit's new text; `patch -p1 --dry-run` too
    where `patch` is installed). AssertionError (with the tool's output) when it does not."""
    edits = list(edits)
    assert edits, "no edits to apply"
    git = shutil.which("git")
    assert git is not None, "git is not installed"
    clean = workdir / "clean"
    for edit in edits:
        (clean / edit.path).parent.mkdir(parents=True, exist_ok=True)
        (clean / edit.path).write_text(edit.before, encoding="utf-8")
    patch_file = workdir / "carry.patch"
    patch_file.write_text("".join(e.diff() for e in edits), encoding="utf-8")
    subprocess.run([git, "init", "-q", str(clean)], check=True)
    steps = [[git, "-C", str(clean), "apply", "--check", str(patch_file)]]
    patch = shutil.which("patch")
    if patch is not None:
        steps.append([patch, "-p1", "--dry-run", "-s", "-d", str(clean), "-i", str(patch_file)])
    steps.append([git, "-C", str(clean), "apply", str(patch_file)])
    for step in steps:
        proc = subprocess.run(step, capture_output=True, text=True, check=False)
        assert proc.returncode == 0, f"{' '.join(step[:4])}: {proc.stdout}{proc.stderr}"
    for edit in edits:
        assert (clean / edit.path).read_text(encoding="utf-8") == edit.after, edit.path


def run_in_tree(tree: SourceTree, code: str, timeout: float = 600) -> dict[str, Any]:
    """Run `code` in a child process that imports vLLM from `tree` (first on the path) with
    every runtime fix off (VLLM_FIXES_DISABLE=all); the JSON object its last line prints.
    The child must import vllm: the answer is refused unless vLLM came from the tree."""
    env = {**os.environ, "VLLM_FIXES_DISABLE": "all"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree.root), env.get("PYTHONPATH", "")) if p)
    wrapped = f"{code}\nimport sys as _s\nprint(_s.modules['vllm'].__file__)\n"
    proc = subprocess.run(
        [sys.executable, "-c", wrapped],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) >= 2, proc.stdout + proc.stderr[-3000:]
    assert Path(lines[-1]).resolve().is_relative_to(tree.root.resolve()), lines[-1]
    found: dict[str, Any] = json.loads(lines[-2])
    return found


def carried_trees(fix: Fix, mktemp: Callable[[str], Path], tree: SourceTree | None = None) -> Carry:
    """(the tree, the fix's carry on it, a copy of the tree with the carry's edits written);
    the tree is the installed release's unless given. `mktemp(name)` gives a fresh folder
    (pytest's `tmp_path_factory.mktemp`)."""
    if tree is None:
        tree = installed_tree(mktemp("tree"))
    result = carry(fix, tree, mktemp("work"))
    changed = scratch_copy(tree, mktemp("changed"))
    write_edits(changed.root, result.edits)
    return tree, result, changed


def rewritten(tree: SourceTree, dest: Path, module: str, change: Callable[[str], str]) -> SourceTree:
    """A scratch copy of `tree` under `dest` whose `module` holds `change(its text)`, which
    must differ from the text. The copy is hard-linked: the file is replaced, never written
    through."""
    copy = scratch_copy(tree, dest)
    path = copy.path_of(module)
    text = path.read_text(encoding="utf-8")
    new = change(text)
    assert new != text, f"{module}: the change changes nothing"
    path.unlink()
    path.write_text(new, encoding="utf-8")
    return copy


def replaced(tree: SourceTree, dest: Path, module: str, old: str, new: str) -> SourceTree:
    """A scratch copy of `tree` under `dest` whose `module` has `old` (found exactly once)
    replaced by `new`."""

    def change(text: str) -> str:
        assert text.count(old) == 1, f"{module}: {old!r} occurs {text.count(old)} times"
        return text.replace(old, new)

    return rewritten(tree, dest, module, change)


def assert_probe_tells(fix: Fix, plain: SourceTree, changed: SourceTree, *checks: str) -> None:
    """The fix's probe, asked in a child with the runtime fixes off, answers "would fix" for
    the plain tree (naming each of `checks` in its reason: the negative control) and "fixed
    upstream" for the changed one."""
    before = ask_tree(plain, fix)
    assert before["answer"] == "would fix", before
    for check in checks:
        assert check in before["reason"], (check, before)
    after = ask_tree(changed, fix)
    assert after["answer"] == "fixed upstream", after


def assert_cannot_carry(fix: Fix, drifted: SourceTree, module: str, workdir: Path, *reasons: str) -> None:
    """Carrying `fix` on `drifted` is refused (CANNOT, with a reason holding each of
    `reasons`), no edit is offered, and `module` of the tree is left as it was."""
    text = drifted.read(module)
    result = carry(fix, drifted, workdir)
    assert result.result is Carried.REFUSED, result.reason
    assert result.reason and all(r in result.reason for r in reasons), result.reason
    assert result.edits == () and drifted.read(module) == text


def assert_needs_nothing_more(fix: Fix, changed: SourceTree, workdir: Path) -> None:
    """Carrying `fix` on a tree that carries it already answers "carries it already"."""
    again = carry(fix, changed, workdir)
    assert again.result is Carried.CARRIES_IT, again.reason
    assert "behaves correctly already; nothing written" in again.reason


__all__ = [
    "Carry",
    "assert_cannot_carry",
    "assert_git_applies",
    "assert_needs_nothing_more",
    "assert_probe_tells",
    "carried_trees",
    "installed_tree",
    "installed_vllm_root",
    "replaced",
    "rewritten",
    "run_in_tree",
]
