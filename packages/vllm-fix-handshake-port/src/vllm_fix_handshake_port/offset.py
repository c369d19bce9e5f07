"""The port offset every caller reaches: ``dp * listening TP size + tp``, one injective offset.

A call that names a TP size keeps vLLM's formula (0, vLLM's "unknown", means the listening
engine's TP size, as vLLM's ``_remote_tp_rank`` assumes). A call without one uses the TP size
of the engine that listens on the port: the one a sender's wrapper set
(``rule.current_listening_tp_size``), else this engine's (a listener site). Where neither is
known, or the rank lies outside the listening engine, the call keeps vLLM's formula.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

from vllm_fix_core import get_logger
from vllm_fix_core.callsites import argument
from vllm_fix_handshake_port.listener import local_tp_size
from vllm_fix_handshake_port.rule import current_listening_tp_size

_logger = get_logger("handshake-port")
_warned = threading.Event()


def offset_wrapper_for(module: ModuleType) -> Callable[..., Any]:
    """The wrapper of `module`'s own ``get_port_offset`` reference (it reads `module`'s TP getter)."""

    def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        explicit = len(args) > 2 or "tp_size" in kwargs
        size: int | None
        if explicit:
            named = argument(args, kwargs, 2, "tp_size")
            if not isinstance(named, int) or named != 0:
                return wrapped(*args, **kwargs)  # names the listener's TP size: vLLM's formula
            # vLLM's "unknown remote TP" (0): homogeneous, as its _remote_tp_rank assumes
            size = current_listening_tp_size() or local_tp_size(module)
        else:
            size = current_listening_tp_size()
            if size is None:
                size = local_tp_size(module)  # a listener site: this engine listens
        dp, tp = argument(args, kwargs, 0, "dp_rank"), argument(args, kwargs, 1, "tp_rank")
        if size is None or not isinstance(dp, int) or not isinstance(tp, int):
            return wrapped(*args, **kwargs)
        if dp < 0 or not 0 <= tp < size:
            if not _warned.is_set():
                _warned.set()
                _logger.warning(
                    "get_port_offset(%s, %s) with a listening TP size of %s: the rank is outside "
                    "the listening engine; using vLLM's offset for it",
                    dp,
                    tp,
                    size,
                )
            return wrapped(*args, **kwargs)
        return dp * size + tp

    return wrapper
