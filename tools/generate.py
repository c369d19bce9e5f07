"""Generate what is derived from the fix declarations, or check that it is current.

    python tools/generate.py --write   rewrite README fix cards, docs/fixes.md, the meta-package
    python tools/generate.py --check   exit 1 listing every stale file, every fix package that is not
                                       of the one package shape, every dangling reference (CI)

Needs vllm-fix-core and every fix package importable (no vLLM); the package shape check alone
(`package_shape`) needs neither.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workspace

if TYPE_CHECKING:
    from vllm_fix_core.declaration import Fix

BEGIN, END = "<!-- BEGIN fix-card -->", "<!-- END fix-card -->"
RETIRE_BEGIN, RETIRE_END = "<!-- BEGIN retire-when -->", "<!-- END retire-when -->"
GENERATED = "<!-- generated from the fix declaration by `nox -s docs -- --write`; edit declaration.py -->"

# The one shape of a fix package (docs/writing-a-fix.md): these files, a tests/ folder with tests,
# and a README whose second-level headings are exactly these, in this order (anything else sits
# under one of them as ### or deeper).
NOT_FIXES = ("vllm-fix-core", "vllm-fix-testing")
PACKAGE_FILES = ("README.md", "CHANGELOG.md", "pyproject.toml")
MODULE_FILES = ("__init__.py", "__about__.py", "declaration.py", "plugin.py", "probe.py", "patch.py")
README_SECTIONS = (
    "The bug",
    "The rule",
    "How the fix decides",
    "Releases",
    "Native carry (forks)",
    "Retire when",
)


def declaration(pkg: workspace.Package) -> Fix:
    from vllm_fix_core.declaration import Fix

    module = importlib.import_module(f"{pkg.import_name}.declaration")
    fix = module.FIX
    assert isinstance(fix, Fix)
    return fix


def readme_sections(text: str) -> list[str]:
    """The README's second-level headings, in order (lines inside fenced code blocks are not headings)."""
    found, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced and line.startswith("## "):
            found.append(line[3:].strip())
    return found


def readme_shape(text: str) -> list[str]:
    """What is wrong with a fix README's headings, in words ([] if it has the shape)."""
    found = readme_sections(text)
    if found == list(README_SECTIONS):
        problems = []
    else:
        missing = [s for s in README_SECTIONS if s not in found]
        extra = [s for s in found if s not in README_SECTIONS]
        problems = [f"missing the heading '## {s}'" for s in missing]
        problems += [f"'## {s}' is not one of the sections (make it '### {s}' under one)" for s in extra]
        repeated = sorted({s for s in found if s in README_SECTIONS and found.count(s) > 1})
        problems += [f"'## {s}' appears more than once" for s in repeated]
        if not problems:
            problems = [f"sections out of order: {found}, expected {list(README_SECTIONS)}"]
    if BEGIN not in text or END not in text:
        problems.append(f"missing the fix card ({BEGIN} ... {END})")
    retire = text.split("\n## Retire when\n", 1)
    if RETIRE_BEGIN not in text or RETIRE_END not in text:
        problems.append(f"missing the retire-when block ({RETIRE_BEGIN} ... {RETIRE_END})")
    elif len(retire) < 2 or RETIRE_BEGIN not in retire[1].split("\n## ", 1)[0]:
        problems.append("the retire-when block is not under '## Retire when'")
    return problems


def package_shape(packages_dir: Path | None = None) -> list[str]:
    """Every fix package (packages/vllm-fix-*/, core and testing aside) against the one package shape:
    one line per problem, naming the package and what is missing."""
    packages_dir = packages_dir or workspace.PACKAGES_DIR
    problems = []
    for path in sorted(packages_dir.glob("vllm-fix-*/")):
        if path.name in NOT_FIXES:
            continue
        rel = path.relative_to(packages_dir.parent)
        module = f"src/{path.name.replace('-', '_')}"
        wanted = [*PACKAGE_FILES, *(f"{module}/{name}" for name in MODULE_FILES)]
        problems += [f"{rel}: missing {name}" for name in wanted if not (path / name).is_file()]
        if not any((path / "tests").glob("test_*.py")):
            problems.append(f"{rel}: missing tests/ (a folder with test_*.py files)")
        if (path / "README.md").is_file():
            problems += [f"{rel}/README.md: {p}" for p in readme_shape((path / "README.md").read_text())]
    return problems


def upstream_text(fix: Fix) -> str:
    parts = []
    for u in fix.upstream:
        text = f"[vllm-project/vllm#{u.pr}]({u.url}): {u.status.value}"
        if u.merged_in:
            text += f" (in vLLM {u.merged_in})"
        if u.note:
            text += f"; {u.note}"
        parts.append(text)
    return "<br>".join(parts)


def card(fix: Fix) -> str:
    targets = "<br>".join(f"`{t.module}:{t.qualname}` ({t.process.value})" for t in fix.targets)
    rows = [
        ("Why", fix.why),
        ("How", fix.how),
        ("Upstream", upstream_text(fix)),
        ("Retire when", fix.retire_when),
        ("Targets", targets),
        (
            "Switch off",
            f"`VLLM_FIXES_DISABLE={fix.id}` (or vLLM's `VLLM_PLUGINS` without `{fix.entry_point}`)",
        ),
    ]
    if fix.notes:
        rows.append(("Notes", "<br>".join(fix.notes)))
    body = "\n".join(f"| **{k}** | {v} |" for k, v in rows)
    return f"{BEGIN}\n{GENERATED}\n\n**{fix.title}** (fix id `{fix.id}`)\n\n| | |\n|---|---|\n{body}\n{END}"


def retire_block(fix: Fix) -> str:
    return f"{RETIRE_BEGIN}\n{GENERATED}\n\n{fix.retire_when}\n{RETIRE_END}"


