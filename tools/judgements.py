"""What each fix must answer on a release, judged by reading that release's source.

docs/support-matrix/judgements.toml holds, per release and fix, the answer a maintainer expects
after reading the release's own code (and the bug's specification) and why, independent of the
probe: ``["0.34.0".listener-port] answer = "affected → fixed"``, ``why = "..."``. The matrix cell
of a judged release (tools/matrix.py record) fails when the probe's answer differs from the
judgement, with or without --write: a new release's stored result can only be one a person has
judged right from the source.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

FILE = "judgements.toml"


def load(store: Path) -> dict[str, dict[str, dict[str, str]]]:
    """release -> fix id -> {"answer", "why"} (empty when the store has no judgements file)."""
    path = store / FILE
    if not path.exists():
        return {}
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    for release, fixes in data.items():
        for fix_id, entry in fixes.items():
            missing = {"answer", "why"} - set(entry)
            if missing:
                raise ValueError(f"{path}: [{release!r}.{fix_id}] lacks {', '.join(sorted(missing))}")
    return data


def contradictions(
    release: str, fresh: dict[str, Any], judged: dict[str, dict[str, dict[str, str]]]
) -> list[str]:
    """One line per judged fix whose answer on `release` is not the judged one (or is missing)."""
    lines = []
    for fix_id, entry in sorted(judged.get(release, {}).items()):
        got = fresh["fixes"].get(fix_id, {}).get("answer", "no answer")
        if got != entry["answer"]:
            lines.append(
                f"matrix {release}: {fix_id}: answers {got!r}, judged {entry['answer']!r} from the "
                f"source: {entry['why']}"
            )
    return lines
