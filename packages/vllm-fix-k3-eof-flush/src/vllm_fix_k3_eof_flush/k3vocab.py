"""In-memory tokenizers carrying the Kimi K3 special tokens (no hub, no files).

* `FakeK3Tokenizer`: the tiny vocabulary of the spec (§2.2): `<|open|>`=1,
  `<|close|>`=2, `<|sep|>`=3, `<|end_of_msg|>`=4, the channel names `think`=10,
  `response`=11, `message`=12, `tools`=13, every other character 1000+ord,
  greedy longest match. It is all the K3 parsers need (a truthy object with
  `encode(text, add_special_tokens=False)`), and it costs microseconds, so the
  probe uses it.
* `hf_tokenizer()`: a real `transformers.PreTrainedTokenizerFast` over a
  byte-level BPE with the K3 special tokens added (the recipe of
  vllm-on-cpu.md), built offline; the tests use it.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

OPEN, CLOSE, SEP, EOM = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
SPECIAL = (OPEN, CLOSE, SEP, EOM)


class FakeK3Tokenizer:
    """encode() with the spec's fake K3 vocabulary (greedy longest match)."""

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


@lru_cache(maxsize=1)
def hf_tokenizer() -> Any:
    """A real PreTrainedTokenizerFast whose special tokens are the K3 markers'."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: i for i, symbol in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOM)
