"""Test support for the vllm-fixes packages (test extra only; never in a runtime install).

* :mod:`vllm_fix_testing.real`: real vLLM objects built on CPU (a Scheduler with a real KV
  connector, a real Request, a tiny model config), ``applied(fix)``, ``vllm_version()``;
* the MORI stand-in below.

A stand-in for the native MORI engine, for tests of MoRIIO fixes on real vLLM.

This machine has no RDMA NIC and no ``mori`` package, so the pieces of MoRIIO that
talk to the engine are replaced here, and only those:

* :class:`FakeStatus`: a transfer status (``Succeeded`` / ``Failed`` / ``Message`` /
  ``Code``), settable or scripted to change while it is being polled;
* :class:`FakeEngine` / :class:`FakeSession` / :class:`FakeMemoryDesc`: what vLLM's real
  ``MoRIIOWrapper`` calls on ``mori.io`` objects (``register_torch_tensor``,
  ``create_session``, ``batch_read``, ``allocate_transfer_uid``), recording every call;
* :class:`FakeWrapper`: a ``MoRIIOWrapper`` stand-in for worker tests, with a real lock,
  vLLM's **real** ``poll_transfer_batch`` and a ``send_notify`` that records instead of
  opening ZMQ sockets.

Test support only: not a fix, no entry points. vLLM is imported lazily (only when a
real vLLM method is needed), so importing this package is cheap.
"""

from vllm_fix_testing import kv_storage, mori_io
from vllm_fix_testing.__about__ import __version__
from vllm_fix_testing.engine import (
    FakeEngine,
    FakeMemoryDesc,
    FakeSession,
    FakeWrapper,
    Notify,
    ReadCall,
)
from vllm_fix_testing.hostile import (
    assert_every_target_observed,
    assert_hostile_wrapper_fails,
    assert_verification_fails,
    hostile_decision,
)
from vllm_fix_testing.real import (
    MORIIO_EXTRA_CONFIG,
    STRICT,
    TINY_MODEL_CONFIG,
    applied,
    real_request,
    real_scheduler,
    tiny_model_dir,
    vllm_version,
)
from vllm_fix_testing.status import FAILED, PENDING, SUCCEEDED, FakeStatus, done, failed, pending

__all__ = [
    "FAILED",
    "MORIIO_EXTRA_CONFIG",
    "PENDING",
    "STRICT",
    "SUCCEEDED",
    "TINY_MODEL_CONFIG",
    "FakeEngine",
    "FakeMemoryDesc",
    "FakeSession",
    "FakeStatus",
    "FakeWrapper",
    "Notify",
    "ReadCall",
    "__version__",
    "applied",
    "assert_every_target_observed",
    "assert_hostile_wrapper_fails",
    "assert_verification_fails",
    "done",
    "failed",
    "hostile_decision",
    "kv_storage",
    "mori_io",
    "pending",
    "real_request",
    "real_scheduler",
    "tiny_model_dir",
    "vllm_version",
]
