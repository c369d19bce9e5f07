"""The fix's own rule, importable without vLLM.

At end of stream no further input can complete a marker, so whatever a K3
readiness helper holds back *only* because it might be the start of a marker
must be released. The helpers decide "might be the start of a marker" by
looking at the end of the accumulated text. Appending one character that no
K3 marker contains (``TERMINATOR``) turns that suffix into something that can
no longer begin a marker, without completing any marker or changing anything
before it; removing the terminator again gives exactly what the helper would
release if the input had ended. We never re-implement the marker tables.

Where vLLM has a non-streaming helper for the same channel, the tail is also
confirmed against it: released only if what was streamed plus the tail is
exactly the non-streaming result.

Safety net (cheap, once per stream): a released tail is always a proper prefix
of one marker, so it is shorter than ``MAX_TAIL`` characters and never holds a
complete ``<|sep|>``. Anything else means the helper did something this rule
does not know, and nothing is released.
"""

from __future__ import annotations

from collections.abc import Callable

# NUL: no K3 XTML marker contains it, and it is neither whitespace nor a word
# character, so the helpers' tolerant regexes (`\s*`, `\w+`) cannot absorb it.
TERMINATOR = "\x00"
# The XTML separator that ends every complete marker.
SEP = "<|sep|>"
# Longer than the longest K3 marker a helper can hold back a prefix of
# ("<|close|>response<|sep|>" is 24 characters).
MAX_TAIL = 64


def _plausible(tail: str) -> bool:
    return 0 < len(tail) < MAX_TAIL and SEP not in tail


def held_tail(ready: Callable[[str], str], text: str, whole: str | None = None) -> str:
    """What the pure helper `ready(text) -> sendable prefix` holds back at the
    end of `text` only because it might start a marker ("" if nothing).

    `whole`, when given, is what the non-streaming path returns for the same
    text and channel; the tail is released only if what was sent plus the tail
    is exactly that (so the flush never adds text non-streaming would drop).
    """
    sent = ready(text)
    final = ready(text + TERMINATOR)
    if not final.endswith(TERMINATOR):
        return ""
    final = final[: -len(TERMINATOR)]
    if len(final) <= len(sent) or not final.startswith(sent):
        return ""
    tail = final[len(sent) :]
    if whole is not None and whole != sent + tail:
        return ""
    return tail if _plausible(tail) else ""


def next_chunk_tail(emit_next: Callable[[str], str | None], text: str) -> str:
    """The same for a stateful helper `emit_next(text) -> new chunk or None`
    that remembers what it already sent (and is never called again after this)."""
    chunk = emit_next(text + TERMINATOR)
    if not chunk or not chunk.endswith(TERMINATOR):
        return ""
    tail = chunk[: -len(TERMINATOR)]
    return tail if _plausible(tail) else ""
