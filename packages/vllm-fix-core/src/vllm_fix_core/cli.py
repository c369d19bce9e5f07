"""The `vllm-fixes` command: list, status, verify (each with --json; status/verify with --source),
and backport (carry the fixes a source tree needs in its own code, verified; see backport.py).

Every answer uses the ladder's own words (`Answer` values); `status` and `verify` end with one
summary line per vLLM. With --json, stdout carries only JSON: vLLM's log lines and prints go to
stderr while targets are imported and probed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_fix_core import backport, runtime
from vllm_fix_core.declaration import Fix, ProbeReport
from vllm_fix_core.environment import ImportedVllm, imported_vllm
from vllm_fix_core.ladder import Answer, Decision, GuardAnswer, evaluate, summary_line
from vllm_fix_core.native import CannotCarry, SourceTree
from vllm_fix_core.registry import Installed, installed_fixes, plugin_entry_points
from vllm_fix_core.settings import (
    DISABLE_ENV,
    STRICT_ENV,
    InvalidSetting,
    Settings,
    unknown_ids_message,
    vllm_plugins_filter,
)

VLLM_PLUGINS_WARNING = (
    "VLLM_PLUGINS is set: it filters EVERY vLLM plugin group (general, platform, io-processor, "
    "stat-logger), not only these fixes; use VLLM_FIXES_DISABLE to switch single fixes off"
)
# Answers after which the command exits non-zero: the fix did not fix, or nothing could be said.
_BAD_VERIFY = (Answer.FAILED_TO_FIX, Answer.CANNOT_CHECK)
_BAD_STATUS = (Answer.CANNOT_CHECK,)


# ---------------------------------------------------------------- output helpers
def _width() -> int:
    return max(80, shutil.get_terminal_size((100, 24)).columns)


def _table(rows: list[list[str]], header: list[str]) -> str:
    """Columns padded to their widest cell; the last column wraps to fit the terminal."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header) - 1)]
    lead = sum(widths) + 2 * len(widths)
    last = max(30, _width() - lead)

    def lines(row: list[str]) -> list[str]:
        head = "  ".join(str(c).ljust(w) for c, w in zip(row[:-1], widths, strict=True))
        wrapped = textwrap.wrap(str(row[-1]), last) or [""]
        out = [(head + "  " + wrapped[0]).rstrip()]
        out += [(" " * lead + more).rstrip() for more in wrapped[1:]]
        return out

    rule = ["-" * w for w in widths] + ["-" * min(last, max(len(header[-1]), 4))]
    result: list[str] = []
    for row in [header, rule, *rows]:
        result += lines(row)
    return "\n".join(result)


@contextlib.contextmanager
def _stdout_to_stderr(enabled: bool) -> Iterator[None]:
    """While vLLM is imported and probed, whatever it prints or logs to stdout goes to stderr.

    vLLM's log handler resolves its stream when vLLM's logger is first configured; setting
    VLLM_LOGGING_STREAM (unless the user chose one) and redirecting sys.stdout before vLLM is
    imported sends both its log lines and its prints to stderr.
    """
    if not enabled:
        yield
        return
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    with contextlib.redirect_stdout(sys.stderr):
        yield


def _vllm_json(info: ImportedVllm | None) -> dict[str, Any] | None:
    if info is None:
        return None
    return {"version": info.version, "path": info.path, "distribution": info.distribution}


def _vllm_header(info: ImportedVllm | None) -> str:
    return info.describe() if info else "vLLM: not importable in this environment"


def _vllm_name(info: ImportedVllm | None) -> str:
    return info.version if info else "(not importable)"


def _upstream(fix: Fix) -> str:
    return ", ".join(
        f"#{u.pr} ({u.status.value}{' in ' + u.merged_in if u.merged_in else ''})" for u in fix.upstream
    )


def _checks(report: ProbeReport | None) -> dict[str, bool] | None:
    return None if report is None else {c.name: c.affected for c in report.checks}


# ---------------------------------------------------------------- list
def cmd_list(items: list[Installed], args: argparse.Namespace) -> int:
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "fix": i.fix.id,
                        "distribution": i.fix.distribution,
                        "version": i.version,
                        "title": i.fix.title,
                        "upstream": [
                            {"pr": u.pr, "url": u.url, "status": u.status.value, "merged_in": u.merged_in}
                            for u in i.fix.upstream
                        ],
                        "entry_point": i.fix.entry_point,
                        "processes": [p.value for p in i.fix.processes],
                        "targets": [t.path for t in i.fix.targets],
                    }
                    for i in items
                ],
                indent=2,
                ensure_ascii=False,
            )
        )
        return 0
    rows = [[i.fix.id, i.fix.distribution, i.version, _upstream(i.fix), i.fix.title] for i in items]
    print(_table(rows, ["fix", "package", "version", "upstream", "title"]))
    return 0


