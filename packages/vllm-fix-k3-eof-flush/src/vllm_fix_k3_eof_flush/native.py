"""The native carry: ``KimiK3Parser.parse_delta`` releases the held-back tail at end of stream.

One file, ``vllm/parser/kimi_k3.py``:

* ``KimiK3Parser.parse_delta`` keeps vLLM's body under the private name
  ``_parse_delta_holding_tail``; a new ``parse_delta`` with the same signature calls it and, on
  the final delta (``finished``), hands the delta to ``_release_held_tail``;
* before ``class KimiK3Parser``, two module-level helpers: ``_k3_held_tail`` (what a readiness
  helper holds back only because it might begin a marker: ask it again with one character no
  marker contains appended, and compare) and ``_release_held_tail`` (once per stream, the tail
  of the channel that was active: reasoning while the think channel is open, dropped when
  ``include_reasoning`` is off; else content, from the reasoning parser or the K3 tool
  parser; confirmed against the non-streaming helper where there is one).

The tree is recognised by the runtime patch's own structural checks (``patch.recognize``),
read from the tree's source: the classes, the DelegatingParser base, parse_delta's signature,
the readiness helpers (``patch.REASONING_HELPERS`` / ``TOOL_HELPERS``) and StreamState's fields.
"""

from __future__ import annotations

import ast

import libcst as cst

from vllm_fix_core import cst as c
from vllm_fix_core.native import CannotCarry, NativeEdit, SourceTree, marker
from vllm_fix_k3_eof_flush.patch import (
    ABSTRACT_MODULE,
    K3_MODULE,
    REASONING_HELPERS,
    REASONING_MODULE,
    STATE_FIELDS,
    TOOL_HELPERS,
    TOOL_MODULE,
)
from vllm_fix_k3_eof_flush.rule import MAX_TAIL, SEP

PR = 60642
QUALNAME = "KimiK3Parser.parse_delta"
HOLDING = "_parse_delta_holding_tail"
MARK_HELPERS = marker("k3-eof-flush", PR, "what the K3 parsers still hold back when the stream ends")
MARK_METHOD = marker("k3-eof-flush", PR, "release the held-back tail on the final delta")

HELPERS = f'''
def _k3_held_tail(ready: Any, text: str, whole: str | None = None) -> str:
    """What the readiness helper ``ready(text) -> sendable prefix`` holds back at the end of
    ``text`` only because it might begin a marker ("" if nothing). A NUL, which no marker
    contains, ends any marker prefix without completing one. ``whole``: the non-streaming
    helper's result for the same text; the tail is released only if sent + tail equals it."""
    sent = ready(text)
    final = ready(text + "\\x00")
    if not final.endswith("\\x00") or not final[:-1].startswith(sent):
        return ""
    tail = final[len(sent) : -1]
    if whole is not None and whole != sent + tail:
        return ""
    # A held tail is a proper prefix of one marker: short, never a complete separator.
    return tail if len(tail) < {MAX_TAIL} and "{SEP}" not in tail else ""


def _release_held_tail(
    parser: KimiK3Parser,
    delta_message: DeltaMessage | None,
    request: ChatCompletionRequest | ResponsesRequest,
) -> DeltaMessage | None:
    """The final delta of a stream, with the text the K3 parsers still hold back (once)."""
    from vllm.tool_parsers.kimi_k3_tool_parser import KimiK3ToolParser

    if getattr(parser, "_held_tail_released", False) or getattr(parser, "_engine_based", False):
        return delta_message
    parser._held_tail_released = True
    state = parser._stream_state
    rp, tp = parser._reasoning_parser, parser._tool_parser
    text = state.previous_text
    reasoning = content = ""
    if rp is not None and not state.reasoning_ended:
        # Still inside the think channel.
        if (
            isinstance(rp, KimiK3ReasoningParser)
            and rp._thinking_enabled
            and not rp._think_close_re.search(text)
        ):
            whole = rp.extract_reasoning(text, request)[0] or ""
            if not whole and not rp._think_open_re.search(text) and not rp._response_open_re.search(text):
                # The think opener was the generation prefix: confirm with it written out.
                whole = rp.extract_reasoning(rp._think_open + text, request)[0] or ""
            reasoning = _k3_held_tail(rp._reasoning_text_ready_to_emit, text, whole)
    elif tp is None:
        if isinstance(rp, KimiK3ReasoningParser):
            whole = rp._content_after_reasoning(text, request) or ""
            content = _k3_held_tail(rp._content_ready_to_emit, text, whole)
    elif isinstance(tp, KimiK3ToolParser) and state.tool_call_text_started:
        # Stateful: it remembers what it sent, and is not called again after this.
        chunk = tp._extract_response_content(text + "\\x00") or ""
        tail = chunk[:-1] if chunk.endswith("\\x00") else ""
        content = tail if len(tail) < {MAX_TAIL} and "{SEP}" not in tail else ""
        tp._sent_content_idx = min(tp._sent_content_idx, len(text))
    if not getattr(request, "include_reasoning", True):
        reasoning = ""
    if not reasoning and not content:
        return delta_message
    if delta_message is None:
        delta_message = DeltaMessage()
    if reasoning:
        delta_message.reasoning = (delta_message.reasoning or "") + reasoning
    if content:
        delta_message.content = (delta_message.content or "") + content
    return delta_message
'''


