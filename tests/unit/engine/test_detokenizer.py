"""Incremental detokenizing: the same text as decoding all at once, UTF-8 characters split across tokens,
stop strings spanning tokens (the earliest wins), and the held-back tail while a stop could still match."""

from __future__ import annotations

from moe_serve.engine.detokenizer import IncrementalDetokenizer
from moe_serve.tokenizer import Tokenizer, byte_level_tokenizer

TOKENIZER = Tokenizer(byte_level_tokenizer())


def feed(text: str, stop: list[str], prompt: str = "Q:") -> tuple[IncrementalDetokenizer, str | None, list[int]]:
    detok = IncrementalDetokenizer(TOKENIZER, TOKENIZER.encode(prompt), stop)
    stable = []
    for token in TOKENIZER.encode(text):
        matched = detok.add(token)
        stable.append(detok.stable_text_length())
        if matched is not None:
            return detok, matched, stable
    return detok, None, stable


def test_streamed_text_equals_whole_decoding_with_split_characters() -> None:
    text = "héllo wörld ✓ — ünïcödé, and <|endoftext|> specials skipped"
    detok, matched, _ = feed(text, [])
    assert matched is None
    assert detok.text == TOKENIZER.decode(TOKENIZER.encode(text))


def test_stop_string_spanning_tokens_cuts_before_it() -> None:
    detok, matched, _ = feed("Exit, pursued by a bear. Then more.", ["a bear"])
    assert matched == "a bear" and detok.text == "Exit, pursued by "


def test_the_earliest_of_several_stop_strings_wins() -> None:
    detok, matched, _ = feed("one two three four", ["three", "two thr"])
    assert matched == "two thr" and detok.text == "one "


def test_stable_length_holds_back_what_a_stop_string_could_still_claim() -> None:
    _, matched, stable = feed("abcdefgh", ["xyz12"])
    assert matched is None
    assert stable == [max(0, n - 4) for n in range(1, 9)]  # the last len(stop) - 1 characters wait


def test_a_multibyte_character_completing_a_stop_string() -> None:
    detok, matched, _ = feed("café✓ bar", ["é✓"])
    assert matched == "é✓" and detok.text == "caf"
