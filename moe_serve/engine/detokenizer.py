"""Incremental detokenizing with stop strings: O(1) work per token (the `tokenizers` streaming decoder),
and a stop-string search over only the text a new token could have completed, so a stop string spanning
several tokens is found as soon as its last character arrives.

While a sequence runs, the text that a stop string might still claim (its longest prefix that could be
starting) is held back from streaming: `stable_text_length()`.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from moe_serve.tokenizer import Tokenizer

PRIME_TOKENS = 8  # prompt tokens that give the decoder its context (leading spaces, merged bytes)


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: list[str],
        include_stop: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._stream = DecodeStream(ids=prompt_token_ids[-PRIME_TOKENS:], skip_special_tokens=skip_special_tokens)
        self.stop = stop
        self._include_stop = include_stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""

    def add(self, token_id: int) -> str | None:
        """Append a token's text; returns the stop string it completed (the text is then cut before it, or
        after it with include_stop)."""
        try:
            piece = self._stream.step(self._tokenizer.hf, token_id)
        except Exception:  # the decoder lost its place (an unusual token sequence): restart it unprimed
            self._stream = DecodeStream(skip_special_tokens=self._skip)
            piece = self._stream.step(self._tokenizer.hf, token_id)
        if not piece:
            return None
        searched_from = max(0, len(self.text) - self._hold)
        self.text += piece
        found = [(at, stop) for stop in self.stop if (at := self.text.find(stop, searched_from)) >= 0]
        if not found:
            return None
        at, stop = min(found)  # the earliest match wins
        self.text = self.text[: at + len(stop) if self._include_stop else at]
        return stop

    def stable_text_length(self) -> int:
        """How much of the text no later token can change (a stop string could still cut the rest)."""
        return max(0, len(self.text) - self._hold)
