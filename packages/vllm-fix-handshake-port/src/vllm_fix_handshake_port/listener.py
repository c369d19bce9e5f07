"""The listener side: this engine's TP size where it binds its ports, and the check that its two
port blocks (``DP_local x TP`` handshake ports, as many notify ports) fit and do not overlap."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from vllm_fix_core.callsites import argument
from vllm_fix_handshake_port.rule import check_layout
from vllm_fix_handshake_port.sites import COMMON


def local_tp_size(module: ModuleType) -> int | None:
    """This engine's TP size as vLLM's from_vllm_config reads it; None where no TP group exists."""
    getter = getattr(module, "get_tensor_model_parallel_world_size", None)
    if getter is None:
        getter = getattr(importlib.import_module(COMMON), "get_tensor_model_parallel_world_size", None)
    if getter is None:
        return None
    try:
        size = int(getter())
    except Exception:  # no initialized TP group here: keep vLLM's formula
        return None
    return size if size > 0 else None


def check_config_layout(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """After from_vllm_config: the two port blocks of this host must fit and not overlap."""
    config = wrapped(*args, **kwargs)
    vllm_config = argument(args, kwargs, 0, "vllm_config")
    try:
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        notify_base = int(extra["notify_port"])
        handshake_base = int(config.handshake_port)
        dp_local = int(vllm_config.parallel_config.data_parallel_size_local or 0)
        tp_size = int(config.tp_size)
    except Exception:
        return config  # not the shape we check; vLLM's own validation applies
    check_layout(handshake_base, notify_base, dp_local, tp_size)
    return config