def _class(source: str, name: str, where: str) -> ast.ClassDef:
    node = c.ast_of(source, name)
    if not isinstance(node, ast.ClassDef):
        raise CannotCarry(f"{name} in {where} is not a class")
    return node


def _engine_based(node: ast.ClassDef) -> bool:
    for stmt in node.body:
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [getattr(stmt, "target", None)]
        value = getattr(stmt, "value", None)
        if any(isinstance(t, ast.Name) and t.id == "engine_based_streaming" for t in targets):
            return not (isinstance(value, ast.Constant) and value.value is False)
    return False


def recognize(tree: SourceTree) -> None:
    """CannotCarry where the runtime fix's recognize would refuse the tree (its checks, read
    from the source)."""
    k3 = tree.read(K3_MODULE)
    parser = _class(k3, "KimiK3Parser", K3_MODULE)
    reasoning = _class(tree.read(REASONING_MODULE), "KimiK3ReasoningParser", REASONING_MODULE)
    tool = _class(tree.read(TOOL_MODULE), "KimiK3ToolParser", TOOL_MODULE)
    if "DelegatingParser" not in {getattr(b, "id", getattr(b, "attr", "")) for b in parser.bases}:
        raise CannotCarry("KimiK3Parser is no longer a DelegatingParser (parser engine: standing down)")
    for cls in (reasoning, tool):
        if _engine_based(cls):
            raise CannotCarry(f"{cls.name}.engine_based_streaming is on (parser engine: standing down)")
    method = c.ast_of(k3, QUALNAME)
    assert not isinstance(method, ast.ClassDef)
    kwonly = [a.arg for a in method.args.kwonlyargs]
    names = [a.arg for a in (*method.args.posonlyargs, *method.args.args)]
    if "finished" not in kwonly or "request" not in names + kwonly:
        raise CannotCarry(f"unexpected signature KimiK3Parser.parse_delta{tuple(names + kwonly)}")
    missing = [n for n in REASONING_HELPERS if n not in c.class_names_defined(reasoning)]
    missing += [n for n in TOOL_HELPERS if n not in c.class_names_defined(tool)]
    if missing:
        raise CannotCarry("readiness helpers missing: " + ", ".join(missing))
    module = c.module_names(k3)
    for name in ("DeltaMessage", "KimiK3ReasoningParser"):
        if name not in module:
            raise CannotCarry(f"{K3_MODULE} no longer imports {name}")
    if HOLDING in c.class_names_defined(parser) or "_release_held_tail" in module:
        raise CannotCarry(f"{tree.relpath(K3_MODULE)} already has {HOLDING} / _release_held_tail")
    state = _class(tree.read(ABSTRACT_MODULE), "StreamState", ABSTRACT_MODULE)
    if any(f not in c.class_names_defined(state) for f in STATE_FIELDS):
        raise CannotCarry("StreamState lost reasoning_ended / previous_text / tool_call_text_started")


