"""The release matrix: `vllm-fixes verify --json` per vLLM release, stored and rendered.

    python tools/matrix.py record --release 0.31.0 --result out.json [--hostile targets.json]
                                  --store docs/support-matrix [--write]
    python tools/matrix.py render --store docs/support-matrix      (prints docs/support-matrix.md)
    python tools/matrix.py newest [--python-version 3.11]

`record` compares a fresh result with the stored one (answer and checks of every fix): a
difference fails, as a stale generated doc does, until it is reviewed and stored with --write.
A fix that failed to fix, or could not be checked, fails the session whatever is stored, and
so does a patched target whose undo verification did not notice (`--hostile`, the per-target
result of tools/matrix_cell.py): the stored record lists, per fix, the targets proven observed.

`newest` asks the registry for the newest vLLM release (tools/newest.py) and says in one line
whether it is newer than the matrix's newest (tools/vllm_env.py RELEASES): exit 1 when it is, 2
when the registry could not be asked, 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import judgements
import newest as newest_tool
import vllm_env

BAD = ("failed to fix", "cannot check")
ERA = 10  # releases per table


def normalize(
    result: dict[str, Any], release: str, hostile: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """What is compared and rendered: per fix its answer, its checks, the ladder's reason and (with
    the per-target result) each patched target's undo: "observed" or why not."""
    targets = {entry["fix"]: entry["targets"] for entry in hostile or ()}
    fixes = {}
    for r in sorted(result["results"], key=lambda r: r["fix"]):
        fixes[r["fix"]] = {
            "answer": r["answer"],
            "shape": r.get("shape"),
            "checks": {c["check"]: c["answer"] for c in r["checks"]},
            "reason": r["reason"],
        }
        if targets.get(r["fix"]):
            fixes[r["fix"]]["targets"] = targets[r["fix"]]
    vllm = result.get("vllm") or {}
    return {"release": release, "vllm": vllm.get("version", "?"), "fixes": fixes}


def _comparable(record: dict[str, Any]) -> dict[str, Any]:
    return {
        k: {"answer": v["answer"], "checks": v["checks"], "targets": sorted(v.get("targets", {}))}
        for k, v in record["fixes"].items()
    }


def unobserved(record: dict[str, Any]) -> dict[str, list[str]]:
    """Per fix, the patched targets whose undo its verification did not notice."""
    found = {}
    for fix_id, entry in record["fixes"].items():
        missed = [f"{t}: {why}" for t, why in entry.get("targets", {}).items() if why != "observed"]
        if missed:
            found[fix_id] = missed
    return found


def record(release: str, result: Path, store: Path, write: bool, hostile: Path | None = None) -> int:
    checked = json.loads(hostile.read_text()) if hostile is not None else None
    fresh = normalize(json.loads(result.read_text()), release, checked)
    path = store / f"{release}.json"
    bad = {k: v["answer"] for k, v in fresh["fixes"].items() if v["answer"] in BAD}
    for fix_id, answer in bad.items():
        print(f"matrix {release}: {fix_id}: {answer}: {fresh['fixes'][fix_id]['reason']}")
    blind = unobserved(fresh)
    for fix_id, missed in blind.items():
        for line in missed:
            print(f"matrix {release}: {fix_id}: patched target not observed: {line}")
    wrong = judgements.contradictions(release, fresh, judgements.load(store))
    for line in wrong:
        print(line)
    if wrong and write:
        print(f"matrix {release}: not stored: an answer contradicts its judgement from the source")
        return 1
    if write:
        store.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(fresh, indent=2, ensure_ascii=False) + "\n")
        print(f"matrix {release}: stored {path}")
    elif not path.exists():
        print(f"matrix {release}: no stored result at {path}; review and store it with --write")
        return 1
    else:
        stored = json.loads(path.read_text())
        if _comparable(stored) != _comparable(fresh):
            for fix_id in sorted(set(stored["fixes"]) | set(fresh["fixes"])):
                old = _comparable(stored).get(fix_id)
                new = _comparable(fresh).get(fix_id)
                if old != new:
                    print(f"matrix {release}: {fix_id}: stored {old} != now {new}")
            print(f"matrix {release}: differs from {path}; review, then store with --write")
            return 1
    for fix_id, entry in fresh["fixes"].items():
        observed = entry.get("targets", {})
        noun = "patched target, observed" if len(observed) == 1 else "patched targets, each observed"
        proof = f" ({len(observed)} {noun})" if observed and fix_id not in blind else ""
        print(f"matrix {release}: {fix_id}: {entry['answer']}{proof}")
    return 1 if bad or blind or wrong else 0


