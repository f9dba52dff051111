"""Tokenizer wrapper over Hugging Face `tokenizers` (tokenizer.json), plus the byte-level tokenizer used
by the demo models: one token per UTF-8 byte (ids 0..255) and an end-of-text token (id 256)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

END_OF_TEXT = "<|endoftext|>"


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (what ByteLevel pre-tokenizers emit)."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def byte_level_tokenizer() -> HFTokenizer:
    """Token id b encodes byte b; id 256 is <|endoftext|> (used as BOS and EOS)."""
    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    vocab[END_OF_TEXT] = 256
    tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([END_OF_TEXT])
    return tokenizer


class Tokenizer:
    """encode/decode without special tokens added implicitly; the engine adds BOS where the model wants it.

    A user's text never turns into special tokens: typing "<|endoftext|>" gives its characters' tokens
    (`encode`). Only text a chat template rendered is read with its special tokens (`encode_rendered`)."""

    def __init__(self, tokenizer: HFTokenizer) -> None:
        self._tokenizer = tokenizer
        self._literal = HFTokenizer.from_str(tokenizer.to_str())  # a copy: the flag is per object
        self._literal.encode_special_tokens = True
        self._max_token_chars: int | None = None

    @property
    def hf(self) -> HFTokenizer:
        """The underlying `tokenizers` object (for its streaming decoder)."""
        return self._tokenizer

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        return cls(HFTokenizer.from_file(str(path)))

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """A user's text: special-token strings in it stay plain text."""
        return self.encode_many([text])[0]

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        """User texts, each as `encode` would. Every encoding here goes through `encode_batch`, one text or
        many, because it tokenizes with the GIL released and `encode` holds it for the whole text: a serving
        thread tokenizing while holding the GIL stalls the engine thread at every tensor op, each of which
        gives the GIL up and must win it back (measured on this 2-core machine: a 2 ms step of 20 ops took
        180 ms beside a thread looping over `encode`, 6 ms beside one looping over `encode_batch`)."""
        return [encoding.ids for encoding in self._literal.encode_batch(texts, add_special_tokens=False)]

    def encode_rendered(self, text: str) -> list[int]:
        """Text a chat template rendered: its special-token strings are the special tokens."""
        return self._tokenizer.encode_batch([text], add_special_tokens=False)[0].ids

    @property
    def max_token_chars(self) -> int:
        """The most characters one (non-special) token decodes to: a text longer than this times a context
        can never fit it, and is refused before it is tokenized."""
        if self._max_token_chars is None:
            special = {t.content for t in self._tokenizer.get_added_tokens_decoder().values() if t.special}
            vocab = self._tokenizer.get_vocab(with_added_tokens=True)
            lengths = [
                len(self._tokenizer.decode([i], skip_special_tokens=False))
                for s, i in vocab.items()
                if s not in special
            ]
            self._max_token_chars = max(lengths, default=1) or 1
        return self._max_token_chars

    def encode_with_special_tokens(self, text: str) -> list[int]:
        """As the source tokenizer would (its post-processor may add BOS/EOS); used by exporters."""
        return self._tokenizer.encode(text, add_special_tokens=True).ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def id_to_token(self, token_id: int) -> str:
        """The token's string form, special tokens included (chat templates need BOS/EOS as text)."""
        return self._tokenizer.id_to_token(token_id) or ""

    def save(self, path: str | Path) -> None:
        self._tokenizer.save(str(path))