# ---------------------------------------------------------------- status
@dataclass
class StatusRow:
    fix: Fix
    version: str
    plugin_loaded: bool
    plugin_note: str
    decision: Decision


def _plugin_state(fix: Fix, entry_points: dict[str, str]) -> tuple[bool, str]:
    allowed = vllm_plugins_filter()
    if fix.entry_point not in entry_points:
        return False, "entry point not registered"
    if allowed is None:
        return True, "loaded"
    if fix.entry_point in allowed:
        return True, "named: loaded"
    return False, "not named: vLLM will not load it"


def status_rows(items: list[Installed], settings: Settings) -> list[StatusRow]:
    eps = plugin_entry_points()
    rows = []
    for item in items:
        loaded, note = _plugin_state(item.fix, eps)
        decision = evaluate(item.fix, settings, apply=False)
        rows.append(StatusRow(item.fix, item.version, loaded, note, decision))
    return rows


def _settings_warnings(settings: Settings, items: list[Installed]) -> list[str]:
    warnings = [VLLM_PLUGINS_WARNING] if vllm_plugins_filter() is not None else []
    valid = [i.fix.id for i in items]
    unknown = settings.unknown_ids(valid)
    if unknown:
        warnings.append(unknown_ids_message(unknown, valid))
    return warnings


def cmd_status(items: list[Installed], args: argparse.Namespace) -> int:
    settings = Settings.from_env()
    with _stdout_to_stderr(args.json):
        info = imported_vllm()
        rows = status_rows(items, settings)
    warnings = _settings_warnings(settings, items)
    line = summary_line(_vllm_name(info), [r.decision for r in rows])
    bad = any(r.decision.answer in _BAD_STATUS for r in rows)
    if args.json:
        print(
            json.dumps(
                {
                    "vllm": _vllm_json(info),
                    "strict": settings.strict,
                    "disabled": sorted(settings.disabled),
                    "vllm_plugins": vllm_plugins_filter(),
                    "warnings": warnings,
                    "fixes": [
                        {
                            **r.decision.record(),
                            "version": r.version,
                            "checks": _checks(r.decision.before),
                            "plugin_loaded_by_vllm": r.plugin_loaded,
                            "vllm_plugins": r.plugin_note,
                        }
                        for r in rows
                    ],
                    "summary": line,
                },
                indent=2,
                ensure_ascii=False,
            )
        )
        return 1 if bad else 0
    print(
        f"{_vllm_header(info)}\n{STRICT_ENV}={'1' if settings.strict else 'unset'}; "
        f"{DISABLE_ENV}={','.join(sorted(settings.disabled)) or 'unset'}"
    )
    for w in warnings:
        print(f"WARNING: {w}")
    table = [[*_row(r.decision), r.plugin_note] for r in rows]
    print(_table(table, ["fix", "answer", "why", "VLLM_PLUGINS"]))
    print(line)
    return 1 if bad else 0


# ---------------------------------------------------------------- verify
def _row(decision: Decision) -> list[str]:
    """A decision's row in the CLI's tables: fix, answer, why (the same record as the JSON)."""
    record = decision.record()
    return [record["fix"], record["answer"], record["reason"]]


def verify_fix(fix: Fix) -> tuple[Decision, dict[str, Any]]:
    """Probe unpatched, apply (strict off, disable switch ignored), probe again, revert."""
    settings = Settings(disabled=frozenset(), strict=False)
    runtime.revert(fix)
    decision = evaluate(fix, settings, apply=True, honour_disable=False)
    runtime.report(decision)  # $VLLM_FIXES_REPORT: one line per decision, as in a vLLM process
    overall: str = decision.answer.value
    checks: list[dict[str, Any]] = []
    before, after = decision.before, decision.after
    for check in before.checks if before is not None else ():
        after_check = next((c for c in after.checks if c.name == check.name), None) if after else None
        if check.guard:
            if check.affected:
                answer: str = GuardAnswer.BROKEN_HERE.value
            elif after_check is not None and after_check.affected:
                answer = GuardAnswer.BROKEN_BY_FIX.value
            else:
                answer = GuardAnswer.KEPT.value
        else:
            # A symptom this vLLM does not show is fixed upstream; one it shows shares the
            # fix's answer (fixed, failed to fix, or refused).
            answer = overall if check.affected else Answer.FIXED_UPSTREAM.value
        checks.append({"check": check.name, "guard": check.guard, "answer": answer, "detail": check.detail})
    if decision.patch is not None:
        decision.patch.revert()
    return decision, {
        **decision.record(),
        "shape": decision.shape,
        "checks": checks,
    }


