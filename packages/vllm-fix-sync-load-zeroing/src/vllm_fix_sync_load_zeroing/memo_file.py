"""The coverage memo on disk: one JSON entry (stamp, facts, recorded vLLM files), read and
written whole.

Written atomically (a temporary file in the same directory, then ``os.replace``): concurrent
writers (several TP workers starting at once) each replace the whole file, and a reader opens
only the final name, so it sees one complete entry or none, never a temporary file.
``read_memo`` / ``write_memo`` raise on a file that cannot be read, parsed or written;
``try_read`` / ``try_write`` never do, and note in a list of problems what went wrong (a plain
miss is not a problem) for the caller's one DEBUG line.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vllm_fix_sync_load_zeroing import memo_key
from vllm_fix_sync_load_zeroing.facts import CoverageFacts


def read_memo(path: Path, stamp: Mapping[str, Any]) -> CoverageFacts | None:
    """The memo's facts if it is valid for `stamp` and every recorded file is unchanged; None
    if stale. Raises on an unreadable or malformed file."""
    data = json.loads(path.read_bytes())
    if not isinstance(data, dict) or not isinstance(data.get("files"), list):
        raise ValueError("not a coverage memo")
    if data.get("stamp") != stamp:
        return None
    files = data["files"]
    if not files:
        raise ValueError("a memo without files")
    for entry in files:
        file, size, mtime_ns = entry  # ValueError/TypeError on a malformed entry
        try:
            st = os.stat(file)
        except OSError:
            return None  # a recorded file is gone: stale
        if st.st_size != size or st.st_mtime_ns != mtime_ns:
            return None
    return CoverageFacts.from_json(data.get("facts"))


def write_memo(path: Path, stamp: Mapping[str, Any], facts: CoverageFacts) -> None:
    """Atomically (a temporary file in the same directory, then os.replace)."""
    payload = json.dumps(
        {"stamp": dict(stamp), "facts": facts.to_json(), "files": memo_key.vllm_files()},
        separators=(",", ":"),
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the memo from other users of the root
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(payload)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def try_read(path: Path, stamp: Mapping[str, Any], problems: list[str]) -> CoverageFacts | None:
    """read_memo; a missing file is a miss, any other failure a miss noted in `problems`."""
    try:
        return read_memo(path, stamp)
    except FileNotFoundError:
        return None
    except Exception as exc:  # unreadable or corrupt: overwritten with the live facts
        problems.append(f"{path} unreadable ({exc!r})")
        return None


def try_write(path: Path, stamp: Mapping[str, Any], facts: CoverageFacts, problems: list[str]) -> bool:
    """write_memo; False, noted in `problems`, where it fails."""
    try:
        write_memo(path, stamp, facts)
    except Exception as exc:
        problems.append(f"cannot write {path} ({exc!r})")
        return False
    return True
