"""Apply: a wrapper around KimiK3Parser.parse_delta that releases the held-back tail at EOF.

Per delta with ``finished=False`` it only delegates: for the fingerprinted K3 shape
(vLLM 0.27.1-0.33.0, two shapes) a plain delegating function takes parse_delta's place (vLLM's
body still runs, unchanged); for any other recognizable shape a wrapt wrapper does the
same, slower.
With ``finished=True`` it lets vLLM process the final delta first, then asks
the parser's own readiness helpers (``rule.held_tail`` / ``rule.next_chunk_tail``)
what they still hold only because it might begin a marker, and appends that
once, in the channel that was active:

* think channel still open: the reasoning parser's ``_reasoning_text_ready_to_emit``
  over the accumulated think text, confirmed by its non-streaming
  ``extract_reasoning`` -> ``reasoning`` (dropped when ``include_reasoning`` is
  off, as vLLM drops every reasoning delta then);
* content phase, no tool parser: the reasoning parser's ``_content_ready_to_emit``
  (what ``strip_content_streaming`` uses), confirmed by the non-streaming
  ``_content_after_reasoning`` (so residue after a closed response channel,
  which non-streaming drops, is not released) -> ``content``;
* content phase with the K3 tool parser: its ``_extract_response_content`` (which
  stops at response-close / tools-open and remembers what it sent) -> ``content``.
  Tool calls are never flushed: K3 emits a call only once ``<|close|>call<|sep|>``
  arrived, and an unclosed call is dropped by the non-streaming path too.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import weakref
from typing import Any

from vllm_fix_core import PatchSet, UnknownShape, ast_fingerprint, get_logger, original_of
from vllm_fix_k3_eof_flush.rule import held_tail, next_chunk_tail

K3_MODULE = "vllm.parser.kimi_k3"
REASONING_MODULE = "vllm.reasoning.kimi_k3_reasoning_parser"
TOOL_MODULE = "vllm.tool_parsers.kimi_k3_tool_parser"
ABSTRACT_MODULE = "vllm.parser.abstract_parser"

REASONING_HELPERS = (
    "_reasoning_text_ready_to_emit",
    "_content_ready_to_emit",
    "extract_reasoning",
    "_content_after_reasoning",
)
TOOL_HELPERS = ("_extract_response_content",)
STATE_FIELDS = ("reasoning_ended", "previous_text", "tool_call_text_started")

# Combined normalized-AST fingerprint (vllm_fix_core.ast_fingerprint) of
# KimiK3Parser.parse_delta and the helpers this fix calls. vllm/parser/kimi_k3.py
# exists from vLLM 0.27.1 (measured on the released wheels; 0.26.0 and earlier lack
# it). 0.27.1-0.30.0 share one shape (their extract_reasoning calls a think body
# without think markers content); 0.31.0-0.33.0 share the other (the reasoning
# parser byte-identical, md5 525ba10c).
KNOWN_SHAPES = {
    "a761447f04411305": "kimi-k3-0.27-0.30",
    "b8135fb939fea2d9": "kimi-k3-0.31-0.33",
}

_logger = get_logger("k3-eof-flush")
# Parsers (one per stream) whose end of stream was already flushed: exactly once.
_flushed: weakref.WeakSet[Any] = weakref.WeakSet()
_MARK = "_vllm_fix_k3_eof_flushed"


def _modules() -> tuple[Any, Any, Any, Any]:
    return (
        importlib.import_module(K3_MODULE),
        importlib.import_module(REASONING_MODULE),
        importlib.import_module(TOOL_MODULE),
        importlib.import_module(ABSTRACT_MODULE),
    )


def _standing_down(why: str) -> UnknownShape:
    return UnknownShape(
        f"{why}; Kimi K3 looks like it moved to vLLM's parser engine (#50229), whose own "
        "end-of-stream flush (finish_streaming) owns this: standing down"
    )


def shape_fingerprint() -> str:
    k3, rmod, tmod, _ = _modules()
    funcs = [
        k3.KimiK3Parser.__dict__["parse_delta"],
        *(rmod.KimiK3ReasoningParser.__dict__[n] for n in REASONING_HELPERS),
        *(tmod.KimiK3ToolParser.__dict__[n] for n in TOOL_HELPERS),
    ]
    joined = "".join(ast_fingerprint(f) for f in funcs)
    return hashlib.sha256(joined.encode()).hexdigest()[:16]


def recognize() -> str:
    """The known shape, or UnknownShape (with the reason) when this fix must not attach."""
    try:
        k3, rmod, tmod, amod = _modules()
    except ImportError as exc:
        raise UnknownShape(f"a Kimi K3 parser module does not import: {exc}") from exc
    parser_cls = getattr(k3, "KimiK3Parser", None)
    delegating = getattr(amod, "DelegatingParser", None)
    rp_cls = getattr(rmod, "KimiK3ReasoningParser", None)
    tp_cls = getattr(tmod, "KimiK3ToolParser", None)
    if parser_cls is None or rp_cls is None or tp_cls is None or delegating is None:
        raise UnknownShape("KimiK3Parser / KimiK3ReasoningParser / KimiK3ToolParser not found")
    if not (isinstance(parser_cls, type) and issubclass(parser_cls, delegating)):
        raise _standing_down("KimiK3Parser is no longer a DelegatingParser")
    for cls in (rp_cls, tp_cls):
        if getattr(cls, "engine_based_streaming", False) is not False:
            raise _standing_down(f"{cls.__name__}.engine_based_streaming is on")
    if "parse_delta" not in parser_cls.__dict__:
        raise UnknownShape("KimiK3Parser no longer defines parse_delta (the streaming entry) itself")
    params = inspect.signature(parser_cls.__dict__["parse_delta"]).parameters
    finished = params.get("finished")
    if finished is None or finished.kind is not inspect.Parameter.KEYWORD_ONLY or "request" not in params:
        raise UnknownShape(f"unexpected signature KimiK3Parser.parse_delta{tuple(params)}")
    missing = [n for n in REASONING_HELPERS if not callable(rp_cls.__dict__.get(n))]
    missing += [n for n in TOOL_HELPERS if not callable(tp_cls.__dict__.get(n))]
    if missing:
        raise _standing_down("readiness helpers missing: " + ", ".join(missing))
    if not isinstance(getattr(k3, "DeltaMessage", None), type):
        raise UnknownShape("vllm.parser.kimi_k3 no longer imports DeltaMessage")
    state_fields = getattr(getattr(amod, "StreamState", None), "__dataclass_fields__", {})
    if any(f not in state_fields for f in STATE_FIELDS):
        raise UnknownShape("StreamState lost reasoning_ended / previous_text / tool_call_text_started")
    return KNOWN_SHAPES.get(shape_fingerprint(), "structural")


def _tails(parser: Any, request: Any) -> tuple[str, str]:
    """(reasoning tail, content tail) held back at the end of this parser's stream."""
    _, rmod, tmod, _ = _modules()
    if getattr(parser, "_engine_based", False):
        return "", ""  # an engine-based composition flushes itself
    state = parser._stream_state
    rp, tp = parser._reasoning_parser, parser._tool_parser
    text = state.previous_text
    if rp is not None and not state.reasoning_ended:
        # Still inside the think channel.
        if (
            isinstance(rp, rmod.KimiK3ReasoningParser)
            and rp._thinking_enabled
            and not rp._think_close_re.search(text)
        ):
            whole = rp.extract_reasoning(text, request)[0] or ""
            if not whole and not rp._think_open_re.search(text) and not rp._response_open_re.search(text):
                # vLLM 0.27-0.30: non-streaming calls a think body without any think marker
                # (the opener was the generation prefix) content, while streaming sends it as
                # reasoning (0.31 made non-streaming agree). Confirm against the same helper
                # with the consumed generation prefix written out.
                whole = rp.extract_reasoning(rp._think_open + text, request)[0] or ""
            return held_tail(rp._reasoning_text_ready_to_emit, text, whole), ""
        return "", ""
    if tp is None:
        if isinstance(rp, rmod.KimiK3ReasoningParser):
            whole = rp._content_after_reasoning(text, request) or ""
            return "", held_tail(rp._content_ready_to_emit, text, whole)
        return "", ""
    if isinstance(tp, tmod.KimiK3ToolParser) and state.tool_call_text_started:
        tail = next_chunk_tail(tp._extract_response_content, text)
        tp._sent_content_idx = min(tp._sent_content_idx, len(text))
        return "", tail
    return "", ""


