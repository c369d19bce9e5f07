"""The probe's in-memory Kimi K3 vocabulary (no hub, no files).

`FakeK3Tokenizer` is the tiny vocabulary of the K3 markers: `<|open|>`=1, `<|close|>`=2,
`<|sep|>`=3, `<|end_of_msg|>`=4, the channel names `think`=10, `response`=11,
`message`=12, `tools`=13, every other character 1000+ord, greedy longest match. The K3
parsers need nothing more from a tokenizer (a truthy object with
`encode(text, add_special_tokens=False)`; the reasoning parser encodes its markers once,
and the reasoning/content switch compares those ids with the deltas' ids), and it costs
microseconds, so the runtime probe can build real K3 parsers in any process without a model.
"""

from __future__ import annotations

from typing import Any

OPEN, CLOSE, SEP, EOM = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"


class FakeK3Tokenizer:
    """encode() with the K3 marker vocabulary (greedy longest match)."""

    VOCAB: dict[str, int] = {  # noqa: RUF012 - read-only table
        OPEN: 1,
        CLOSE: 2,
        SEP: 3,
        EOM: 4,
        "think": 10,
        "response": 11,
        "message": 12,
        "tools": 13,
    }
    eos_token_id = 4

    def __init__(self) -> None:
        self._pieces = sorted(self.VOCAB, key=len, reverse=True)

    def __bool__(self) -> bool:
        return True

    def __len__(self) -> int:
        return 1000 + 0x110000

    def encode(self, text: str, add_special_tokens: bool = False, **_: Any) -> list[int]:
        ids: list[int] = []
        i = 0
        while i < len(text):
            for piece in self._pieces:
                if text.startswith(piece, i):
                    ids.append(self.VOCAB[piece])
                    i += len(piece)
                    break
            else:
                ids.append(1000 + ord(text[i]))
                i += 1
        return ids

    def decode(self, ids: list[int], **_: Any) -> str:
        back = {v: k for k, v in self.VOCAB.items()}
        return "".join(back.get(i) or chr(i - 1000) for i in ids)

    def get_vocab(self) -> dict[str, int]:
        return dict(self.VOCAB)
