"""The newest vLLM release on the registry: is it in the release matrix, and do the fixes work on it.

    python tools/matrix.py newest                      is there a release newer than the matrix's?
    python tools/newest.py verify --release 0.34.0 --out verify.json
                                 (in an environment holding that vLLM and the fixes: the `newest`
                                 session) `vllm-fixes verify --json`, one line per fix that does
                                 not work there

The registry is asked the way the installs ask it: uv, with the machine's find-links, constraint
and index settings (tools/vllm_env.py uv_args()), resolving an unpinned `vllm` for the Python the
sessions run; pre-releases and yanked releases are not candidates, as for an install.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_env

# What fails the `newest` session: the fix does not work on that release.
BAD = ("cannot check", "refused", "failed to fix")
_RELEASE = re.compile(r"(\d+(?:\.\d+)*)(?:\.post(\d+))?")


class RegistryError(Exception):
    """The registry could not be asked (no network, no uv, an index error)."""


def release_key(version: str) -> tuple[tuple[int, ...], int] | None:
    """An order for final releases (`0.34.0`, `0.34.0.post1`); None for anything else (a
    pre-release, a dev or local version), which is never "the newest release"."""
    match = _RELEASE.fullmatch(version.strip())
    if match is None:
        return None
    parts = [int(p) for p in match.group(1).split(".")]
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()
    post = int(match.group(2)) if match.group(2) is not None else -1
    return tuple(parts), post


def _finals(versions: Iterable[str]) -> dict[str, tuple[tuple[int, ...], int]]:
    found = {}
    for version in versions:
        key = release_key(version)
        if key is not None:
            found[version.strip()] = key
    return found


def newest(versions: Iterable[str]) -> str | None:
    """The newest final release among `versions` (None when there is none)."""
    finals = _finals(versions)
    return max(finals, key=finals.__getitem__) if finals else None


def newer(available: Iterable[str], releases: Sequence[str] = vllm_env.RELEASES) -> list[str]:
    """The final releases in `available` newer than the newest of `releases`, oldest first."""
    known = _finals(releases)
    if not known:
        raise ValueError(f"no final release among {list(releases)}")
    bar = max(known.values())
    finals = _finals(available)
    return sorted((v for v, key in finals.items() if key > bar), key=finals.__getitem__)


def check(available: Sequence[str], releases: Sequence[str] = vllm_env.RELEASES) -> tuple[int, str]:
    """(exit code, one line): 1 when the registry holds a release newer than the matrix's newest,
    2 when it offered no release at all, 0 otherwise."""
    top, offered = newest(releases), newest(available)
    if offered is None:
        return 2, f"newest: the registry offered no vLLM release (it answered {list(available)})"
    found = newer(available, releases)
    if found:
        return 1, (
            f"newest: the registry holds vLLM {', '.join(found)}, newer than the matrix's newest "
            f"release {top} (tools/vllm_env.py RELEASES); see docs/releasing.md"
        )
    if offered == top:
        return 0, f"newest: the registry's newest vLLM, {offered}, is the matrix's newest release"
    return 0, f"newest: the registry's newest vLLM, {offered}, is not newer than the matrix's newest, {top}"


def parse_compile(output: str) -> list[str]:
    """The `vllm` version(s) in `uv pip compile` output (`vllm==0.34.0` lines)."""
    found = []
    for line in output.splitlines():
        name, sep, version = line.split("#", 1)[0].strip().partition("==")
        if sep and re.sub(r"[-_.]+", "-", name.strip()).lower() == "vllm":
            found.append(version.strip())
    return found


def registry_versions(python_version: str = "3.11") -> list[str]:
    """What an unpinned `vllm` install on `python_version` takes from the registry: the newest
    release it offers (uv resolves only that one; a list, so that `check` takes either)."""
    cmd = [
        *vllm_env.uv(),
        "pip",
        "compile",
        "-",
        "--no-deps",
        "--no-header",
        "--no-annotate",
        "--quiet",
        "--python-version",
        python_version,
        # A cached index page could hide a release published since it was fetched.
        "--refresh-package",
        "vllm",
        *vllm_env.uv_args(),
    ]
    try:
        done = subprocess.run(cmd, input="vllm\n", capture_output=True, text=True, check=False, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RegistryError(f"{' '.join(cmd[:3])}: {exc}") from exc
    found = parse_compile(done.stdout)
    if done.returncode or not found:
        tail = " ".join((done.stderr or done.stdout).split())[-600:]
        raise RegistryError(f"uv pip compile exited {done.returncode}: {tail}")
    return found


@contextlib.contextmanager
def admitted(release: str) -> Iterator[None]:
    """Let `release` through vllm_env.install_commands while it is not a known target: it is then
    installed as the matrix installs every release (the same commands, so the same base, which a
    later matrix-<release> session reuses). Every other target's commands are unchanged."""
    known = vllm_env.ALL_TARGETS
    if release not in known:
        vllm_env.ALL_TARGETS = (*known, release)
    try:
        yield
    finally:
        vllm_env.ALL_TARGETS = known


def judge(result: dict[str, Any], release: str) -> list[str]:
    """One line per fix whose answer on `release` is one of BAD: the fix, its answer, the reason."""
    return [
        f"newest {release}: {r['fix']}: {r['answer']}: {r['reason']}"
        for r in sorted(result["results"], key=lambda r: r["fix"])
        if r["answer"] in BAD
    ]


def tests_failed(release: str, package: str, report: Path) -> str:
    """The line for a package whose tests failed on `release`: its counts from pytest's JUnit
    report (where pytest wrote one) and where the report is."""
    counts = {"failures": 0, "errors": 0, "tests": 0}
    try:
        for suite in ET.parse(report).getroot().iter("testsuite"):
            for key in counts:
                counts[key] += int(suite.get(key, "0"))
    except (OSError, ET.ParseError, ValueError):
        return f"newest {release}: {package}: its tests failed (no report at {report})"
    return (
        f"newest {release}: {package}: its tests failed: {counts['failures']} failed, "
        f"{counts['errors']} errors of {counts['tests']} ({report})"
    )


def verify(release: str, out: Path) -> int:
    """`vllm-fixes verify --json` on the vLLM installed here (it must be `release`): the result
    stored at `out`, every fix's answer printed, 1 when a fix does not work or vLLM is another."""
    cmd = [sys.executable, "-m", "vllm_fix_core.cli", "verify", "--json"]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)  # vLLM's log: stderr
    try:
        result = json.loads(done.stdout)
    except json.JSONDecodeError:
        print(f"newest {release}: vllm-fixes verify did not complete (exit {done.returncode})")
        return 1
    out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    imported = (result.get("vllm") or {}).get("version", "?")
    if imported != release:
        print(f"newest {release}: vllm-fixes verify imported vLLM {imported}, not {release}")
        return 1
    bad = judge(result, release)
    for r in sorted(result["results"], key=lambda r: r["fix"]):
        if r["answer"] not in BAD:
            print(f"newest {release}: {r['fix']}: {r['answer']}")
    for line in bad:
        print(line)
    print(f"newest {release}: {result.get('summary', '')}")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    ver = sub.add_parser("verify", help="vllm-fixes verify --json here; name every fix that does not work")
    ver.add_argument("--release", required=True)
    ver.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    return verify(args.release, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
