"""Fork-shaped source trees for the native-carry tests: a release's `vllm/` package as a tree.

`installed_tree(dest)` copies (hard links, where the file system allows) the `vllm/` package of
the vLLM installed in this environment into `dest`, so that a test can run `vllm-fixes backport`
on exactly the release its session targets. The copy is a tree a fork could have; edits replace
files (vllm_fix_core.backport.write_edits), so the installed vLLM is never changed through a link.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from vllm_fix_core.backport import scratch_copy
from vllm_fix_core.native import SourceTree


def installed_vllm_root() -> Path:
    """The folder holding the installed `vllm/` package, found without importing vLLM."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("no vLLM is installed in this environment")
    return Path(next(iter(spec.submodule_search_locations))).parent


def installed_tree(dest: Path) -> SourceTree:
    """A tree under `dest` holding a copy of the installed release's `vllm/` package."""
    return scratch_copy(SourceTree(installed_vllm_root()), dest)


__all__ = ["installed_tree", "installed_vllm_root"]
