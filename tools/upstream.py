"""vLLM's own tests, run against the installed release with every fix applied and without.

    python tools/upstream.py fetch --release 0.33.0 --cache DIR        prints the tests folder
    python tools/upstream.py hub --cache DIR                          prints an offline HF_HOME
    python tools/upstream.py tests --root TESTS_PARENT                prints the test paths
    python tools/upstream.py native-tree --dest DIR [--report FILE]  prints a tree carrying the fixes natively
    python tools/upstream.py compare --release R --patched A.xml --unpatched B.xml --reviewed F.toml
                                     [--focused] [--native] [--fix ID]...

`fetch` downloads the release's source distribution from the package registry once (cached)
and extracts its tests/. `compare` fails on every test that passes without the fixes and fails
with them, unless the reviewed file lists it for that release with the fix id, the reason and
the test of ours that shows why; a listed entry that no longer differs is reported as stale.

`native-tree` copies the installed vLLM package (hard links) to DIR and has `vllm-fixes backport
--write` carry into it every fix it can carry natively there (a fork's tree after `git apply`);
the last line printed is DIR, the line before it the fixes written. Run with PYTHONPATH=DIR and
VLLM_FIXES_DISABLE=all, vLLM's tests then test the native change instead of the runtime patch,
and `compare --native --fix ID...` compares that run with the unpatched one (reviewed entries of
fixes not carried are not expected to differ; an entry with `runs = ["native"]` differs only
there, e.g. where the test's process never imports the module that loads the runtime fix).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tomllib
import urllib.request
import xml.etree.ElementTree as ET
from pathlib import Path

INDEX = "https://pypi.org/simple/vllm/"
# vLLM's tests of the modules the fixes patch (each glob taken where the release has it).
TEST_GLOBS = (
    "tests/v1/kv_connector/unit/test_moriio_*.py",
    "tests/v1/kv_connector/unit/test_multi_connector.py",
    "tests/v1/core/test_scheduler.py",
    "tests/v1/worker/test_gpu_kv_connector.py",
    "tests/reasoning/test_kimi_k3_reasoning_parser.py",
    "tests/tool_use/test_kimi_k3_tool_parser.py",
    "tests/tool_parsers/test_kimi_k3_named_tool_choice.py",
)
# facebook/opt-125m's configuration (no weights, no tokenizer): most scheduler-with-connector
# tests build a ModelConfig for it, offline.
OPT_125M_CONFIG = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "activation_function": "relu",
    "do_layer_norm_before": True,
    "hidden_size": 768,
    "ffn_dim": 3072,
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "max_position_embeddings": 2048,
    "vocab_size": 50272,
    "word_embed_proj_dim": 768,
    "bos_token_id": 2,
    "eos_token_id": 2,
    "pad_token_id": 1,
    "prefix": "</s>",
    "torch_dtype": "float16",
    "dropout": 0.1,
    "attention_dropout": 0.0,
    "activation_dropout": 0.0,
    "init_std": 0.02,
    "layerdrop": 0.0,
    "use_cache": True,
}
OPT_125M_GENERATION = {"bos_token_id": 2, "eos_token_id": 2, "pad_token_id": 1}


def sdist_url(release: str) -> str:
    request = urllib.request.Request(INDEX, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        files = json.load(response)["files"]
    name = f"vllm-{release}.tar.gz"
    for entry in files:
        if entry["filename"] == name:
            return str(entry["url"])
    raise SystemExit(f"the registry has no {name}")


def fetch(release: str, cache: Path) -> Path:
    """tests/ of vLLM `release`'s source distribution, extracted under `cache` (once)."""
    root = cache / f"vllm-{release}-src"
    done = root / ".complete"
    if done.exists():
        return root
    shutil.rmtree(root, ignore_errors=True)
    cache.mkdir(parents=True, exist_ok=True)
    archive = cache / f"vllm-{release}.tar.gz"
    if not archive.exists():
        partial = archive.with_suffix(".part")
        with urllib.request.urlopen(sdist_url(release), timeout=600) as response, partial.open("wb") as out:
            shutil.copyfileobj(response, out)
        partial.rename(archive)
    prefix = f"vllm-{release}/tests/"
    with tarfile.open(archive) as tar:
        # tests/ and the pytest configuration in pyproject.toml (markers, asyncio mode)
        members = [
            m
            for m in tar.getmembers()
            if m.name.startswith(prefix) or m.name == f"vllm-{release}/pyproject.toml"
        ]
        for member in members:
            member.name = member.name[len(f"vllm-{release}/") :]
        tar.extractall(root, members=members, filter="data")
    done.write_text(release)
    return root


