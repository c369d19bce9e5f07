"""Every package declares exactly what its runtime sources import.

    python tools/deps.py          # exit 1 and name each difference

For each package under packages/: the top-level modules its src/ imports (every `import` and
`from ... import` statement, function-level ones included; relative imports are the package's
own) are compared with its `[project] dependencies` and its `backport` extra. The standard
library and what a vLLM environment provides (HOST_PROVIDED: vLLM itself and the packages vLLM
declares) are not declared by a fix: a fix never runs outside vLLM, and pinning vLLM's own
dependencies would only fight vLLM's pins. Anything else imported must be declared, and
anything declared must be imported (the meta-package excepted: it exists to declare).
"""

from __future__ import annotations

import ast
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import workspace

# Import name -> why the environment that runs vLLM has it. Only names vLLM imports itself or
# declares (checked against the vLLM releases' metadata when this list changes).
HOST_PROVIDED = {
    "vllm": "vLLM itself: the fixes run inside it",
    "torch": "a vLLM dependency",
    "numpy": "a vLLM dependency",
    "zmq": "pyzmq, a vLLM dependency",
    "msgpack": "MoRIIO's own import (installed next to vLLM, see the README)",
    "mori": "the native MORI engine MoRIIO drives (ROCm machines)",
    "pyverbs": "rdma-core's Python bindings (RDMA machines)",
    "transformers": "a vLLM dependency",
    "tokenizers": "a vLLM dependency (through transformers)",
    "starlette": "a vLLM dependency (through fastapi)",
}
# Import name -> distribution name, where they differ.
DISTRIBUTION = {"yaml": "pyyaml", "zmq": "pyzmq", "google": "protobuf"}


@dataclass(frozen=True)
class Difference:
    package: str
    name: str  # distribution name
    problem: str  # "imported, not declared" / "declared, not imported"
    where: str  # the first import site, for undeclared imports

    def __str__(self) -> str:
        site = f" ({self.where})" if self.where else ""
        return f"{self.package}: {self.name} is {self.problem}{site}"


def imported_modules(src: Path) -> dict[str, str]:
    """Top-level module name -> the first place (file:line) a source file under `src` imports it."""
    found: dict[str, str] = {}
    for path in sorted(src.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                found.setdefault(top, f"{path.relative_to(src.parent)}:{node.lineno}")
    return found


def _declared(pyproject: Path) -> set[str]:
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    # The `backport` extra's requirements count as declared (libcst, imported only by the native
    # transformations, which `vllm-fixes backport` loads).
    extras = project.get("optional-dependencies", {}).get("backport", [])
    return {workspace.requirement_name(req) for req in [*project.get("dependencies", []), *extras]}


def check_package(path: Path, local: dict[str, str]) -> list[Difference]:
    """`local`: import name -> distribution name of the repository's own packages."""
    name = workspace.canonical(tomllib.loads((path / "pyproject.toml").read_text())["project"]["name"])
    declared = _declared(path / "pyproject.toml")
    own = name.replace("-", "_")
    needed: dict[str, str] = {}
    for module, where in imported_modules(path / "src").items():
        if module in sys.stdlib_module_names or module == "__future__" or module == own:
            continue
        if module in HOST_PROVIDED:
            continue
        dist = local.get(module) or workspace.canonical(DISTRIBUTION.get(module, module))
        needed.setdefault(dist, where)
    problems = [
        Difference(name, d, "imported, not declared", w) for d, w in needed.items() if d not in declared
    ]
    if name != workspace.META:
        problems += [Difference(name, d, "declared, not imported", "") for d in declared - set(needed)]
    return sorted(problems, key=str)


def check(packages_dir: Path = workspace.PACKAGES_DIR) -> list[Difference]:
    pyprojects = sorted(packages_dir.glob("*/pyproject.toml"))
    local = {}
    for pyproject in pyprojects:
        name = workspace.canonical(tomllib.loads(pyproject.read_text())["project"]["name"])
        local[name.replace("-", "_")] = name
    return [d for pyproject in pyprojects for d in check_package(pyproject.parent, local)]


def main() -> int:
    problems = check()
    for problem in problems:
        print(problem)
    if problems:
        print(f"deps: {len(problems)} difference(s) between imports and declared dependencies")
        return 1
    print("deps: every package declares exactly what its sources import")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
