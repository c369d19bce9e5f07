"""The native carry on the installed release's own sources: written, verified, git-apply-able,
registering by the rule with the runtime fix off, refused for a drifted body, idempotent."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytest.importorskip("libcst")

from vllm_fix_core import ast_fingerprint, original_of
from vllm_fix_core.backport import Carried, ask_tree
from vllm_fix_core.fingerprint import node_fingerprint
from vllm_fix_mr_extent import FIX, native, patch
from vllm_fix_mr_extent.declaration import MODULE
from vllm_fix_testing import native_trees as nt

# The probe's failing inputs, the KDA inputs of test_mr_extent_vllm.py and two layers on two
# storages, run through the tree's own _build_shared_kv_mr in a child process that imports vLLM
# from the tree, with every runtime fix off.
SCENARIO = """
import json
import vllm
from vllm_fix_mr_extent import probe
from vllm_fix_testing import kv_storage as kv

def kda(name, start_mod, nbytes, offsets):
    storage = kv.backing(start_mod, nbytes)
    caches = {f"kda{i}": kv.kda_cache(storage, o) for i, o in enumerate(offsets)}
    return probe.Scenario(name, "", storage, caches, {n: kv.kda_spec() for n in caches})

scenarios = [make() for make in (*probe.FAILING, probe.CONTROL)]
scenarios.append(kda("kda-tail-unaligned", 128, 8192, [8192 - 2 * kv.KDA_PAGE]))
scenarios.append(kda("kda-unpadded-tail", 0, 8256, [0, 8256 - 2 * kv.KDA_PAGE]))
found = {s.name: probe.problems(s) for s in scenarios}
one, two = probe.backing(0, probe.LAYER_BYTES), probe.backing(0, probe.LAYER_BYTES)
caches = {"attn0": probe.block_first_cache(one, 0), "attn1": probe.block_first_cache(two, 0)}
spread = probe.Scenario("two-storages", "", one, caches, {n: probe.attention_spec() for n in caches})
try:
    spread.worker()._build_shared_kv_mr(caches)
    refusal = ""
except Exception as exc:
    refusal = f"{type(exc).__name__}: {exc}"
