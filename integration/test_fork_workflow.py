"""docs/backporting.md, executed as written: a fork maintainer asks `vllm-fixes status --source`
which fixes a vLLM tree needs, carries one natively (the read-eligibility README's "Native carry"
recipe, applied to the tree's source), and asks again.

The "fork" is the installed release's own Python sources in a temporary folder (every file
linked, the one changed file copied and edited), first on the path of the child process the
command starts, so the probes run against the tree and not against the installed vLLM."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

MODULE = "vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py"
CARRIED = "read-eligibility"
# The read-eligibility README's native carry, as a fork maintainer writes it into
# MoRIIOConnectorScheduler.get_num_new_matched_tokens: a READ consumer claims remote tokens only
# for a well-formed remote prefill (do_remote_prefill set, remote_block_ids a non-empty list of
# non-empty per-group block lists, remote_engine_id a non-empty string).
NATIVE_CARRY = """
params = request.kv_transfer_params
if not self.is_producer and self.mode == MoRIIOMode.READ:
    blocks = params.get("remote_block_ids") if isinstance(params, dict) else None
    engine = params.get("remote_engine_id") if isinstance(params, dict) else None
    if not (
        isinstance(params, dict)
        and params.get("do_remote_prefill")
        and isinstance(blocks, (list, tuple))
        and blocks
        and all(isinstance(group, (list, tuple)) and group for group in blocks)
        and all(isinstance(b, int) and not isinstance(b, bool) for group in blocks for b in group)
        and isinstance(engine, str)
        and engine
    ):
        return 0, False
"""


def fork_tree(root: Path, carry: bool) -> Path:
    """A source tree of the installed vLLM under root/; optionally carrying the fix natively."""
    import vllm

    site = Path(vllm.__file__).resolve().parent.parent
    tree = root / ("carried" if carry else "plain")
    chain = list(reversed(Path(MODULE).parents))[1:]  # vllm, vllm/distributed, ..., .../moriio
    real = {*chain, Path(MODULE)}  # folders down to the edited file are real; all else is linked
    for folder in chain:
        (tree / folder).mkdir(parents=True, exist_ok=True)
        for entry in (site / folder).iterdir():
            if folder / entry.name not in real and entry.name != "__pycache__":
                (tree / folder / entry.name).symlink_to(entry)
    text = (site / MODULE).read_text()
    (tree / MODULE).write_text(apply_native_carry(text) if carry else text)
    return tree


def apply_native_carry(text: str) -> str:
    tree = ast.parse(text)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "MoRIIOConnectorScheduler")
    fn = next(
        n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "get_num_new_matched_tokens"
    )
    first = fn.body[0]
    is_doc = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
    anchor = fn.body[1] if is_doc else first
    lines = text.splitlines(keepends=True)
    indent = " " * anchor.col_offset
    block = textwrap.indent(NATIVE_CARRY.strip("\n") + "\n", indent)
    lines.insert(anchor.lineno - 1, block)
    return "".join(lines)


def status(tree: Path) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_fix_core.cli", "status", "--json", "--source", str(tree)],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        env={**os.environ, "VLLM_FIXES_DISABLE": ""},
    )
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    data: dict[str, Any] = json.loads(proc.stdout)
    return data


@pytest.fixture(scope="module")
def answers(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any]]:
    root = tmp_path_factory.mktemp("fork")
    return status(fork_tree(root, carry=False)), status(fork_tree(root, carry=True))


def test_the_command_checks_the_tree_not_the_installed_vllm(
    answers: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    plain, carried = answers
    assert plain["vllm"]["path"].endswith("plain/vllm") and carried["vllm"]["path"].endswith("carried/vllm")


def test_the_tree_needs_the_fix_until_it_carries_it_natively(
    answers: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    plain, carried = answers
    before = {f["id"]: f for f in plain["fixes"]}
    after = {f["id"]: f for f in carried["fixes"]}
    assert before[CARRIED]["answer"].startswith("needs it"), before[CARRIED]
    assert after[CARRIED]["answer"] == "carries it already", after[CARRIED]
    # Every other fix answers exactly as before: the tree still needs those it needed.
    others = set(before) - {CARRIED}
    assert others and {k: after[k]["answer"] for k in others} == {k: before[k]["answer"] for k in others}
    assert any(before[k]["answer"].startswith("needs it") for k in others)
