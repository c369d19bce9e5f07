"""docs/backporting.md, executed as written: a fork maintainer asks `vllm-fixes status --source`
which fixes a vLLM tree needs, carries one natively (the read-eligibility README's "Native carry"
recipe, applied to the tree's source), and asks again; then has `vllm-fixes backport --write`
carry every needed fix that has a native transformation, and asks again: the tree is clean of
those fixes, and still needs exactly the others.

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

from vllm_fix_core.registry import installed_fixes
from vllm_fix_testing.native_trees import installed_tree

MODULE = "vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py"
CARRIED = "read-eligibility"
# The read-eligibility README's native carry, as a fork maintainer writes it into
# MoRIIOConnectorScheduler.get_num_new_matched_tokens (written from the README's rule table, not
# from the fix's code): a READ consumer claims remote tokens only for a remote prefill whose
# parameters can be honoured (the flag exactly True, an engine id, one list of enough distinct
# int64 block ids per KV cache group, well-typed routing fields and an address MoRIIO's own
# add_new_req resolves); otherwise it computes the prompt locally and says why. This tree's engine
# has full-attention groups only (a hybrid engine's state groups need one block each).
NATIVE_CARRY = """
params = request.kv_transfer_params
if not self.is_producer and self.mode == MoRIIOMode.READ:
    if not isinstance(params, dict) or not params.get("do_remote_prefill"):
        return 0, False

    def _unreadable_field():
        def in_range(value, low, high):
            return type(value) is int and low <= value <= high

        def is_port(value):
            if isinstance(value, str) and value.isdecimal():
                value = int(value)
            return in_range(value, 1, 65535)

        if params.get("do_remote_prefill") is not True:
            return "do_remote_prefill"
        engine = params.get("remote_engine_id")
        if not isinstance(engine, str) or not engine:
            return "remote_engine_id"
        blocks = params.get("remote_block_ids")
        if not isinstance(blocks, list) or not blocks:
            return "remote_block_ids"
        per_group = all(isinstance(group, list) for group in blocks)
        groups = blocks if per_group else [blocks]
        config = getattr(self, "kv_cache_config", None)
        if per_group and config is not None and len(groups) != len(config.kv_cache_groups):
            return "remote_block_ids (one list per KV cache group)"
        prompt = len(request.prompt_token_ids)
        needed = math.ceil((prompt - 1) / self.block_size) if prompt - 1 - num_computed_tokens > 0 else 1
        for group in groups:
            if not all(in_range(b, 0, 2**63 - 1) for b in group):
                return "remote_block_ids (ids)"
            real = [b for b in group if b != 0]
            if len(set(real)) != len(real):
                return "remote_block_ids (duplicate ids)"
            if len(group) < needed:
                return "remote_block_ids (too few blocks)"
        host = params.get("remote_host", "-")
        if not isinstance(host, str) or not host:
            return "remote_host"
        for key in ("remote_handshake_port", "remote_notify_port"):
            if key in params and not is_port(params[key]):
                return key
        try:
            MoRIIOConnectorMetadata().add_new_req(
                request_id=request.request_id, local_block_ids=[], kv_transfer_params=dict(params)
            )
        except Exception:
            return "the READ's address"
        return None

    field = _unreadable_field()
    if field is not None:
        logger.warning(
            "Request %s: kv_transfer_params cannot be honoured (%s); computing it locally",
            request.request_id,
            field,
        )
        params["do_remote_prefill"] = False
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


def status(tree: Path, command: str = "status", *fix: str) -> dict[str, Any]:
    only = [arg for fix_id in fix for arg in ("--fix", fix_id)]
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_fix_core.cli", command, "--json", "--source", str(tree), *only],
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
    before = {f["fix"]: f for f in plain["fixes"]}
    after = {f["fix"]: f for f in carried["fixes"]}
    assert before[CARRIED]["this_tree"].startswith("needs it"), before[CARRIED]
    assert after[CARRIED]["this_tree"] == "carries it already", after[CARRIED]
    # Every other fix answers exactly as before: the tree still needs those it needed.
    others = set(before) - {CARRIED}
    assert others and {k: after[k]["this_tree"] for k in others} == {
        k: before[k]["this_tree"] for k in others
    }
    assert any(before[k]["this_tree"].startswith("needs it") for k in others)