print(json.dumps({"problems": found, "two-storages": refusal}))
"""
FAILING = {"page-boundary-unaligned", "unpadded-tail", "split-kv-later-region"}
KDA = {"kda-tail-unaligned", "kda-unpadded-tail"}


@pytest.fixture(scope="module")
def carried(tmp_path_factory: pytest.TempPathFactory) -> nt.Carry:
    """(the release's tree, the carry's result, a copy of the tree with the edits written)."""
    return nt.carried_trees(FIX, tmp_path_factory.mktemp)


def without_builder(source: str) -> tuple[list[str], str]:
    """The module's lines without the builder, and the builder's signature."""
    method = native.c.ast_of(source, native.QUALNAME)
    assert isinstance(method, ast.FunctionDef) and method.end_lineno is not None
    lines = source.splitlines()
    signature = ast.dump(method.args) + ast.dump(method.returns or ast.Constant(None))
    return lines[: method.lineno - 1] + lines[method.end_lineno :], signature


def test_the_tree_is_recognised_as_the_runtime_recognises_it(
    carried: nt.Carry,
) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_connector as mc

    tree, _, _ = carried
    installed = ast_fingerprint(original_of(mc.MoRIIOConnectorWorker, "_build_shared_kv_mr"))
    assert node_fingerprint(native.c.ast_of(tree.read(MODULE), native.QUALNAME)) == installed
    assert native.recognize(tree) == patch.recognize()


def test_the_plain_tree_has_the_bug(carried: nt.Carry) -> None:
    tree, _, _ = carried
    assert ask_tree(tree, FIX)["answer"] == "would fix"


def test_the_diff_applies_to_a_clean_copy(carried: nt.Carry, tmp_path: Path) -> None:
    _, result, _ = carried
    nt.assert_git_applies(result.edits, tmp_path)


def test_carry_is_written_and_changes_only_the_builder(
    carried: nt.Carry,
) -> None:
    tree, result, changed = carried
    assert result.result is Carried.WRITTEN, result.reason
    assert [e.path for e in result.edits] == [tree.relpath(MODULE)]
    (edit,) = result.edits
    assert edit.after.count(native.MARK) == 1
    assert "vllm_fix" not in edit.after
    # Everything but the builder's body is vLLM's, byte for byte.
    assert without_builder(edit.after) == without_builder(edit.before)
    assert native.c.module_names(edit.after) == native.c.module_names(edit.before)
    assert ask_tree(changed, FIX)["answer"] == "fixed upstream"


@pytest.mark.native_control
def test_negative_controls_pass_on_the_changed_tree_and_fail_on_the_plain_one(
    carried: nt.Carry,
) -> None:
    tree, _, changed = carried
    plain, fixed = nt.run_in_tree(tree, SCENARIO), nt.run_in_tree(changed, SCENARIO)
    # Unchanged tree: every failing input (and each KDA one) breaks the contract; the control holds.
    assert all(plain["problems"][name] for name in FAILING | KDA), plain["problems"]
    assert "shared KV backing too small" in plain["problems"]["unpadded-tail"][0]
    assert "invalid storage offset" in plain["problems"]["page-boundary-unaligned"][0]
    assert plain["problems"]["aligned-control"] == []
    # Releases whose MoRIIO has no KDA layers yet (0.29-0.31) refuse their shape in vLLM's own
    # check, before the builder: the same refusal with the change; where KDA is supported, the
    # plain tree's KDA inputs fail by the extent (the bug).
    shape = "Unsupported MoRIIO K/V cache shape"
    no_kda = {n for n in KDA if all(shape in p for p in plain["problems"][n])}
    assert no_kda in (set(), KDA), plain["problems"]
    assert all(fixed["problems"][n] == plain["problems"][n] for n in no_kda), fixed["problems"]
    assert all("shared KV backing too small" in plain["problems"][n][0] for n in KDA - no_kda)
    # Changed tree, runtime fix off: every other input registers by the contract.
    assert {k: v for k, v in fixed["problems"].items() if k not in no_kda} == {
        name: [] for name in plain["problems"] if name not in no_kda
    }
    # Layers on two storages cannot share a memory region: the refusal names both.
    assert fixed["two-storages"].startswith("ValueError: layer 'attn1' region 0"), fixed
    assert "'attn0'" in fixed["two-storages"]


def test_a_drifted_body_cannot_be_carried(carried: nt.Carry, tmp_path: Path) -> None:
    """The runtime fix replaces only the exactly fingerprinted body; so does the native carry
    (here a builder that rounds its registration to 8 KiB: the probe still sees the bug)."""
    tree, _, _ = carried
    old, new = "        page_size = 4096\n", "        page_size = 8192\n"
    drifted = nt.replaced(tree, tmp_path / "drifted", MODULE, old, new)
    nt.assert_cannot_carry(
        FIX, drifted, MODULE, tmp_path / "work", "normalized-AST fingerprint", "not one of the known shapes"
    )
    assert "page_size = 8192" in drifted.read(MODULE)


def test_a_tree_without_the_region_iterator_cannot_be_carried(carried: nt.Carry, tmp_path: Path) -> None:
    tree, _, _ = carried
    text = tree.read(MODULE)
    old = "    iter_layer_registration_regions,\n"
    assert text.count(old) == 1
    drifted = nt.replaced(tree, tmp_path / "no-iter", MODULE, old, "")
    with pytest.raises(native.CannotCarry, match="no longer imports iter_layer_registration_regions"):
        native.transform(drifted)


def test_a_carried_tree_needs_nothing_more(carried: nt.Carry, tmp_path: Path) -> None:
    _, _, changed = carried
    nt.assert_needs_nothing_more(FIX, changed, tmp_path)