def hub(cache: Path) -> Path:
    """An HF_HOME whose hub cache holds facebook/opt-125m's config (enough offline)."""
    home = cache / "hf-home"
    snapshot = home / "hub" / "models--facebook--opt-125m" / "snapshots" / "offline"
    snapshot.mkdir(parents=True, exist_ok=True)
    (snapshot / "config.json").write_text(json.dumps(OPT_125M_CONFIG))
    (snapshot / "generation_config.json").write_text(json.dumps(OPT_125M_GENERATION))
    refs = home / "hub" / "models--facebook--opt-125m" / "refs"
    refs.mkdir(parents=True, exist_ok=True)
    (refs / "main").write_text("offline")
    return home


def native_tree(dest: Path, report: Path | None = None) -> tuple[Path, list[str]]:
    """A copy of the installed vLLM under `dest` with every fix `vllm-fixes backport` can carry
    natively written into it; (the tree, the fixes written). Fails unless at least one is."""
    from vllm_fix_core.backport import scratch_copy
    from vllm_fix_core.native import SourceTree

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("no vLLM is installed in this environment")
    installed = Path(next(iter(spec.submodule_search_locations))).parent
    shutil.rmtree(dest, ignore_errors=True)
    tree = scratch_copy(SourceTree(installed), dest)
    command = ["backport", "--source", str(tree.root), "--write", "--json"]
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_fix_core.cli", *command],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "VLLM_FIXES_DISABLE": ""},
    )
    if proc.returncode not in (0, 1):  # 1: a needed fix could not be carried (said per fix)
        raise SystemExit(f"vllm-fixes backport failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    data = json.loads(proc.stdout)
    if report is not None:
        report.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    for record in data["fixes"]:
        why = f" ({record['reason']})" if record.get("reason") else ""
        print(f"  {record['fix']}: {record['result']}{why}")
    written = sorted(r["fix"] for r in data["fixes"] if r["result"] == "written and verified")
    if not written:
        raise SystemExit("vllm-fixes backport carried no fix natively: nothing to compare")
    return tree.root, written


def test_paths(root: Path) -> list[str]:
    found: list[str] = []
    for pattern in TEST_GLOBS:
        found += sorted(str(p.relative_to(root)) for p in root.glob(pattern))
    return found


def outcomes(report: Path) -> dict[str, str]:
    """test id -> passed / failed / skipped, from a JUnit report."""
    result = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        classname = case.get("classname", "")
        test_id = f"{classname}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            result[test_id] = "failed"
        elif case.find("skipped") is not None:
            result[test_id] = "skipped"
        else:
            result[test_id] = "passed"
    return result


RUNS = ("patched", "native")


def reviewed(path: Path, release: str, run: str = "patched") -> dict[str, dict[str, str]]:
    """test id -> entry, for the entries that name `release` and `run` ("patched": the runtime
    fixes loaded; "native": a tree carrying them natively; an entry without `runs` is both)."""
    data = tomllib.loads(path.read_text())
    found = {}
    for entry in data.get("difference", []):
        runs = entry.get("runs", list(RUNS))
        if not set(runs) <= set(RUNS):
            raise SystemExit(f"{path}: {entry.get('test')}: runs must be among {RUNS}, got {runs}")
        if release in entry["releases"] and run in runs:
            for field in ("test", "fix", "reason", "shown_by"):
                if not entry.get(field):
                    raise SystemExit(f"{path}: an entry for {entry.get('test')} has no {field}")
            found[entry["test"]] = entry
    return found


def _key(test_id: str) -> str:
    """'tests.v1.kv_connector.unit.test_x::test_y[p]' and 'test_x.py::test_y[p]' compare equal."""
    module, _, name = test_id.partition("::")
    return module.replace("/", ".").removesuffix(".py").rsplit(".", 1)[-1] + "::" + name


def compare(
    release: str,
    patched: Path,
    unpatched: Path,
    review: Path,
    focused: bool = False,
    label: str = "with the fixes",
    fixes: list[str] | None = None,
    run: str = "patched",
) -> int:
    """`focused`: the unpatched run covered only the tests that failed patched (CI's form), so
    "passes only with the fixes" cannot be known and is not reported. `fixes`: the fixes the
    patched run carries (None: every fix); reviewed entries of other fixes are left out.
    `label` names the patched run in the report ("carried natively" for a native tree), `run`
    says which reviewed entries apply to it (see `reviewed`)."""
    with_fixes = {_key(k): v for k, v in outcomes(patched).items()}
    without = {_key(k): v for k, v in outcomes(unpatched).items()}
    listed = {
        _key(k): v for k, v in reviewed(review, release, run).items() if fixes is None or v["fix"] in fixes
    }
    broken = sorted(t for t, v in without.items() if v == "passed" and with_fixes.get(t) == "failed")
    fixed = sorted(t for t, v in without.items() if v == "failed" and with_fixes.get(t) == "passed")
    # Every test that failed patched must have been run unpatched (or the comparison is blind).
    unseen = sorted(t for t, v in with_fixes.items() if v == "failed" and t not in without)
    unexplained = [t for t in broken if t not in listed]
    stale = sorted(t for t in listed if t not in broken)
    counts = {s: sum(1 for v in with_fixes.values() if v == s) for s in ("passed", "failed", "skipped")}
    print(
        f"upstream {release}: {len(with_fixes)} of vLLM's tests; {label} {counts['passed']} passed, "
        f"{counts['failed']} failed, {counts['skipped']} skipped; {len(broken)} pass only unpatched "
        f"({len(broken) - len(unexplained)} reviewed), "
        + (
            f"the unpatched run covered only those that failed {label}"
            if focused
            else f"{len(fixed)} pass only {label}"
        )
    )
    for test in broken:
        if test in listed:
            entry = listed[test]
            print(
                f"  reviewed difference: {test}: {entry['fix']}: {entry['reason']} "
                f"(shown by {entry['shown_by']})"
            )
    for test in fixed:
        print(f"  passes only {label}: {test}")
    for test in unexplained:
        print(f"  UNREVIEWED: {test} passes unpatched and fails {label}")
    for test in stale:
        print(f"  STALE review entry: {test} no longer differs on {release}")
    for test in unseen:
        print(f"  NOT COMPARED: {test} failed {label} and has no unpatched result")
    return 1 if unexplained or stale or unseen else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fetch")
    f.add_argument("--release", required=True)
    f.add_argument("--cache", type=Path, required=True)
    h = sub.add_parser("hub")
    h.add_argument("--cache", type=Path, required=True)
    t = sub.add_parser("tests")
    t.add_argument("--root", type=Path, required=True)
    n = sub.add_parser("native-tree")
    n.add_argument("--dest", type=Path, required=True)
    n.add_argument("--report", type=Path, help="write backport's JSON report here")
    c = sub.add_parser("compare")
    c.add_argument("--release", required=True)
    c.add_argument("--patched", type=Path, required=True)
    c.add_argument("--unpatched", type=Path, required=True)
    c.add_argument("--reviewed", type=Path, required=True)
    c.add_argument(
        "--focused", action="store_true", help="the unpatched run covered only the patched failures"
    )
    c.add_argument(
        "--native",
        action="store_true",
        help="the patched run is a tree carrying the fixes natively (its own reviewed entries, label)",
    )
    c.add_argument("--fix", action="append", dest="fixes", help="a fix the patched run carries (repeat)")
    args = parser.parse_args(argv)
    if args.command == "fetch":
        print(fetch(args.release, args.cache))
    elif args.command == "hub":
        print(hub(args.cache))
    elif args.command == "tests":
        print("\n".join(test_paths(args.root)))
    elif args.command == "native-tree":
        tree, written = native_tree(args.dest, args.report)
        print(" ".join(written))
        print(tree)
    else:
        run, label = ("native", "carried natively") if args.native else ("patched", "with the fixes")
        return compare(
            args.release, args.patched, args.unpatched, args.reviewed, args.focused, label, args.fixes, run
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
