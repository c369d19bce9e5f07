"""The one declaration of this fix: runtime, tests, CLI and docs read it."""

from vllm_fix_core import Fix, Links, ProcessKind, Target, Upstream, UpstreamStatus
from vllm_fix_core.native import NativeEdit, SourceTree

MODULE = "vllm.parser.kimi_k3"


def _links() -> Links:
    from vllm_fix_k3_eof_flush import patch, probe

    return Links(probe.probe, patch.recognize, patch.apply)


def _native(tree: SourceTree) -> list[NativeEdit]:
    from vllm_fix_k3_eof_flush import native

    return native.transform(tree)


FIX = Fix(
    id="k3-eof-flush",
    title="Kimi K3 streaming releases held-back text at end of stream",
    distribution="vllm-fix-k3-eof-flush",
    upstream=(
        Upstream(
            60642,
            UpstreamStatus.PENDING,
            note="overlaps the parser-engine migration (#50229): once Kimi K3 runs on the parser "
            "engine, its generic end-of-stream flush owns this and the fix stands down",
        ),
    ),
    why=(
        "With stream=true (Chat Completions and Responses), the Kimi K3 parsers hold back text "
        "that could be the start of an XTML marker (`<`, `<|`, `<|clo`, ...) until the next "
        "delta shows whether it is one. When the output ends right there (length limit, stop "
        "string, EOS) nothing releases it: the reply loses its last characters, and a reply "
        "made only of such a prefix streams no content at all. Non-streaming returns the text. "
        "Every vLLM release with the K3 parsers (0.27.1 through 0.33.0) is affected; 0.26.0 and "
        "earlier have no K3 parser (not applicable)."
    ),
    how=(
        "Wrap KimiK3Parser.parse_delta, the single streaming entry of the K3 parsers. Deltas "
        "with finished=False are delegated untouched. On the final delta (after vLLM has "
        "processed it) the wrapper asks the parser's own readiness helpers what they would "
        "release if the input had ended, and emits that tail exactly once in the channel that "
        "was active: reasoning while the think channel is open (dropped when include_reasoning "
        "is off), otherwise content, unwrapped as the non-streaming path does. Complete markers, "
        "text already sent and unclosed tool calls are never emitted."
    ),
    retire_when=(
        "Upstream releases the held-back tail itself (the probe then reports 'fixed upstream' "
        "and nothing is patched), or Kimi K3 moves to vLLM's parser engine (#50229), whose "
        "finish_streaming flush owns the end of stream (recognize() then refuses). Drop the "
        "package once every supported vLLM release is one of those."
    ),
    targets=(Target(MODULE, "KimiK3Parser.parse_delta", ProcessKind.API_SERVER),),
    links=_links,
    native=_native,
)