def _split(func: cst.FunctionDef) -> list[cst.BaseStatement]:
    """vLLM's parse_delta under a private name, then parse_delta releasing the tail."""
    holding = func.with_changes(name=cst.Name(HOLDING))
    call = c.forwarding_call(func, f"self.{HOLDING}")
    args = call[len(f"self.{HOLDING}(") : -1].split(", ")
    call = f"self.{HOLDING}(\n" + "".join(f"    {a},\n" for a in args) + ")"
    body = c.statements(
        "delta_message = "
        + call
        + """
        if finished:
            try:
                delta_message = _release_held_tail(self, delta_message, request)
            except Exception:
                # Never harm the stream: the final delta goes out as vLLM made it.
                logging.getLogger(__name__).exception("held-back tail not released")
        return delta_message
        """.replace("\n        ", "\n")
    )
    fixed = c.with_body(func, body).with_changes(
        leading_lines=[cst.EmptyLine(indent=False), c.comment_line(MARK_METHOD)]
    )
    return [holding, fixed]


def _logging_import(source: str) -> str:
    """``import logging`` first among the module's imports, unless it has it."""
    if "logging" in c.module_names(source):
        return source
    module = c.parse(source)
    for i, stmt in enumerate(module.body):
        if isinstance(stmt, cst.SimpleStatementLine) and isinstance(
            stmt.body[0], (cst.Import, cst.ImportFrom)
        ):
            first = stmt.body[0]
            if (
                isinstance(first, cst.ImportFrom)
                and first.module is not None
                and c.dotted(first.module) == "__future__"
            ):
                continue
            # It takes the blank lines above the import it goes before, which follows it directly.
            new = cst.parse_statement("import logging\n").with_changes(leading_lines=stmt.leading_lines)
            moved = stmt.with_changes(leading_lines=[])
            return module.with_changes(body=[*module.body[:i], new, moved, *module.body[i + 1 :]]).code
    raise CannotCarry(f"{K3_MODULE} has no import to put 'import logging' before")


def _typing_import(source: str) -> str:
    """``Any`` added to the module's ``from typing import ...`` (the helpers annotate with it)."""
    if "Any" in c.module_names(source):
        return source
    module = c.parse(source)
    for i, stmt in enumerate(module.body):
        if isinstance(stmt, cst.SimpleStatementLine) and isinstance(stmt.body[0], cst.ImportFrom):
            imp = stmt.body[0]
            if imp.module is not None and c.dotted(imp.module) == "typing":
                if isinstance(imp.names, cst.ImportStar):
                    return source
                names = [*imp.names, cst.ImportAlias(cst.Name("Any"))]
                names = [n.with_changes(comma=cst.MaybeSentinel.DEFAULT) for n in names]
                new = stmt.with_changes(body=[imp.with_changes(names=names)])
                return module.with_changes(body=[*module.body[:i], new, *module.body[i + 1 :]]).code
    raise CannotCarry(f"{K3_MODULE} has no 'from typing import' to add Any to")


def transform(tree: SourceTree) -> list[NativeEdit]:
    recognize(tree)

    def change(text: str) -> str:
        text = _logging_import(_typing_import(text))
        text = c.replace_function(text, QUALNAME, _split)
        return c.add_before(text, "KimiK3Parser", HELPERS, MARK_HELPERS)

    return [tree.edit(K3_MODULE, change)]


__all__ = ["recognize", "transform"]
