"""What the runtime wheels may hold: each module reachable from what vLLM or the command loads.

    python tools/wheels.py DIST_DIR

For every fix wheel and the core wheel: the roots are the modules its entry points name (the
vLLM plugin, the declaration, the `vllm-fixes` script) and the modules the declaration names
for probe / recognize / apply; everything those import (inside the package) is runtime code.
Any other module in the wheel is there only for tests, and fails the check. The test-support
package (vllm-fix-testing) must not be a dependency of any runtime wheel.
"""

from __future__ import annotations

import ast
import configparser
import re
import sys
import zipfile
from pathlib import Path

TEST_SUPPORT = "vllm_fix_testing"


def _modules(zf: zipfile.ZipFile, package: str) -> dict[str, str]:
    """module name -> source, for the package's .py files in the wheel."""
    found = {}
    for name in zf.namelist():
        if name.startswith(package + "/") and name.endswith(".py"):
            module = name[:-3].replace("/", ".").removesuffix(".__init__")
            found[module] = zf.read(name).decode()
    return found


def _imports(source: str, module: str) -> set[str]:
    """Every module `source` imports (absolute names), and the declaration's "module:function"s."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")[: -node.level]
                base = ".".join([*parts, base]) if base else ".".join(parts)
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            # "module:function" references (the declaration's probe / recognize / apply)
            match = re.fullmatch(r"(vllm_fix\w*(?:\.\w+)*):\w+(?:\.\w+)*", node.value)
            if match:
                found.add(match.group(1))
    return found


class _Wheel:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.problems: list[str] = []
        with zipfile.ZipFile(path) as zf:
            dist_info = next(n.split("/")[0] for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
            metadata = zf.read(f"{dist_info}/METADATA").decode()
            eps = configparser.ConfigParser()
            if f"{dist_info}/entry_points.txt" in zf.namelist():
                eps.read_string(zf.read(f"{dist_info}/entry_points.txt").decode())
            packages = {n.split("/")[0] for n in zf.namelist() if "/" in n and not n.startswith(dist_info)}
            if any(name == "tests" or name.startswith("tests/") for name in zf.namelist()):
                self.problems.append(f"{path.name}: ships tests/")
            for line in metadata.splitlines():
                if (
                    line.startswith("Requires-Dist:")
                    and "vllm-fix-testing" in line
                    and "extra ==" not in line
                ):
                    self.problems.append(f"{path.name}: depends on the test-support package ({line})")
            self.modules = {p: _modules(zf, p) for p in packages if p != TEST_SUPPORT}
        entry_modules = {value.split(":")[0].strip() for s in eps.sections() for value in eps[s].values()}
        self.roots = {p: {p, f"{p}.__about__", *entry_modules} for p in self.modules}

    def reach(self, extra: set[str]) -> set[str]:
        """Every module reached from the roots (and `extra`), other wheels' modules included."""
        seen: set[str] = set()
        todo = [m for roots in self.roots.values() for m in roots] + list(extra)
        own = {m: src for mods in self.modules.values() for m, src in mods.items()}
        while todo:
            module = todo.pop()
            if module in seen:
                continue
            seen.add(module)
            if module in own:
                todo.extend(_imports(own[module], module))
        return seen


def check_wheels(paths: list[Path]) -> list[str]:
    """Problems of every wheel: a module that no entry point reaches, in its own wheel or from
    another runtime wheel (a fix's probe using the core's shared stand-in, say)."""
    wheels = [_Wheel(p) for p in paths]
    reached_elsewhere = set().union(*(w.reach(set()) for w in wheels)) if wheels else set()
    problems = [p for w in wheels for p in w.problems]
    for wheel in wheels:
        seen = wheel.reach(reached_elsewhere)
        for modules in wheel.modules.values():
            for module in sorted(set(modules) - seen):
                problems.append(f"{wheel.path.name}: {module} is reached by no entry point (test-only code?)")
    return problems


def main(dist: str) -> int:
    wheels = sorted(Path(dist).glob("*.whl"))
    problems = check_wheels(wheels)
    for w in wheels:
        print(f"wheel {w.name}: checked")
    for p in problems:
        print(f"wheel contents: {p}")
    return 1 if problems or not wheels else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
