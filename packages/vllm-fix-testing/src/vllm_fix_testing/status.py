"""MORI transfer statuses: the four methods vLLM's MoRIIO code calls on them."""

from __future__ import annotations

import threading
from collections.abc import Iterable

PENDING = "pending"
SUCCEEDED = "succeeded"
FAILED = "failed"
_STATES = (PENDING, SUCCEEDED, FAILED)


class FakeStatus:
    """One transfer status.

    A plain status keeps its state until :meth:`succeed` / :meth:`fail` is called (the
    way a completion lands while the engine thread polls). A *scripted* status
    takes the k-th entry of ``script`` at its k-th call to ``Failed()`` (the first
    question vLLM's ``poll_transfer_batch`` asks of a status; ``Succeeded()`` answers for
    the same observation), so a test can make a status change between two polls, or
    between two lock acquisitions of a racy wrapper. The last script entry sticks.
    """

    def __init__(
        self,
        state: str = PENDING,
        *,
        message: str = "",
        code: int = 0,
        script: Iterable[str] = (),
    ) -> None:
        self._lock = threading.Lock()
        self._script = [_check(s) for s in script]
        self._state = _check(self._script.pop(0) if self._script else state)
        self._message = message or ("injected failure" if self._state == FAILED else "")
        self._code = code or (-1 if self._state == FAILED else 0)
        self.observations = 0

    @property
    def state(self) -> str:
        return self._state

    def succeed(self) -> None:
        with self._lock:
            self._state = SUCCEEDED

    def fail(self, message: str = "injected failure", code: int = -1) -> None:
        with self._lock:
            self._state, self._message, self._code = FAILED, message, code

    # The MORI TransferStatus interface (names as the native binding spells them).
    def Failed(self) -> bool:
        with self._lock:
            if self.observations and self._script:
                self._state = self._script.pop(0)
                if self._state == FAILED and not self._message:
                    self._message, self._code = "injected failure", -1
            self.observations += 1
            return self._state == FAILED

    def Succeeded(self) -> bool:
        with self._lock:
            return self._state == SUCCEEDED

    def InProgress(self) -> bool:
        with self._lock:
            return self._state == PENDING

    def Message(self) -> str:
        return self._message

    def Code(self) -> int:
        return self._code

    def __repr__(self) -> str:
        return f"FakeStatus({self._state!r})"


def _check(state: str) -> str:
    if state not in _STATES:
        raise ValueError(f"unknown transfer state {state!r}; expected one of {_STATES}")
    return state


def pending() -> FakeStatus:
    return FakeStatus(PENDING)


def done() -> FakeStatus:
    return FakeStatus(SUCCEEDED)


def failed(message: str = "injected failure", code: int = -1) -> FakeStatus:
    return FakeStatus(FAILED, message=message, code=code)
