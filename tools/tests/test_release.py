"""tools/release.py plan: which packages changed version since their last tag (a temporary git repo)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import release

GIT_ENV = {
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@example.invalid",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@example.invalid",
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
}


def git(root: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-C", str(root), *args], check=True, capture_output=True, env={**os.environ, **GIT_ENV}
    )


def write_package(root: Path, name: str, version: str, *, hatch: bool) -> None:
    """A package folder the way the repository has them: a literal version, or hatch's __about__.py."""
    path = root / "packages" / name
    module = path / "src" / name.replace("-", "_")
    module.mkdir(parents=True, exist_ok=True)
    if hatch:
        (path / "pyproject.toml").write_text(
            f'[project]\nname = "{name}"\ndynamic = ["version"]\n\n'
            f'[tool.hatch.version]\npath = "src/{module.name}/__about__.py"\n'
        )
        (module / "__about__.py").write_text(f'__version__ = "{version}"\n')
    else:
        (path / "pyproject.toml").write_text(f'[project]\nname = "{name}"\nversion = "{version}"\n')
    (module / "__init__.py").touch()


def commit(root: Path, message: str) -> None:
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", message)


def released(root: Path, tag: str | None = None) -> list[str]:
    return [p.tag for p in release.plan(root, tag).release]


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    git(tmp_path, "init", "-q", "-b", "main")
    write_package(tmp_path, "vllm-fix-core", "0.2.0", hatch=True)
    write_package(tmp_path, "vllm-fix-core-extra", "1.0.0", hatch=False)  # a name extending another
    write_package(tmp_path, "vllm-fix-demo", "0.1.0", hatch=True)
    commit(tmp_path, "first")
    return tmp_path


def test_no_tags_releases_every_package(repo: Path) -> None:
    assert released(repo) == ["vllm-fix-core-v0.2.0", "vllm-fix-core-extra-v1.0.0", "vllm-fix-demo-v0.1.0"]
    assert release.plan(repo).previous == dict.fromkeys(
        ["vllm-fix-core", "vllm-fix-core-extra", "vllm-fix-demo"]
    )


def test_only_versions_without_a_tag_at_an_earlier_commit(repo: Path) -> None:
    git(repo, "tag", "vllm-fix-core-v0.2.0")
    git(repo, "tag", "vllm-fix-demo-v0.1.0")
    # Tagged at HEAD: that is the release being made (the workflow runs on the tag push).
    assert released(repo) == ["vllm-fix-core-v0.2.0", "vllm-fix-core-extra-v1.0.0", "vllm-fix-demo-v0.1.0"]
    (repo / "README.md").write_text("a later commit\n")
    commit(repo, "second")
    plan = release.plan(repo)
    assert [p.tag for p in plan.release] == ["vllm-fix-core-extra-v1.0.0"]
    assert [p.tag for p in plan.tagged] == ["vllm-fix-core-v0.2.0", "vllm-fix-demo-v0.1.0"]
    assert plan.unreleased_changes == {}
    # A package's files change without a new version: not released, but named.
    (repo / "packages" / "vllm-fix-demo" / "src" / "vllm_fix_demo" / "rule.py").write_text("X = 1\n")
    commit(repo, "third")
    plan = release.plan(repo)
    assert "vllm-fix-demo-v0.1.0" not in [p.tag for p in plan.release]
    assert plan.unreleased_changes == {"vllm-fix-demo": "vllm-fix-demo-v0.1.0"}
    assert any("vllm-fix-demo" in line and "without a new version" in line for line in release.describe(plan))
    # The version moves on: released again, and its last tag is the earlier one.
    write_package(repo, "vllm-fix-demo", "0.1.1", hatch=True)
    commit(repo, "fourth")
    plan = release.plan(repo)
    assert [p.tag for p in plan.release] == ["vllm-fix-core-extra-v1.0.0", "vllm-fix-demo-v0.1.1"]
    assert plan.previous["vllm-fix-demo"] == "vllm-fix-demo-v0.1.0"
    assert plan.unreleased_changes == {}


def test_the_highest_tag_is_the_last_one(repo: Path) -> None:
    for version in ("0.9.0", "0.10.0", "0.2.0"):
        git(repo, "tag", f"vllm-fix-core-v{version}")
    git(repo, "tag", "vllm-fix-core-extra-v7.0.0")  # another package's tag, not core's
    write_package(repo, "vllm-fix-core", "0.11.0", hatch=True)
    commit(repo, "bump")
    assert release.plan(repo).previous["vllm-fix-core"] == "vllm-fix-core-v0.10.0"


def test_a_tag_narrows_the_plan_to_its_package(repo: Path) -> None:
    git(repo, "tag", "vllm-fix-core-extra-v1.0.0")
    assert released(repo, "vllm-fix-core-extra-v1.0.0") == ["vllm-fix-core-extra-v1.0.0"]
    assert released(repo, "vllm-fix-core-v0.2.0") == ["vllm-fix-core-v0.2.0"]
    with pytest.raises(release.ReleaseError, match="does not match"):
        release.plan(repo, "vllm-fix-demo-v0.3.0")
    with pytest.raises(release.ReleaseError, match="names no package"):
        release.plan(repo, "v0.2.0")
