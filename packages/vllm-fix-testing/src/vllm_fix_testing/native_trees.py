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
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from vllm_fix_core.backport import scratch_copy
from vllm_fix_core.native import NativeEdit, SourceTree


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


__all__ = ["assert_git_applies", "installed_tree", "installed_vllm_root", "run_in_tree"]