def readme(pkg: workspace.Package, fix: Fix) -> tuple[Path, str]:
    path = pkg.path / "README.md"
    text = path.read_text()
    for begin, end, block in ((BEGIN, END, card(fix)), (RETIRE_BEGIN, RETIRE_END, retire_block(fix))):
        pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
        if not pattern.search(text):
            raise SystemExit(f"{path}: missing the {begin} ... {end} block")
        text = pattern.sub(lambda _, block=block: block, text, count=1)
    return path, text


def fixes_table(items: list[tuple[workspace.Package, Fix]]) -> tuple[Path, str]:
    lines = [
        "# Fixes",
        "",
        GENERATED,
        "",
        "| fix id | package | version | upstream | processes | title |",
        "|---|---|---|---|---|---|",
    ]
    for pkg, fix in items:
        ups = ", ".join(f"[#{u.pr}]({u.url}) {u.status.value}" for u in fix.upstream)
        procs = ", ".join(p.value for p in fix.processes)
        link = f"[{pkg.name}](../packages/{pkg.path.name}/README.md)"
        lines.append(f"| `{fix.id}` | {link} | {pkg.version} | {ups} | {procs} | {fix.title} |")
    return workspace.ROOT / "docs" / "fixes.md", "\n".join(lines) + "\n"


def meta_pyproject() -> tuple[Path, str]:
    meta = workspace.by_name()[workspace.META]
    pins = [p for p in workspace.packages() if p.name == workspace.CORE or p.fix_id]
    deps = "\n".join(f'    "{p.name}=={p.version}",' for p in pins)
    header = "# Generated by tools/generate.py from the packages in this repository: do not edit the pins."
    description = (
        "Every vllm-fixes package, pinned exactly: install into a vLLM environment "
        "and each fix applies itself where needed"
    )
    text = f"""{header}
[build-system]
requires = ["hatchling>=1.24"]
build-backend = "hatchling.build"

[project]
name = "vllm-fixes"
dynamic = ["version"]
description = "{description}"
readme = "README.md"
license = "Apache-2.0"
requires-python = ">=3.10"
dependencies = [
{deps}
]

[project.optional-dependencies]
test = ["pytest"]

[tool.hatch.version]
path = "src/vllm_fixes/__about__.py"

[tool.hatch.build.targets.wheel]
packages = ["src/vllm_fixes"]

[tool.hatch.build.targets.sdist]
include = ["src", "tests", "README.md", "CHANGELOG.md"]
"""
    return meta.path / "pyproject.toml", text


def support_matrix() -> tuple[Path, str]:
    import matrix

    store = workspace.ROOT / "docs" / "support-matrix"
    return workspace.ROOT / "docs" / "support-matrix.md", matrix.render(store)


# Where references may point: every file in the repository (tracked or new, not ignored).
_SKIP_DIRS = {".git", ".nox", ".venvs", "dist", "build", "__pycache__", ".mypy_cache", ".ruff_cache"}
_PATH_REF = re.compile(
    r"(?<![\w/.:-])((?:docs|packages|tools|integration|benchmarks|\.ci)/[\w./<>*{}-]*[\w>*}])"
)
_MD_NAME = re.compile(r"(?<![\w/.:-])([\w.-]+\.md)\b")
_MD_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _repo_files() -> list[Path]:
    found = []
    for path in workspace.ROOT.rglob("*"):
        if path.is_file() and not (_SKIP_DIRS & set(path.relative_to(workspace.ROOT).parts)):
            found.append(path)
    return found


def dangling_references() -> list[str]:
    """References to files that are not in the repository, from docs, sources and requirement files."""
    files = _repo_files()
    names = {p.name for p in files}
    problems = []
    for path in files:
        if path.suffix not in (".md", ".py", ".txt", ".toml") or path.name == "CHANGELOG.md":
            continue
        text = path.read_text(errors="replace")
        rel = path.relative_to(workspace.ROOT)
        for ref in _PATH_REF.findall(text):
            target = workspace.ROOT / ref.rstrip(".")
            if "*" in ref or "<" in ref or "{" in ref or target.exists():  # a pattern, not a path
                continue
            problems.append(f"{rel}: {ref} does not exist")
        if path.suffix == ".md":
            for link in _MD_LINK.findall(text):
                if "://" in link or link.startswith("mailto:"):
                    continue
                if not (path.parent / link).exists():
                    problems.append(f"{rel}: link {link} does not exist")
        for name in _MD_NAME.findall(text):
            if name not in names:
                problems.append(f"{rel}: {name} is not a file in this repository")
    return sorted(set(problems))


def main() -> int:
    parser = argparse.ArgumentParser()
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", action="store_true")
    group.add_argument("--check", action="store_true")
    args = parser.parse_args()
    shape = package_shape()
    for problem in shape:
        print(f"package shape: {problem}")
    if shape:
        print("every fix package has the shape docs/writing-a-fix.md describes; nothing generated")
        return 1
    items = [(p, declaration(p)) for p in workspace.fix_packages()]
    outputs = [readme(p, f) for p, f in items] + [fixes_table(items), meta_pyproject(), support_matrix()]
    stale = [path for path, text in outputs if not path.exists() or path.read_text() != text]
    if args.write:
        for path, text in outputs:
            if path in stale:
                path.write_text(text)
                print(f"wrote {path.relative_to(workspace.ROOT)}")
        return 0
    for path in stale:
        print(f"stale: {path.relative_to(workspace.ROOT)} (run `nox -s docs -- --write`)")
    dangling = dangling_references()
    for problem in dangling:
        print(f"dangling reference: {problem}")
    return 1 if stale or dangling else 0


if __name__ == "__main__":
    raise SystemExit(main())
