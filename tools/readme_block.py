"""The shell blocks of README.md that sessions run verbatim, found between markers.

    python tools/readme_block.py operator-install     # print the block

A block is one fenced ```bash block between `<!-- NAME:begin -->` and `<!-- NAME:end -->`; the
session that runs it reads it from here, so the README and the session cannot drift apart.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


class BlockError(ValueError):
    """The markers or the fenced block between them are missing or malformed."""


def block(name: str, text: str) -> str:
    """The commands of the one ```bash block between NAME's markers in `text`."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    if text.count(begin) != 1 or text.count(end) != 1:
        raise BlockError(f"README must hold {begin} and {end} exactly once each")
    inner = text[text.index(begin) + len(begin) : text.index(end)]
    if text.index(begin) > text.index(end):
        raise BlockError(f"{end} comes before {begin}")
    fences = re.findall(r"^```(\w*)\n(.*?)^```\s*$", inner, flags=re.S | re.M)
    if len(fences) != 1 or fences[0][0] not in ("bash", "sh"):
        raise BlockError(f"between {begin} and {end} there must be exactly one ```bash block")
    return fences[0][1]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    print(block(argv[0], README.read_text(encoding="utf-8")), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