def cmd_verify(items: list[Installed], args: argparse.Namespace) -> int:
    with _stdout_to_stderr(args.json):
        info = imported_vllm()
        verified = [verify_fix(i.fix) for i in items]
    decisions = [d for d, _ in verified]
    results = [r for _, r in verified]
    line = summary_line(_vllm_name(info), decisions)
    bad = [d.fix_id for d in decisions if d.answer in _BAD_VERIFY]
    if args.json:
        print(
            json.dumps(
                {"vllm": _vllm_json(info), "results": results, "failed": len(bad), "summary": line},
                indent=2,
                ensure_ascii=False,
            )
        )
        return 1 if bad else 0
    print(_vllm_header(info))
    rows: list[list[str]] = []
    for r in results:
        note = r["reason"] if r["answer"] != Answer.AFFECTED_FIXED.value else ""
        rows.append([r["fix"], r["answer"], r["shape"] or "", note])
        for c in r["checks"]:
            rows.append(["  " + c["check"], c["answer"], "", ""])
    print(_table(rows, ["fix / check", "answer", "shape", "note"]))
    print(line)
    return 1 if bad else 0


# ---------------------------------------------------------------- --source (fork trees)
def _in_a_tree(answer: str) -> str:
    try:
        return Answer(answer).in_a_tree
    except ValueError:
        return answer


def cmd_source(command: str, source: str, args: argparse.Namespace) -> int:
    """Run `command` in a child process with `source` first on the path; answer per fix."""
    tree = os.path.abspath(source)
    if not os.path.isdir(os.path.join(tree, "vllm")):
        print(
            f"vllm-fixes: {tree} holds no vllm/ package (give the folder that contains vllm/)",
            file=sys.stderr,
        )
        return 2
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tree, env.get("PYTHONPATH", "")) if p)
    child = [sys.executable, "-m", "vllm_fix_core.cli", command, "--json"]
    for fix_id in args.fix:
        child += ["--fix", fix_id]
    proc = subprocess.run(child, env=env, capture_output=True, text=True, check=False)
    try:
        data = json.loads(proc.stdout)
    except json.JSONDecodeError:
        sys.stderr.write(proc.stderr[-4000:])
        print(
            f"vllm-fixes: the check against {tree} did not complete (exit {proc.returncode})", file=sys.stderr
        )
        return 2
    vllm = data.get("vllm") or {}
    rows = data.get("results") or data.get("fixes") or []
    answers = [
        {
            "fix": row["fix"],
            "answer": row["answer"],
            "this_tree": _in_a_tree(row["answer"]),
            "reason": row["reason"],
        }
        for row in rows
    ]
    if args.json:
        print(
            json.dumps(
                {"source": tree, "vllm": vllm, "fixes": answers, "summary": data.get("summary")},
                indent=2,
                ensure_ascii=False,
            )
        )
        return proc.returncode
    print(f"source tree {tree}: vLLM {vllm.get('version', '?')} ({vllm.get('path', '?')})")
    table = []
    for a in answers:
        why = (
            a["reason"]
            if a["answer"] not in (Answer.FIXED_UPSTREAM.value, Answer.AFFECTED_FIXED.value)
            else ""
        )
        table.append([a["fix"], a["this_tree"], why])
    print(_table(table, ["fix", "this tree", "why"]))
    print(data.get("summary", ""))
    return proc.returncode


# ---------------------------------------------------------------- backport (fork trees)
def _no_tree(tree: str) -> bool:
    if os.path.isdir(os.path.join(tree, "vllm")):
        return False
    print(f"vllm-fixes: {tree} holds no vllm/ package (give the folder that contains vllm/)", file=sys.stderr)
    return True


def _progress(result: backport.Result) -> None:
    print(f"vllm-fixes backport: {result.fix_id}: {result.result.value}", file=sys.stderr, flush=True)


