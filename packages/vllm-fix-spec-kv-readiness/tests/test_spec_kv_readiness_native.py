"""`vllm-fixes backport` on the installed release's own sources: the tree needs the fix, and the
carry is refused with the reason the maintainer reads (no change is offered that the CPU probe
cannot verify), writing nothing."""

from __future__ import annotations

from pathlib import Path

from vllm_fix_core.backport import Carried, carry
from vllm_fix_spec_kv_readiness import FIX
from vllm_fix_spec_kv_readiness.declaration import NO_NATIVE
from vllm_fix_testing.native_trees import installed_tree


def test_backport_refuses_with_its_reason_and_writes_nothing(tmp_path: Path) -> None:
    tree = installed_tree(tmp_path / "tree")
    before = {p: p.read_bytes() for p in (tree.root / "vllm" / "v1" / "worker" / "gpu").glob("*.py")}
    result = carry(FIX, tree, tmp_path / "work")
    assert result.result is Carried.CANNOT, result
    assert result.reason == NO_NATIVE and result.edits == ()
    assert {p: p.read_bytes() for p in before} == before
