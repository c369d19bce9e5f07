"""`vllm-fixes backport` and its machinery on synthetic trees with synthetic fixes (no vLLM).

A synthetic tree is a folder holding a small `vllm/` package (`vllm/demo_widget.py`, a class
whose methods return the wrong number); a synthetic fix is a package laid out like a real one,
`vllm_fix_<id>/declaration.py` on PYTHONPATH, because the child process that asks the tree
imports a fix's declaration by that convention (`<Fix.entry_point>.declaration`). Each fix's
probe calls one method of the tree's Widget; its native transformation (libcst, through
vllm_fix_core.cst) changes that method's body in the tree's source, well or badly as the test
needs.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("libcst")

from vllm_fix_core.backport import (
    Backport,
    Carried,
    ask_tree,
    ask_tree_all,
    backport,
    carry,
    scratch_copy,
    write_edits,
)
from vllm_fix_core.declaration import Fix
from vllm_fix_core.native import CannotCarry, NativeEdit, SourceTree

MODULE = "vllm.demo_widget"
WIDGET = '''"""A synthetic vLLM module: the core's backport tests carry fixes into it."""


class Widget:
    # Comments and formatting the carry must keep.
    def compute(self, x):
        return x + 1   # the bug: compute(1) should be 3

    def shift(self, x):
        return x - 1   # the bug: shift(1) should be 3
