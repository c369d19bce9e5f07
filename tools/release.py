"""Which packages a release publishes: each package is versioned and tagged on its own.

    python tools/release.py plan [--tag TAG]     # what `./run -s release` would build

A package's release tag is `<package>-v<version>` (e.g. `vllm-fix-core-v0.2.0`). A package is
released when its version has no tag yet, or when its tag points at the commit being built (the
tag push that triggers the release workflow). `--tag` narrows the plan to the package that tag
names and fails unless the tag matches that package's version in the tree. A package whose
files changed since its last tag without a new version is named as such: not released, but
worth a look before tagging.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class ReleaseError(ValueError):
    """A tag that names no package, or that does not match the package's version."""


@dataclass(frozen=True)
class Pkg:
    name: str
    version: str
    path: Path  # relative to the repository root

    @property
    def tag(self) -> str:
        return tag_for(self.name, self.version)


@dataclass(frozen=True)
class Plan:
    release: list[Pkg]  # build, check and (with the explicit flag) upload these
    tagged: list[Pkg]  # their version is tagged at an earlier commit: already released
    unreleased_changes: dict[str, str]  # package -> its last tag, for files changed since it
    previous: dict[str, str | None]  # package to release -> its last tag before this version


def tag_for(name: str, version: str) -> str:
    return f"{name}-v{version}"


def tag_names(name: str, tag: str) -> bool:
    """Whether `tag` is a release tag of the package `name`."""
    return re.fullmatch(rf"{re.escape(name)}-v\d[^/\s]*", tag) is not None


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _version(path: Path, data: dict[str, object]) -> str:
    project = data["project"]
    assert isinstance(project, dict)
    if "version" in project:
        return str(project["version"])
    rel = data["tool"]["hatch"]["version"]["path"]  # type: ignore[index]
    match = re.search(r"__version__\s*=\s*['\"]([^'\"]+)['\"]", (path / rel).read_text())
    if not match:
        raise ValueError(f"no __version__ in {path / rel}")
    return match.group(1)


def packages(root: Path = ROOT) -> list[Pkg]:
    found = []
    for pyproject in sorted((root / "packages").glob("*/pyproject.toml")):
        data = tomllib.loads(pyproject.read_text())
        found.append(
            Pkg(
                _canonical(data["project"]["name"]),
                _version(pyproject.parent, data),
                pyproject.parent.relative_to(root),
            )
        )
    return found


def _git(root: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=check)


def _commit(root: Path, ref: str) -> str | None:
    out = _git(root, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}", check=False)
    return out.stdout.strip() or None


def _tags(root: Path, name: str) -> list[str]:
    """The package's `<name>-v<version>` tags, highest version first (git's version sort)."""
    out = _git(root, "tag", "--list", f"{name}-v*", "--sort=-v:refname").stdout.split()
    # `<name>-v*` must not match another package whose name extends this one.
    return [t for t in out if tag_names(name, t)]


def plan(root: Path = ROOT, tag: str | None = None) -> Plan:
    head = _commit(root, "HEAD")
    release: list[Pkg] = []
    tagged: list[Pkg] = []
    changes: dict[str, str] = {}
    previous: dict[str, str | None] = {}
    pkgs = packages(root)
    if tag is not None:
        named = [p for p in pkgs if tag_names(p.name, tag)]
        if not named:
            raise ReleaseError(f"tag {tag} names no package (expected <package>-v<version>)")
        pkg = max(named, key=lambda p: len(p.name))
        if pkg.tag != tag:
            raise ReleaseError(f"tag {tag} does not match {pkg.name}'s version in the tree ({pkg.version})")
        pkgs = [pkg]
    for pkg in pkgs:
        at = _commit(root, f"refs/tags/{pkg.tag}")
        if at is None or at == head:
            release.append(pkg)
            earlier = [t for t in _tags(root, pkg.name) if t != pkg.tag]
            previous[pkg.name] = earlier[0] if earlier else None
            continue
        tagged.append(pkg)
        if _git(root, "diff", "--quiet", pkg.tag, "HEAD", "--", str(pkg.path), check=False).returncode:
            changes[pkg.name] = pkg.tag
    return Plan(release, tagged, changes, previous)


def describe(p: Plan) -> list[str]:
    lines = [
        f"release {pkg.name} {pkg.version} (tag {pkg.tag}; last tag: {p.previous.get(pkg.name) or 'none'})"
        for pkg in p.release
    ]
    lines += [f"skip {pkg.name} {pkg.version}: released as {pkg.tag}" for pkg in p.tagged]
    lines += [
        f"note {name}: files changed since {t} without a new version (not released)"
        for name, t in sorted(p.unreleased_changes.items())
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="the packages a release would build")
    p.add_argument("--tag", help="only the package this tag names (the release workflow's tag)")
    p.add_argument("--paths", action="store_true", help="print only their folders, one per line")
    args = parser.parse_args(argv)
    try:
        result = plan(ROOT, args.tag)
    except ReleaseError as exc:
        print(f"release: {exc}")
        return 2
    if args.paths:
        print("\n".join(str(ROOT / pkg.path) for pkg in result.release))
    else:
        print("\n".join(describe(result)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
