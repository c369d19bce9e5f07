"""tools/generate.py --check: every fix package has the one package shape (docs/writing-a-fix.md)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import generate
import workspace

FIX = "vllm-fix-read-eligibility"
MODULE = "src/vllm_fix_read_eligibility"


@pytest.fixture
def packages(tmp_path: Path) -> Path:
    """A temporary packages/ holding a copy of one fix package, core and testing (which are not fixes)."""
    root = tmp_path / "packages"
    root.mkdir()
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info")
    shutil.copytree(workspace.PACKAGES_DIR / FIX, root / FIX, ignore=skip)
    for other in generate.NOT_FIXES:
        (root / other).mkdir()  # no fix roles at all: must not be checked
    return root


def readme(packages: Path) -> Path:
    return packages / FIX / "README.md"


def test_every_fix_package_in_the_repository_has_the_shape() -> None:
    assert generate.package_shape() == []


def test_every_fix_package_is_checked() -> None:
    checked = {p.name for p in workspace.PACKAGES_DIR.glob("vllm-fix-*/")} - set(generate.NOT_FIXES)
    assert {p.path.name for p in workspace.fix_packages()} == checked
    assert len(checked) == 11


def test_the_copy_has_the_shape(packages: Path) -> None:
    assert generate.package_shape(packages) == []


@pytest.mark.parametrize(
    "role",
    [*generate.PACKAGE_FILES, *(f"{MODULE}/{name}" for name in generate.MODULE_FILES)],
)
def test_a_missing_file_fails_naming_package_and_file(packages: Path, role: str) -> None:
    (packages / FIX / role).unlink()
    problems = generate.package_shape(packages)
    assert f"packages/{FIX}: missing {role}" in problems
    assert all(p.startswith(f"packages/{FIX}") for p in problems)


def test_missing_tests_fail(packages: Path) -> None:
    shutil.rmtree(packages / FIX / "tests")
    assert generate.package_shape(packages) == [
        f"packages/{FIX}: missing tests/ (a folder with test_*.py files)"
    ]


@pytest.mark.parametrize("section", generate.README_SECTIONS)
def test_a_missing_heading_fails_naming_it(packages: Path, section: str) -> None:
    text = readme(packages).read_text()
    assert f"\n## {section}\n" in text
    readme(packages).write_text(text.replace(f"\n## {section}\n", f"\n### {section}\n", 1))
    problems = generate.package_shape(packages)
    assert f"packages/{FIX}/README.md: missing the heading '## {section}'" in problems


def test_an_extra_heading_fails(packages: Path) -> None:
    text = readme(packages).read_text()
    readme(packages).write_text(text.replace("\n## Releases\n", "\n## Measured\n\nx\n\n## Releases\n", 1))
    assert generate.package_shape(packages) == [
        f"packages/{FIX}/README.md: '## Measured' is not one of the sections "
        "(make it '### Measured' under one)"
    ]


def test_headings_out_of_order_fail(packages: Path) -> None:
    text = readme(packages).read_text()
    text = text.replace("\n## The bug\n", "\n## PLACEHOLDER\n", 1)
    text = text.replace("\n## The rule\n", "\n## The bug\n", 1).replace(
        "\n## PLACEHOLDER\n", "\n## The rule\n"
    )
    readme(packages).write_text(text)
    [problem] = generate.package_shape(packages)
    assert problem.startswith(f"packages/{FIX}/README.md: sections out of order: ['The rule', 'The bug',")


def test_a_heading_inside_a_code_block_is_not_a_section(packages: Path) -> None:
    text = readme(packages).read_text()
    readme(packages).write_text(
        text.replace("\n## Releases\n", "\n```\n## Measured\n```\n\n## Releases\n", 1)
    )
    assert generate.package_shape(packages) == []


def test_the_retire_when_block_must_sit_under_its_heading(packages: Path) -> None:
    text = readme(packages).read_text()
    start, end = text.index(generate.RETIRE_BEGIN), text.index(generate.RETIRE_END) + len(generate.RETIRE_END)
    block = text[start:end]
    moved = (text[:start] + text[end:]).replace("\n## The rule\n", f"\n## The rule\n\n{block}\n", 1)
    readme(packages).write_text(moved)
    assert generate.package_shape(packages) == [
        f"packages/{FIX}/README.md: the retire-when block is not under '## Retire when'"
    ]
    readme(packages).write_text(text[:start] + text[end:])
    assert generate.package_shape(packages) == [
        f"packages/{FIX}/README.md: missing the retire-when block "
        f"({generate.RETIRE_BEGIN} ... {generate.RETIRE_END})"
    ]


def test_a_package_without_the_fix_card_fails(packages: Path) -> None:
    text = readme(packages).read_text()
    readme(packages).write_text(text.replace(generate.BEGIN, "", 1))
    assert generate.package_shape(packages) == [
        f"packages/{FIX}/README.md: missing the fix card ({generate.BEGIN} ... {generate.END})"
    ]


def test_check_fails_on_a_package_without_its_shape(
    packages: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (packages / FIX / MODULE / "probe.py").unlink()
    readme(packages).write_text(
        readme(packages).read_text().replace("\n## Releases\n", "\n### Releases\n", 1)
    )
    monkeypatch.setattr(workspace, "PACKAGES_DIR", packages)
    monkeypatch.setattr(sys, "argv", ["generate.py", "--check"])
    assert generate.main() == 1
    out = capsys.readouterr().out
    assert f"package shape: packages/{FIX}: missing {MODULE}/probe.py" in out
    assert f"package shape: packages/{FIX}/README.md: missing the heading '## Releases'" in out
