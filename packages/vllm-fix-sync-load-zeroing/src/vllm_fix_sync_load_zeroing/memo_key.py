"""What a coverage memo is valid for: where it lives and the stamp it must match.

Validity works like Python's own bytecode cache: the entry records ``(path, size, mtime_ns)`` of
the file of every ``vllm`` module loaded once the facts were computed (``vllm_files``, a
superset of what the computation can depend on), and a stamp (``current_stamp``): vLLM's version
and install path, torch's and Python's versions, the values of the environment variables the
computation reads, this package's version and a hash of the source of the modules that define
the facts. A read stats every recorded file (:mod:`vllm_fix_sync_load_zeroing.memo_file`); any
difference means "compute live".

The entry lives under vLLM's own cache root (``memo_path``):
``$VLLM_CACHE_ROOT/vllm-fixes/sync-load-zeroing/coverage-<install hash>.json``, one file per
vLLM install.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path
from typing import Any

from vllm_fix_sync_load_zeroing.__about__ import __version__

FIX_ID = "sync-load-zeroing"
SCHEMA = 1
# Environment variables the computation reads (vLLM's layout resolver in hybrid_layouts():
# VLLM_KV_CACHE_LAYOUT narrows the accepted layouts to the requested one). Found by recording
# every os.environ / vllm.envs read during the computation on vLLM 0.31.0, 0.32.0 and 0.33.0.
ENV_INPUTS = ("VLLM_KV_CACHE_LAYOUT",)
# The modules whose source defines the facts (and this memo's format).
_OWN_MODULES = ("oracle", "probe", "facts", "memo", "memo_key", "memo_file")


def memo_path() -> Path:
    """One file per vLLM install, under vLLM's own cache root."""
    import vllm
    import vllm.envs

    root = Path(vllm.envs.VLLM_CACHE_ROOT)
    install = hashlib.sha256(os.path.dirname(os.path.abspath(vllm.__file__ or "")).encode()).hexdigest()
    return root / "vllm-fixes" / FIX_ID / f"coverage-{install[:16]}.json"


def current_stamp() -> dict[str, Any]:
    """Everything but the per-file stamps that the facts depend on."""
    import torch
    import vllm

    return {
        "schema": SCHEMA,
        "fix_version": __version__,
        "own_source": own_source_hash(),
        "python": sys.version,
        "vllm_version": str(getattr(vllm, "__version__", "")),
        "vllm_path": os.path.dirname(os.path.abspath(vllm.__file__ or "")),
        "torch_version": str(torch.__version__),
        "env": {name: os.environ.get(name) for name in ENV_INPUTS},
    }


def own_source_hash() -> str:
    digest = hashlib.sha256()
    here = Path(__file__).parent
    for name in _OWN_MODULES:
        digest.update(name.encode() + b"\0" + (here / f"{name}.py").read_bytes() + b"\0")
    return digest.hexdigest()


def vllm_files() -> list[tuple[str, int, int]]:
    """(path, size, mtime_ns) of the file of every loaded vllm module, sorted."""
    found: dict[str, tuple[str, int, int]] = {}
    for name, module in list(sys.modules.items()):
        if name != "vllm" and not name.startswith("vllm."):
            continue
        path = getattr(module, "__file__", None)
        if not isinstance(path, str) or path in found:
            continue  # a namespace package has no file of its own
        st = os.stat(path)  # a module file that cannot be stat'ed: nothing is written
        found[path] = (path, st.st_size, st.st_mtime_ns)
    return sorted(found.values())