def cmd_backport(items: list[Installed], args: argparse.Namespace) -> int:
    """Carry each fix the tree needs natively, verified on a scratch copy; then print the patch
    (or write it to --output, or write the tree with --write) and exit 1 if one could not be."""
    tree = os.path.abspath(args.source)
    if _no_tree(tree):
        return 2
    source = SourceTree(Path(tree))
    # stdout carries only the patch or JSON: whatever a transformation prints goes to stderr.
    with _stdout_to_stderr(True), tempfile.TemporaryDirectory(prefix="vllm-fixes-backport-") as work:
        done = backport.backport([i.fix for i in items], source, Path(work), on_result=_progress)
    patch, written, code = done.patch(), False, 1 if done.failed else 0
    if args.output:
        Path(args.output).write_text(patch, encoding="utf-8")
    if args.write and done.edits:
        try:  # every fix written has verified: the tree changes now, file by file, all checked first
            backport.write_edits(source.root, done.edits)
            written = True
        except CannotCarry as exc:
            print(f"vllm-fixes: {tree} was not changed: {exc}", file=sys.stderr)
            code = 1
    if args.json:
        records = [r.record() for r in done.results]
        print(
            json.dumps(
                {
                    "source": tree,
                    "fixes": records,
                    "written": written,
                    "output": args.output,
                    "summary": done.summary(),
                },
                indent=2,
                ensure_ascii=False,
            )
        )
        return code
    rows = [
        [r.fix_id, r.result.value, ", ".join(e.path for e in r.edits), "; ".join((r.reason, *r.requires))]
        for r in done.results
    ]
    report = f"{_table(rows, ['fix', 'result', 'files', 'why'])}\n{done.summary()}"
    if written:
        report += f"\n{tree}: {len(done.edits)} files changed"
    if args.write or args.output:
        print(report)
    else:
        sys.stdout.write(patch)
        print(report, file=sys.stderr)
    return code


def _backport_parser(sub: Any) -> None:
    text = (
        "carry the fixes a vLLM source tree needs in its own code: each change is made on a scratch "
        "copy and verified by the fix's probe before it is offered; prints a patch (git apply / patch "
        "-p1), or --output it, or --write the tree; exit 1 if a needed fix could not be carried"
    )
    p = sub.add_parser("backport", help=text, description=text)
    p.add_argument(
        "--source", metavar="TREE", required=True, help="the vLLM source tree (the folder holding vllm/)"
    )
    p.add_argument("--fix", action="append", default=[], help="only this fix id (repeatable)")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--output", metavar="FILE.patch", help="write the patch to this file instead of stdout")
    out.add_argument(
        "--write", action="store_true", help="change the tree in place (the verified fixes only)"
    )
    p.add_argument(
        "--json", action="store_true", help="per fix: fix, result, reason, files (stdout only JSON)"
    )


# ---------------------------------------------------------------- main
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="vllm-fixes", description="Inspect and verify the installed vLLM fixes."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (
        ("list", "installed fix packages, versions, upstream PRs"),
        (
            "status",
            "each fix's answer on the decision ladder for this vLLM, and what VLLM_PLUGINS does to it",
        ),
        (
            "verify",
            "probe unpatched vLLM, apply, probe again; non-zero exit if a fix fails or cannot be checked; "
            "each decision is also a line in $VLLM_FIXES_REPORT when it is set",
        ),
    ):
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("--json", action="store_true", help="machine-readable output (stdout holds only JSON)")
        p.add_argument("--fix", action="append", default=[], help="only this fix id (repeatable)")
        if name != "list":
            p.add_argument(
                "--source",
                metavar="PATH",
                help="a vLLM source tree (the folder holding vllm/): check it instead of the installed vLLM",
            )
    _backport_parser(sub)
    args = parser.parse_args(argv)
    try:
        Settings.from_env()
    except InvalidSetting as exc:
        print(f"vllm-fixes: {exc}", file=sys.stderr)
        return 2
    items = installed_fixes()
    if args.fix:
        valid = sorted(i.fix.id for i in items)
        unknown = set(args.fix) - set(valid)
        if unknown:
            print(
                f"vllm-fixes: unknown fix id(s): {', '.join(sorted(unknown))}; "
                f"installed fixes: {', '.join(valid) or 'none'}",
                file=sys.stderr,
            )
            return 2
        items = [i for i in items if i.fix.id in set(args.fix)]
    if args.command == "backport":
        return cmd_backport(items, args)
    if getattr(args, "source", None):
        return cmd_source(args.command, args.source, args)
    handler = {"list": cmd_list, "status": cmd_status, "verify": cmd_verify}[args.command]
    return handler(items, args)


if __name__ == "__main__":
    raise SystemExit(main())