'''
# Each method's fixed rule: method(1) == 3; the native change adds `delta` to x first.
DELTA = {"compute": 1, "shift": 3}

DECLARATION = """
import importlib

from vllm_fix_core import Check, Fix, Links, ProbeReport, ProcessKind, Target, Upstream, UpstreamStatus
from vllm_fix_core.native import CannotCarry, NativeEdit, SourceTree, marker

MODULE = {module!r}
METHOD = {method!r}
DELTA = {delta!r}
KIND = {kind!r}


def probe():
    got = getattr(importlib.import_module(MODULE).Widget(), METHOD)(1)
    return ProbeReport((Check("wrong-result", got != 3, f"{{METHOD}}(1)={{got}}"),))


def recognize():
    return "demo-1"


def apply(patch, shape):
    def wrapper(wrapped, instance, args, kwargs):
        (x,) = args
        return wrapped(x + DELTA)

    patch.wrap(importlib.import_module(MODULE).Widget, METHOD, wrapper)


def _native(tree: SourceTree) -> list[NativeEdit]:
    from vllm_fix_core import cst

    if KIND == "cannot":
        raise CannotCarry("Widget.{{}} is not a shape this transformation knows".format(METHOD))
    if KIND == "raises":
        raise RuntimeError("the transformation has a bug")
    if KIND == "syntax":
        return [tree.edit(MODULE, lambda source: source + "\\ndef broken(:\\n")]
    line = f"x = x + {{DELTA}}" if KIND == "good" else "x = x"
    note = marker(FIX.id, 1, f"{{METHOD}}(x) computes from x + {{DELTA}}")

    def change(source: str) -> str:
        fixed = cst.with_comment(cst.statements(line)[0], note)
        return cst.change_function(source, f"Widget.{{METHOD}}", lambda f: cst.prepend(f, [fixed]))

    return [tree.edit(MODULE, change)]


FIX = Fix(
    id={fix_id!r},
    title="demo",
    distribution="vllm-fix-demo",
    upstream=(Upstream(1, UpstreamStatus.PENDING),),
    why="w",
    how="h",
    retire_when="r",
    targets=(Target(MODULE, "Widget." + METHOD, ProcessKind.WORKER),),
    links=lambda: Links(probe, recognize, apply),
    native=None if KIND == "none" else _native,
)
"""


@dataclass
class World:
    """A synthetic tree, and a folder of synthetic fix packages (on PYTHONPATH for the children)."""

    root: Path
    tree: SourceTree
    fixes: Path
    env: dict[str, str]

    def fix(self, method: str, kind: str = "good") -> Fix:
        fix_id = f"demo-{method}-{kind}-{uuid.uuid4().hex[:6]}"
        package = self.fixes / ("vllm_fix_" + fix_id.replace("-", "_"))
        package.mkdir()
        (package / "__init__.py").write_text("")
        source = DECLARATION.format(
            module=MODULE, method=method, delta=DELTA[method], kind=kind, fix_id=fix_id
        )
        (package / "declaration.py").write_text(source)
        fix = importlib.import_module(f"{package.name}.declaration").FIX
        assert isinstance(fix, Fix)
        return fix

    def widget(self, tree: SourceTree | None = None) -> str:
        return ((tree or self.tree).root / "vllm" / "demo_widget.py").read_text()

    def register(self, *fixes: Fix) -> None:
        """A dist-info in the fixes folder naming the fixes in the `vllm_fixes` group (the CLI's)."""
        info = self.fixes / "vllm_fix_demo-0.0.1.dist-info"
        info.mkdir(exist_ok=True)
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-fix-demo\nVersion: 0.0.1\n")
        lines = [f"{f.id} = {f.entry_point}.declaration:FIX" for f in fixes]
        (info / "entry_points.txt").write_text("[vllm_fixes]\n" + "\n".join(lines) + "\n")

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "vllm_fix_core.cli", "backport", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )


def make_tree(root: Path, widget: str = WIDGET) -> SourceTree:
    (root / "vllm").mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text('"""A synthetic vLLM package."""\n')
    (root / "vllm" / "demo_widget.py").write_text(widget)
    return SourceTree(root)


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    fixes = tmp_path / "fixes"
    fixes.mkdir()
    path = os.pathsep.join(p for p in (str(fixes), os.environ.get("PYTHONPATH", "")) if p)
    monkeypatch.setenv("PYTHONPATH", path)  # the children import the fixes' declarations
    monkeypatch.syspath_prepend(str(fixes))
    env = {**os.environ, "PYTHONPATH": path}
    env.pop("VLLM_PLUGINS", None)
    yield World(tmp_path, make_tree(tmp_path / "tree"), fixes, env)
    for name in [m for m in sys.modules if m.startswith("vllm_fix_demo_")]:
        del sys.modules[name]


def check_applies(patch: str, tree: SourceTree, dest: Path) -> Path:
    """`git apply --check` and `patch -p1 --dry-run` accept the patch on a clean copy of the
    tree; returns the copy with the patch applied by `git apply`."""
    clean = dest / "clean"
    shutil.copytree(tree.root, clean)
    (dest / "fix.patch").write_text(patch)
    for cmd in (
        ["git", "apply", "--check", str(dest / "fix.patch")],
        ["patch", "-p1", "--dry-run", "--input", str(dest / "fix.patch")],
        ["git", "apply", str(dest / "fix.patch")],
    ):
        proc = subprocess.run(cmd, cwd=clean, capture_output=True, text=True, check=False)
        assert proc.returncode == 0, (cmd, proc.stdout, proc.stderr, patch)
    return clean


# ---------------------------------------------------------------- carry: one fix
def test_a_needed_fix_is_written_and_verified_and_the_diff_applies(world: World, tmp_path: Path) -> None:
    fix = world.fix("compute")
    original = world.widget()
    result = carry(fix, world.tree, tmp_path / "work")
    assert result.result is Carried.WRITTEN, result
    assert result.reason == "written; on the changed tree the fix's probe no longer sees the bug"
    assert result.requires == () and result.record()["requires"] == []
    (edit,) = result.edits
    assert edit.path == "vllm/demo_widget.py" and edit.before == original
    # Only compute() changed: one marker line and one statement, comments and formatting kept.
    added = [line for line in edit.diff().splitlines() if line.startswith("+") and not line.startswith("+++")]
    assert added == [
        f"+        # vllm-fixes {fix.id} (vllm-project/vllm#1): compute(x) computes from x + 1",
        "+        x = x + 1",
    ]
    assert "return x + 1   # the bug: compute(1) should be 3" in edit.after
    assert "# Comments and formatting the carry must keep." in edit.after
    assert world.widget() == original  # carry never writes the tree itself
    clean = check_applies("".join(e.diff() for e in result.edits), world.tree, tmp_path / "apply")
    assert (clean / edit.path).read_text() == edit.after


def test_a_carried_tree_is_not_needed_a_second_time(world: World, tmp_path: Path) -> None:
    fix = world.fix("compute")
    first = carry(fix, world.tree, tmp_path / "first")
    write_edits(world.tree.root, first.edits)
    again = carry(fix, world.tree, tmp_path / "again")
    assert again.result is Carried.CARRIES_IT and again.edits == ()
    assert again.reason.startswith("the tree behaves correctly already; nothing written ("), again.reason
    assert "wrong-result=ok" in again.reason  # the probe's own check, in the ladder's words


def test_a_tree_that_behaves_right_needs_no_transformation(world: World, tmp_path: Path) -> None:
    right = make_tree(tmp_path / "right", WIDGET.replace("return x - 1", "return x + 2"))
    for kind in ("none", "cannot"):  # never asked for: the tree does not need it
        result = carry(world.fix("shift", kind), right, tmp_path / kind)
        assert (result.result, result.edits) == (Carried.CARRIES_IT, ()), result


def test_a_tree_without_the_code_is_not_applicable_not_carried_already(world: World, tmp_path: Path) -> None:
    asked = {"fix": "x", "answer": "not applicable", "reason": "vllm.demo_widget is not part of this vLLM"}
    result = carry(world.fix("compute"), world.tree, tmp_path / "work", asked)
    assert (result.result, result.edits) == (Carried.NOT_APPLICABLE, ()), result
    assert result.reason == (
        "the code the bug lives in is not in this tree (vllm.demo_widget is not part of this vLLM)"
    )
    assert result.record()["result"] == "not applicable"


def test_what_a_written_carry_requires_is_in_its_record_and_its_patch_header(
    world: World, tmp_path: Path
) -> None:
    import dataclasses

    need = "MORI v0.1.0 or later (its listener reports the port it bound)"
    fix = dataclasses.replace(world.fix("compute"), native_requires=(need,))
    done = backport([fix], world.tree, tmp_path / "work")
    (result,) = done.results
    assert result.result is Carried.WRITTEN and result.requires == (need,)
    assert result.record()["requires"] == [need]
    headers = [line for line in done.patch().splitlines() if line.startswith("# ")]
    assert headers[1] == f"# vllm-fixes backport {fix.id}: requires {need}"
    check_applies(done.patch(), world.tree, tmp_path / "apply")  # the extra header line is a comment


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("none", "this fix has no native transformation"),
        ("cannot", "Widget.compute is not a shape this transformation knows"),
        ("raises", "the transformation failed on this tree: RuntimeError('the transformation has a bug')"),
        ("syntax", "the changed vllm/demo_widget.py does not compile: "),
        ("ineffective", "the change did not verify: the changed tree answers would fix: "),
    ],
)
def test_a_fix_that_cannot_be_carried_says_why_and_writes_nothing(
    world: World, tmp_path: Path, kind: str, reason: str
) -> None:
    original = world.widget()
    result = carry(world.fix("compute", kind), world.tree, tmp_path / "work")
    assert result.result is Carried.REFUSED
    assert result.reason.startswith(reason), result.reason
    assert result.edits == () and world.widget() == original


def test_a_tree_whose_check_cannot_run_is_cannot_with_the_childs_error(world: World, tmp_path: Path) -> None:
    broken = make_tree(
        tmp_path / "broken", WIDGET.replace("class Widget:", "import no_such_module\n\nclass Widget:")
    )
    result = carry(world.fix("compute"), broken, tmp_path / "work")
    assert result.result is Carried.REFUSED
    assert result.reason.startswith("the tree's answer is cannot check: vllm.demo_widget failed to import")


# ---------------------------------------------------------------- backport: several fixes
def test_two_fixes_of_one_file_chain(world: World, tmp_path: Path) -> None:
    first, second = world.fix("compute"), world.fix("shift")
    original = world.widget()
    done = backport([first, second], world.tree, tmp_path / "work")
    assert [r.result for r in done.results] == [Carried.WRITTEN, Carried.WRITTEN], done.results
    (a,), (b,) = done.results[0].edits, done.results[1].edits
    # The second transformation ran on the tree holding the first's verified edit.
    assert a.before == original and b.before == a.after
    (final,) = done.edits
    assert (final.path, final.before, final.after) == (a.path, original, b.after)
    assert final.after.count("# vllm-fixes ") == 2 and world.widget() == original
    clean = check_applies(done.patch(), world.tree, tmp_path / "apply")
    assert (clean / final.path).read_text() == final.after
    assert done.summary() == (
        f"backport of {world.tree.root}: 2 fixes — 2 written and verified, 0 carries it already, "
        "0 not applicable, 0 refused"
    )


def test_the_patch_has_one_section_per_fix(world: World, tmp_path: Path) -> None:
    good, bad = world.fix("compute"), world.fix("shift", "none")
    done = backport([good, bad], world.tree, tmp_path / "work")
    assert done.failed == [bad.id]
    headers = [line for line in done.patch().splitlines() if line.startswith("# ")]
    assert headers == [
        f"# vllm-fixes backport {good.id}: written and verified "
        "(written; on the changed tree the fix's probe no longer sees the bug)",
        f"# vllm-fixes backport {bad.id}: refused (this fix has no native transformation)",
    ]
    assert [e.path for e in done.edits] == ["vllm/demo_widget.py"]


# ---------------------------------------------------------------- scratch copies and writes
def test_the_hard_linked_scratch_copy_never_changes_the_original(world: World, tmp_path: Path) -> None:
    original = world.tree.root / "vllm" / "demo_widget.py"
    text, inode = original.read_text(), original.stat().st_ino
    scratch = scratch_copy(world.tree, tmp_path / "scratch")
    copy = scratch.root / "vllm" / "demo_widget.py"
    assert copy.stat().st_ino == inode  # linked, not copied (one file system)
    write_edits(scratch.root, [NativeEdit("vllm/demo_widget.py", text, text + "# changed\n")])
    assert copy.read_text() == text + "# changed\n" and copy.stat().st_ino != inode
    assert original.stat().st_ino == inode and original.read_text() == text


def test_compiled_modules_come_along_and_an_edited_module_s_are_dropped(world: World, tmp_path: Path) -> None:
    """A child importing vLLM from a scratch copy reuses the tree's bytecode (hard-linked);
    the bytecode of a file an edit replaced is removed from the copy, never from the tree."""
    cache = world.tree.root / "vllm" / "__pycache__"
    cache.mkdir()
    (cache / "demo_widget.cpython-311.pyc").write_bytes(b"stale")
    (cache / "__init__.cpython-311.pyc").write_bytes(b"kept")
    (world.tree.root / "vllm" / "stray.pyc").write_bytes(b"no source")
    scratch = scratch_copy(world.tree, tmp_path / "scratch")
    copied = scratch.root / "vllm" / "__pycache__"
    assert sorted(p.name for p in copied.iterdir()) == [
        "__init__.cpython-311.pyc",
        "demo_widget.cpython-311.pyc",
    ]
    assert not (scratch.root / "vllm" / "stray.pyc").exists()
    text = world.widget()
    write_edits(scratch.root, [NativeEdit("vllm/demo_widget.py", text, text + "# changed\n")])
    assert [p.name for p in copied.iterdir()] == ["__init__.cpython-311.pyc"]
    assert (cache / "demo_widget.cpython-311.pyc").read_bytes() == b"stale"  # the tree's own stays


def test_the_tree_is_asked_about_every_fix_in_one_child(world: World, tmp_path: Path) -> None:
    compute, shift = world.fix("compute"), world.fix("shift")
    answers = ask_tree_all(world.tree, [compute, shift])
    assert {k: v["answer"] for k, v in answers.items()} == {compute.id: "would fix", shift.id: "would fix"}
    assert ask_tree(world.tree, shift) == answers[shift.id]


def test_a_write_through_a_link_out_of_the_tree_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "installed"
    (elsewhere / "sub").mkdir(parents=True)
    (elsewhere / "sub" / "mod.py").write_text("x = 1\n")
    tree = make_tree(tmp_path / "tree")
    (tree.root / "vllm" / "sub").symlink_to(elsewhere / "sub")
    edit = NativeEdit("vllm/sub/mod.py", "x = 1\n", "x = 2\n")
    with pytest.raises(CannotCarry, match="lies behind a link out of the tree"):
        write_edits(tree.root, [edit, NativeEdit("vllm/__init__.py", tree.read("vllm"), "")])
    assert tree.read("vllm") and (elsewhere / "sub" / "mod.py").read_text() == "x = 1\n"
    # A scratch copy follows the link: the copy's folder is its own, and the edit lands there.
    scratch = scratch_copy(tree, tmp_path / "scratch")
    assert not (scratch.root / "vllm" / "sub").is_symlink()
    write_edits(scratch.root, [edit])
    assert (
        scratch.read("vllm.sub.mod") == "x = 2\n" and (elsewhere / "sub" / "mod.py").read_text() == "x = 1\n"
    )


def test_a_stale_edit_writes_no_file(tmp_path: Path) -> None:
    tree = make_tree(tmp_path / "tree")
    fresh = NativeEdit("vllm/__init__.py", tree.read("vllm"), "# new\n")
    stale = NativeEdit("vllm/demo_widget.py", "something else\n", "x\n")
    with pytest.raises(CannotCarry, match=r"vllm/demo_widget\.py changed since the edit was made"):
        write_edits(tree.root, [fresh, stale])
    assert tree.read("vllm") == fresh.before  # checked before anything was written


# ---------------------------------------------------------------- the command
def test_the_command_prints_a_patch_git_apply_and_patch_accept(world: World, tmp_path: Path) -> None:
    first, second = world.fix("compute"), world.fix("shift")
    world.register(first, second)
    original = world.widget()
    out = world.cli("--source", str(world.tree.root))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"# vllm-fixes backport {first.id}: written and verified")
    clean = check_applies(out.stdout, world.tree, tmp_path / "apply")
    assert clean.joinpath("vllm/demo_widget.py").read_text().count("# vllm-fixes ") == 2
    assert world.widget() == original  # without --write the tree is not touched
    # The table and the summary line go to stderr, with a progress line per fix.
    assert f"vllm-fixes backport: {second.id}: written and verified" in out.stderr
    assert "2 fixes — 2 written and verified, 0 carries it already, 0 not applicable, 0 refused" in out.stderr


def test_write_changes_the_tree_only_with_what_verified(world: World) -> None:
    good, bad = world.fix("compute"), world.fix("shift", "ineffective")
    world.register(good, bad)
    original = world.widget()
    refused = world.cli("--source", str(world.tree.root), "--fix", bad.id, "--write", "--json")
    assert refused.returncode == 1, refused.stderr
    data = json.loads(refused.stdout)
    assert data["written"] is False and world.widget() == original
    (record,) = data["fixes"]
    assert record["fix"] == bad.id and record["result"] == "refused"
    assert record["reason"].startswith("the change did not verify: the changed tree answers would fix")
    assert record["files"] == []
    both = world.cli("--source", str(world.tree.root), "--write", "--json")
    assert both.returncode == 1, both.stderr  # one needed fix was not carried
    data = json.loads(both.stdout)
    assert data["written"] is True
    assert {r["fix"]: (r["result"], r["files"]) for r in data["fixes"]} == {
        good.id: ("written and verified", ["vllm/demo_widget.py"]),
        bad.id: ("refused", []),
    }
    changed = world.widget()
    assert changed != original and changed.count("# vllm-fixes ") == 1 and "x = x + 1" in changed
    again = world.cli("--source", str(world.tree.root), "--fix", good.id, "--json")
    assert json.loads(again.stdout)["fixes"][0]["result"] == "carries it already", again.stdout


def test_output_writes_the_patch_file(world: World, tmp_path: Path) -> None:
    fix = world.fix("compute")
    world.register(fix)
    target = tmp_path / "carry.patch"
    out = world.cli("--source", str(world.tree.root), "--output", str(target))
    assert out.returncode == 0, out.stderr
    assert target.read_text().startswith(f"# vllm-fixes backport {fix.id}: written and verified")
    assert out.stdout.splitlines()[-1].startswith(f"backport of {world.tree.root}: 1 fixes — 1 written")


def test_bad_usage_exits_2(world: World, tmp_path: Path) -> None:
    world.register(world.fix("compute"))
    no_tree = world.cli("--source", str(tmp_path / "fixes"))
    assert no_tree.returncode == 2 and "holds no vllm/ package" in no_tree.stderr
    both = world.cli("--source", str(world.tree.root), "--write", "--output", str(tmp_path / "p"))
    assert both.returncode == 2 and "not allowed with argument" in both.stderr
    unknown = world.cli("--source", str(world.tree.root), "--fix", "no-such-fix")
    assert unknown.returncode == 2 and "unknown fix id(s): no-such-fix" in unknown.stderr


def test_backport_result_type_is_what_the_command_reports(world: World, tmp_path: Path) -> None:
    done = backport([], world.tree, tmp_path / "work")
    assert isinstance(done, Backport) and done.results == () and done.patch() == "" and done.failed == []
    assert textwrap.dedent(done.summary()).endswith(
        "0 fixes — 0 written and verified, 0 carries it already, 0 not applicable, 0 refused"
    )
