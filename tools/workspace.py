"""The packages of this monorepo, read from their pyproject.toml files (no imports)."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from vllm_env import TARGETS

ROOT = Path(__file__).resolve().parent.parent
PACKAGES_DIR = ROOT / "packages"
META = "vllm-fixes"
CORE = "vllm-fix-core"
DEFAULT_TARGETS = TARGETS  # every package is tested on these unless it names its own


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(req: str) -> str:
    return canonical(re.split(r"[\s\[<>=!~;]", req.strip(), maxsplit=1)[0])


@dataclass(frozen=True)
class Package:
    path: Path
    name: str
    version: str
    dependencies: tuple[str, ...]
    extras: dict[str, tuple[str, ...]]
    fix_id: str | None  # the `vllm_fixes` entry point name, for fix packages
    test_targets: tuple[str, ...]  # vLLM targets its tests run on ([tool.vllm-fixes] test-targets)

    @property
    def slug(self) -> str:
        return self.name.removeprefix("vllm-fix-") if self.name != META else "meta"

    @property
    def tests(self) -> Path:
        return self.path / "tests"

    @property
    def import_name(self) -> str:
        return self.name.replace("-", "_")


def _version(path: Path, data: dict) -> str:
    project = data["project"]
    if "version" in project:
        return str(project["version"])
    rel = data["tool"]["hatch"]["version"]["path"]
    text = (path / rel).read_text()
    match = re.search(r"__version__\s*=\s*['\"]([^'\"]+)['\"]", text)
    if not match:
        raise ValueError(f"no __version__ in {path / rel}")
    return match.group(1)


@cache
def packages() -> tuple[Package, ...]:
    found = []
    for pyproject in sorted(PACKAGES_DIR.glob("*/pyproject.toml")):
        data = tomllib.loads(pyproject.read_text())
        project = data["project"]
        eps = project.get("entry-points", {}).get("vllm_fixes", {})
        found.append(
            Package(
                path=pyproject.parent,
                name=canonical(project["name"]),
                version=_version(pyproject.parent, data),
                dependencies=tuple(project.get("dependencies", [])),
                extras={k: tuple(v) for k, v in project.get("optional-dependencies", {}).items()},
                fix_id=next(iter(eps), None),
                test_targets=tuple(
                    data.get("tool", {}).get("vllm-fixes", {}).get("test-targets", DEFAULT_TARGETS)
                ),
            )
        )
    return tuple(found)


def by_name() -> dict[str, Package]:
    return {p.name: p for p in packages()}


def fix_packages() -> list[Package]:
    return [p for p in packages() if p.fix_id]


def local_closure(pkg: Package, extras: tuple[str, ...] = ("test",)) -> tuple[list[Package], list[str]]:
    """(local packages needed, in dependency order, pkg last; third-party requirements)."""
    local = by_name()
    order: list[Package] = []
    third: list[str] = []

    def visit(p: Package, with_extras: tuple[str, ...]) -> None:
        reqs = list(p.dependencies)
        for extra in with_extras:
            reqs += p.extras.get(extra, ())
        for req in reqs:
            name = requirement_name(req)
            if name in local:
                dep = local[name]
                if dep not in order:
                    visit(dep, ())
            elif req not in third:
                third.append(req)
        if p not in order:
            order.append(p)

    visit(pkg, extras)
    return order, third
