"""A stand-in for the native MORI engine, for tests of MoRIIO fixes on real vLLM.

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

from vllm_fix_testing_mori.__about__ import __version__
from vllm_fix_testing_mori.engine import (
    FakeEngine,
    FakeMemoryDesc,
    FakeSession,
    FakeWrapper,
    Notify,
    ReadCall,
)
from vllm_fix_testing_mori.status import FAILED, PENDING, SUCCEEDED, FakeStatus, done, failed, pending

__all__ = [
    "FAILED",
    "PENDING",
    "SUCCEEDED",
    "FakeEngine",
    "FakeMemoryDesc",
    "FakeSession",
    "FakeStatus",
    "FakeWrapper",
    "Notify",
    "ReadCall",
    "__version__",
    "done",
    "failed",
    "pending",
]