def test_verify_applies_the_runtime_fix_to_the_tree_until_it_carries_it(tmp_path: Path) -> None:
    plain = status(fork_tree(tmp_path, carry=False), "verify", CARRIED)
    carried = status(fork_tree(tmp_path, carry=True), "verify", CARRIED)
    assert [f["this_tree"] for f in plain["fixes"]] == [
        "needs it (the tree has the bug; the runtime fix applies and verifies)"
    ], plain
    assert [f["this_tree"] for f in carried["fixes"]] == ["carries it already"], carried


# ---------------------------------------------------------------- vllm-fixes backport --write
def backport(tree: Path, *fix: str) -> tuple[int, dict[str, Any]]:
    only = [arg for fix_id in fix for arg in ("--fix", fix_id)]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm_fix_core.cli",
            "backport",
            "--json",
            "--write",
            "--source",
            str(tree),
            *only,
        ],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    data: dict[str, Any] = json.loads(proc.stdout)
    return proc.returncode, data


@pytest.fixture(scope="module")
def backported(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[dict[str, Any], list[str], int, dict[str, Any], dict[str, Any]]:
    """(status before, the fixes carried, backport's exit status and JSON, status after) for a
    fork tree: the release's own sources as real folders (a fork's checkout; files hard-linked)."""
    tree = installed_tree(tmp_path_factory.mktemp("backport")).root
    before = status(tree)
    natives = {i.fix.id for i in installed_fixes() if i.fix.native is not None}
    needed = [f["fix"] for f in before["fixes"] if f["this_tree"].startswith("needs it")]
    carried = sorted(set(needed) & natives)
    code, report = backport(tree, *carried)
    return before, carried, code, report, status(tree)


def test_backport_writes_every_needed_fix_that_has_a_native(
    backported: tuple[dict[str, Any], list[str], int, dict[str, Any], dict[str, Any]],
) -> None:
    """Every needed fix with a native is written and verified, or refused with its reason (a
    release whose code the transformation cannot carry, e.g. sync-load-context before 0.18);
    the exit status says whether any was refused, and the written ones are in the tree."""
    _, carried, code, report, _ = backported
    assert CARRIED in carried, carried
    results = {r["fix"]: r for r in report["fixes"]}
    assert set(results) == set(carried)
    written = {k for k, r in results.items() if r["result"] == "written and verified"}
    refused = {k: r for k, r in results.items() if k not in written}
    assert CARRIED in written, results
    assert all(r["result"] == "refused" and r["reason"] for r in refused.values()), refused
    assert code == (1 if refused else 0), report
    assert report["written"] is True, report
    assert all(results[k]["files"] for k in written) and not any(r["files"] for r in refused.values())


def test_after_backport_the_tree_is_clean_for_those_fixes(
    backported: tuple[dict[str, Any], list[str], int, dict[str, Any], dict[str, Any]],
) -> None:
    before, carried, _, report, after = backported
    written = [r["fix"] for r in report["fixes"] if r["result"] == "written and verified"]
    was = {f["fix"]: f["this_tree"] for f in before["fixes"]}
    now = {f["fix"]: f["this_tree"] for f in after["fixes"]}
    assert after["vllm"]["path"] == before["vllm"]["path"]  # the tree, not the installed vLLM
    assert all(was[k].startswith("needs it") for k in carried), was  # the negative control
    assert {k: now[k] for k in written} == {k: "carries it already" for k in written}, now
    # Every fix not written answers as before: the native changes touch only their own fixes,
    # and a refused one was not half-applied.
    assert {k: now[k] for k in set(was) - set(written)} == {k: was[k] for k in set(was) - set(written)}
