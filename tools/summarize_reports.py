"""Close a CI run with one line: every pytest session's JUnit report plus nox's session reports.

    python tools/summarize_reports.py REPORTS_DIR NOX_REPORT.json [NOX_REPORT.json ...]

The line reads 'tests: N passed, N failed, N skipped'. A session that failed without a pytest
failure of its own (lint, types, docs, build, a matrix cell, the install) counts as one failed
test, and so does a nox run that wrote no report, so the line never says 0 failed for a red run.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def main(folder: str, nox_reports: list[str]) -> int:
    passed = failed = skipped = 0
    failed_by_session: dict[str, int] = {}
    for report in sorted(Path(folder).glob("*.xml")):
        root = ET.parse(report).getroot()
        suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
        for suite in suites:
            total = int(suite.get("tests", 0))
            f = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
            s = int(suite.get("skipped", 0))
            passed += total - f - s
            failed += f
            skipped += s
            failed_by_session[report.stem] = failed_by_session.get(report.stem, 0) + f
    for nox_report in nox_reports:
        if not Path(nox_report).exists():
            failed += 1
            continue
        for session in json.loads(Path(nox_report).read_text()).get("sessions", []):
            name = str(session.get("name", ""))
            own = sum(
                n for stem, n in failed_by_session.items() if stem == name or stem.startswith(name + "-")
            )
            if session.get("result") in ("failed", "aborted") and not own:
                failed += 1
    print(f"tests: {passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed or passed == 0 else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1], sys.argv[2:]))
