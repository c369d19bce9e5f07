"""Sum the JUnit reports of every pytest session into one closing line.

The line reads 'tests: N passed, N failed, N skipped'.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def main(folder: str) -> int:
    passed = failed = skipped = 0
    reports = sorted(Path(folder).glob("*.xml"))
    for report in reports:
        root = ET.parse(report).getroot()
        suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
        for suite in suites:
            total = int(suite.get("tests", 0))
            f = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
            s = int(suite.get("skipped", 0))
            passed += total - f - s
            failed += f
            skipped += s
    print(f"sessions: {len(reports)} pytest reports")
    print(f"tests: {passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed or not reports or passed == 0 else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1] if len(sys.argv) > 1 else ".nox/_reports"))
