"""The `vllm-fixes` command: list, status, verify, docs (each with --json)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vllm_fix_core import runtime
from vllm_fix_core.declaration import Fix, ProbeReport
from vllm_fix_core.ladder import Decision, Rung, evaluate
from vllm_fix_core.registry import Installed, installed_fixes, plugin_entry_points
from vllm_fix_core.settings import DISABLE_ENV, STRICT_ENV, Settings, vllm_plugins_filter

VLLM_PLUGINS_WARNING = (
    "VLLM_PLUGINS is set: it filters EVERY vLLM plugin group (general, platform, io-processor, "
    "stat-logger), not only these fixes; use VLLM_FIXES_DISABLE to switch single fixes off"
)


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(row: list[str]) -> str:
        return "  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def _vllm_version() -> str:
    try:
        from vllm_fix_testing import vllm_version

        return str(vllm_version())
    except Exception:
        return "not installed"


def _upstream(fix: Fix) -> str:
    return ", ".join(
        f"#{u.pr} ({u.status.value}{' in ' + u.merged_in if u.merged_in else ''})" for u in fix.upstream
    )


# ---------------------------------------------------------------- list
def cmd_list(items: list[Installed], as_json: bool) -> int:
    if as_json:
        print(
            json.dumps(
                [
                    {
                        "id": i.fix.id,
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
        return False, f"entry point {fix.entry_point} not registered"
    if allowed is None:
        return True, "VLLM_PLUGINS unset: loaded"
    if fix.entry_point in allowed:
        return True, "named in VLLM_PLUGINS: loaded"
    return False, "VLLM_PLUGINS does not name it: vLLM will not load it"


def status_rows(items: list[Installed], settings: Settings) -> list[StatusRow]:
    eps = plugin_entry_points()
    rows = []
    for item in items:
        loaded, note = _plugin_state(item.fix, eps)
        decision = evaluate(item.fix, settings, apply=False)
        rows.append(StatusRow(item.fix, item.version, loaded, note, decision))
    return rows


def _rung_text(decision: Decision) -> str:
    return "would apply" if decision.rung is Rung.EVALUATED else decision.rung.value


def cmd_status(items: list[Installed], as_json: bool) -> int:
    settings = Settings.from_env()
    rows = status_rows(items, settings)
    warnings = [VLLM_PLUGINS_WARNING] if vllm_plugins_filter() is not None else []
    if as_json:
        print(
            json.dumps(
                {
                    "vllm": _vllm_version(),
                    "strict": settings.strict,
                    "disabled": sorted(settings.disabled),
                    "vllm_plugins": vllm_plugins_filter(),
                    "warnings": warnings,
                    "fixes": [
                        {
                            "id": r.fix.id,
                            "version": r.version,
                            "rung": r.decision.rung.value,
                            "reason": r.decision.reason,
                            "checks": _checks(r.decision.before),
                            "plugin_loaded_by_vllm": r.plugin_loaded,
                            "vllm_plugins": r.plugin_note,
                        }
                        for r in rows
                    ],
                },
                indent=2,
            )
        )
        return 0
    print(
        f"vLLM {_vllm_version()}; {STRICT_ENV}={'1' if settings.strict else 'unset'}; "
        f"{DISABLE_ENV}={','.join(sorted(settings.disabled)) or 'unset'}"
    )
    for w in warnings:
        print(f"WARNING: {w}")
    table = [[r.fix.id, _rung_text(r.decision), r.plugin_note, r.decision.reason] for r in rows]
    print(_table(table, ["fix", "rung", "VLLM_PLUGINS", "why"]))
    return 0


def _checks(report: ProbeReport | None) -> dict[str, bool] | None:
    return None if report is None else {c.name: c.affected for c in report.checks}


# ---------------------------------------------------------------- verify
OUTCOME_FIXED = "affected → fixed"
OUTCOME_UPSTREAM = "fixed upstream"
OUTCOME_REFUSED = "refused"
OUTCOME_NA = "not applicable"
OUTCOME_FAILED = "FAILED TO FIX"
_OUTCOME_BY_RUNG = {
    Rung.APPLIED: OUTCOME_FIXED,
    Rung.UPSTREAM_FIXED: OUTCOME_UPSTREAM,
    Rung.NOT_APPLICABLE: OUTCOME_NA,
    Rung.FAILED: OUTCOME_FAILED,
}


def verify_fix(fix: Fix) -> dict[str, Any]:
    """Probe unpatched, apply (strict off, disable switch ignored), probe again, revert."""
    settings = Settings(disabled=frozenset(), strict=False)
    runtime.revert(fix)
    decision = evaluate(fix, settings, apply=True, honour_disable=False)
    overall = _OUTCOME_BY_RUNG.get(decision.rung, OUTCOME_REFUSED)
    checks: list[dict[str, Any]] = []
    before, after = decision.before, decision.after
    for check in before.checks if before is not None else ():
        after_check = next((c for c in after.checks if c.name == check.name), None) if after else None
        if check.guard:
            if check.affected:
                outcome = "guard broken on this vLLM"
            elif after_check is not None and after_check.affected:
                outcome = "GUARD BROKEN BY FIX"
            else:
                outcome = "guard kept"
        else:
            # A symptom this vLLM does not show is fixed upstream; one it shows shares the
            # fix's outcome (fixed, failed to fix, or refused).
            outcome = overall if check.affected else OUTCOME_UPSTREAM
        checks.append({"check": check.name, "guard": check.guard, "outcome": outcome, "detail": check.detail})
    if decision.patch is not None:
        decision.patch.revert()
    return {
        "id": fix.id,
        "outcome": overall,
        "rung": decision.rung.value,
        "reason": decision.reason,
        "shape": decision.shape,
        "checks": checks,
    }


def cmd_verify(items: list[Installed], as_json: bool) -> int:
    results = [verify_fix(i.fix) for i in items]
    failed = [r for r in results if r["outcome"] == OUTCOME_FAILED]
    if as_json:
        print(json.dumps({"vllm": _vllm_version(), "results": results, "failed": len(failed)}, indent=2))
    else:
        print(f"vLLM {_vllm_version()}")
        rows: list[list[str]] = []
        for r in results:
            rows.append(
                [
                    r["id"],
                    r["outcome"],
                    r["shape"] or "",
                    r["reason"] if r["outcome"] != OUTCOME_FIXED else "",
                ]
            )
            for c in r["checks"]:
                rows.append(["  " + c["check"], c["outcome"], "", ""])
        print(_table(rows, ["fix / check", "outcome", "shape", "note"]))
    return 1 if failed else 0


# ---------------------------------------------------------------- main
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="vllm-fixes", description="Inspect and verify the installed vLLM fixes."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (
        ("list", "installed fix packages, versions, upstream PRs"),
        ("status", "each fix's rung on the decision ladder for this vLLM, and what VLLM_PLUGINS does to it"),
        ("verify", "probe unpatched vLLM, apply, probe again; non-zero exit if a fix fails to fix"),
    ):
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.add_argument("--fix", action="append", default=[], help="only this fix id (repeatable)")
    args = parser.parse_args(argv)
    items = installed_fixes()
    if args.fix:
        wanted = set(args.fix)
        unknown = wanted - {i.fix.id for i in items}
        if unknown:
            print(f"vllm-fixes: unknown fix id(s): {', '.join(sorted(unknown))}", file=sys.stderr)
            return 2
        items = [i for i in items if i.fix.id in wanted]
    handler = {"list": cmd_list, "status": cmd_status, "verify": cmd_verify}[args.command]
    return handler(items, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
