"""tools/deps.py: each package's declared dependencies are exactly what its sources import."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import deps


def package(root: Path, name: str, dependencies: list[str], sources: dict[str, str]) -> Path:
    path = root / name
    src = path / "src" / name.replace("-", "_")
    src.mkdir(parents=True)
    quoted = ", ".join(f'"{d}"' for d in dependencies)
    (path / "pyproject.toml").write_text(f'[project]\nname = "{name}"\ndependencies = [{quoted}]\n')
    for file, text in sources.items():
        (src / file).write_text(textwrap.dedent(text))
    return path


def test_every_package_in_the_repository_declares_what_it_imports() -> None:
    assert [str(d) for d in deps.check()] == []


def test_differences_on_synthetic_packages(tmp_path: Path) -> None:
    package(tmp_path, "vllm-fix-core", ["wrapt>=1.14", "packaging>=21"], {"a.py": "import wrapt\n"})
    package(
        tmp_path,
        "vllm-fix-demo",
        ["vllm-fix-core>=0.2", "wrapt"],
        {
            "__init__.py": "from __future__ import annotations\nimport os, json\nfrom . import rule\n",
            "rule.py": """
                import vllm.config
                from torch import nn
                from vllm_fix_core.patching import PatchSet
                from vllm_fix_demo import rule


                def version():
                    from packaging.version import Version  # a function-level import counts
                    import yaml
                    return Version, yaml
            """,
        },
    )
    package(tmp_path, "vllm-fixes", ["vllm-fix-core==0.2.0", "vllm-fix-demo==0.1.0"], {"__init__.py": ""})
    found = {(d.package, d.name, d.problem) for d in deps.check(tmp_path)}
    assert found == {
        ("vllm-fix-core", "packaging", "declared, not imported"),
        ("vllm-fix-demo", "packaging", "imported, not declared"),
        ("vllm-fix-demo", "pyyaml", "imported, not declared"),  # the distribution's name
        ("vllm-fix-demo", "wrapt", "declared, not imported"),
    }
    where = next(d.where for d in deps.check(tmp_path) if d.name == "packaging" and d.where)
    assert where == "src/vllm_fix_demo/rule.py:9"


def test_a_clean_package_has_no_differences(tmp_path: Path) -> None:
    package(tmp_path, "vllm-fix-core", ["wrapt"], {"a.py": "import wrapt\nimport vllm\nimport msgpack\n"})
    package(tmp_path, "vllm-fix-one", ["vllm-fix-core"], {"a.py": "from vllm_fix_core import x\n"})
    assert deps.check(tmp_path) == []