def render(store: Path) -> str:
    records = {}
    for release in vllm_env.RELEASES:
        path = store / f"{release}.json"
        if path.exists():
            records[release] = json.loads(path.read_text())
    releases = list(records)
    judged_all = judgements.load(store)
    fixes = sorted({f for r in records.values() for f in r["fixes"]})
    lines = [
        "<!-- generated by tools/generate.py from docs/support-matrix/*.json (the matrix sessions); "
        "do not edit -->",
        "# Support matrix",
        "",
        "What `vllm-fixes verify` answers for each fix on the newest patch of every vLLM minor release",
        f"with MoRIIO, {releases[0]} to {releases[-1]}, run by the `matrix-<release>` sessions"
        " (`./run -t matrix`) on",
        "each release's own Python sources over CPU torch; each session then undoes every patched",
        "target of every fix the release needs, one at a time, and verification must fail each time.",
        "CI fails when an answer changes until the new result is reviewed and stored",
        "(`./run -s matrix-<release> -- --write`). One table per ten releases.",
    ]
    for start in range(0, len(releases), ERA):
        era = releases[start : start + ERA]
        lines += [
            "",
            f"## vLLM {era[0]} to {era[-1]}",
            "",
            "| fix | " + " | ".join(era) + " |",
            "|---|" + "---|" * len(era),
        ]
        for fix in fixes:
            cells = [records[r]["fixes"].get(fix, {}).get("answer", "–") for r in era]
            lines.append(f"| {fix} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Answers: **affected → fixed** (the release has the bug; the fix applied and its probe no",
        "longer sees it), **fixed upstream** (the release behaves correctly; nothing is patched),",
        "**not applicable** (the code the bug lives in is not part of the release), **refused** (the",
        "release has the bug but the fix does not patch it, reason below), **cannot check**.",
        "",
        "## Checks and reasons",
    ]
    for fix in fixes:
        lines += ["", f"### {fix}", ""]
        for release in releases:
            entry = records[release]["fixes"].get(fix)
            if entry is None:
                continue
            checks = ", ".join(f"{k}: {v}" for k, v in entry["checks"].items())
            text = f"- **{release}**: {entry['answer']}"
            if checks:
                text += f" ({checks})"
            if entry.get("targets"):
                text += "; undone one at a time, each seen by verification: " + ", ".join(
                    f"`{t}`" for t in entry["targets"]
                )
            if entry["answer"] not in ("affected → fixed",):
                text += f". {entry['reason']}"
            judged = judged_all.get(release, {}).get(fix)
            if judged is not None:
                text += f". Judged from the release's source: {judged['why']}"
            lines.append(text)
    return "\n".join(lines) + "\n"


def newest(python_version: str, releases: tuple[str, ...] = vllm_env.RELEASES) -> int:
    """One line: the registry's newest vLLM against the matrix's newest release; the exit code."""
    try:
        available = newest_tool.registry_versions(python_version)
    except newest_tool.RegistryError as exc:
        print(f"newest: could not ask the registry: {exc}")
        return 2
    code, line = newest_tool.check(available, releases)
    print(line)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("--release", required=True)
    rec.add_argument("--result", type=Path, required=True)
    rec.add_argument("--hostile", type=Path, help="the per-target result (tools/matrix_cell.py)")
    rec.add_argument("--store", type=Path, required=True)
    rec.add_argument("--write", action="store_true")
    ren = sub.add_parser("render")
    ren.add_argument("--store", type=Path, required=True)
    new = sub.add_parser("newest", help="is there a vLLM release newer than the matrix's newest?")
    new.add_argument("--python-version", default="3.11", help="the Python the sessions run (default 3.11)")
    args = parser.parse_args(argv)
    if args.command == "record":
        return record(args.release, args.result, args.store, args.write, args.hostile)
    if args.command == "newest":
        return newest(args.python_version)
    print(render(args.store), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