def _already_flushed(parser: Any) -> bool:
    """True if this stream's tail was released before; marks it released otherwise."""
    try:
        if parser in _flushed:
            return True
        _flushed.add(parser)
    except TypeError:  # an unhashable parser subclass: keep the mark on the instance
        if getattr(parser, _MARK, False):
            return True
        setattr(parser, _MARK, True)
    return False


def _finish(delta: Any, parser: Any, request: Any) -> Any:
    """The final delta of a stream, with the held-back tail appended (once)."""
    if parser is None or _already_flushed(parser):
        return delta
    try:
        reasoning, content = _tails(parser, request)
    except Exception:  # never harm the stream: the final delta goes out as vLLM made it
        _logger.exception("k3-eof-flush: could not compute the end-of-stream tail; not released")
        return delta
    if reasoning and not getattr(request, "include_reasoning", True):
        reasoning = ""
    if not reasoning and not content:
        return delta
    if delta is None:
        k3 = importlib.import_module(K3_MODULE)
        delta = k3.DeltaMessage()
    if reasoning:
        delta.reasoning = (delta.reasoning or "") + reasoning
    if content:
        delta.content = (delta.content or "") + content
    return delta


def _parse_delta(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """wrapt wrapper (any recognizable shape): delegate, then flush on the final delta."""
    if not kwargs.get("finished"):
        return wrapped(*args, **kwargs)
    request = kwargs["request"] if "request" in kwargs else (args[2] if len(args) > 2 else None)
    return _finish(wrapped(*args, **kwargs), instance, request)


def _delegate(original: Any) -> Any:
    """A plain function in place of parse_delta for the fingerprinted shape only.

    It keeps vLLM's body (it calls `original`, the installed vLLM function) and adds
    one comparison per delta. A wrapt wrapper costs ~1.4 us per call on this
    path (wrapt binds a Python-level BoundFunctionWrapper on every attribute
    access), 7-9 % of a K3 streaming step; this costs a plain call.
    """

    def parse_delta(
        self: Any,
        delta_text: str,
        delta_token_ids: list[int],
        request: Any,
        prompt_token_ids: list[int] | None = None,
        *,
        finished: bool,
    ) -> Any:
        delta = original(self, delta_text, delta_token_ids, request, prompt_token_ids, finished=finished)
        if not finished:
            return delta
        return _finish(delta, self, request)

    return functools.update_wrapper(parse_delta, original)


def apply(patch: PatchSet, shape: str) -> None:
    k3 = importlib.import_module(K3_MODULE)
    if shape in KNOWN_SHAPES.values():
        # Exactly fingerprinted: the signature above is parse_delta's own.
        patch.replace(k3.KimiK3Parser, "parse_delta", _delegate(original_of(k3.KimiK3Parser, "parse_delta")))
    else:
        patch.wrap(k3.KimiK3Parser, "parse_delta", _parse_delta)
