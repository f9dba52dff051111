"""The tokenizer wrapper: `encode_many` (through `encode_batch`, the GIL released) gives each text the ids a
per-text `encode` gives, and a user's special-token strings stay plain text while a rendered template's are
the special tokens."""

from __future__ import annotations

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, trainers

from moe_serve.tokenizer import END_OF_TEXT, Tokenizer, byte_level_tokenizer

CORPUS = ["the quick brown fox jumps over the lazy dog", "to be or not to be, that is the question"] * 20
TEXTS = ["the lazy fox", "", "question: to be?", f"a {END_OF_TEXT} b", "ünïcödé ✓ " * 30, "x" * 2000]


def _bpe() -> HFTokenizer:
    tokenizer = HFTokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=120, special_tokens=["[UNK]", END_OF_TEXT]))
    return tokenizer


def test_encode_many_is_encode_of_each_text_with_special_tokens_literal() -> None:
    for hf in (_bpe(), byte_level_tokenizer()):
        tokenizer = Tokenizer(hf)
        literal = HFTokenizer.from_str(hf.to_str())
        literal.encode_special_tokens = True
        expected = [literal.encode(text, add_special_tokens=False).ids for text in TEXTS]
        assert tokenizer.encode_many(TEXTS) == expected
        assert [tokenizer.encode(text) for text in TEXTS] == expected
        assert tokenizer.encode_many([]) == []
        special = hf.token_to_id(END_OF_TEXT)
        assert special not in tokenizer.encode(TEXTS[3])  # a user's text never smuggles in a special token
        assert special in tokenizer.encode_rendered(TEXTS[3])  # a rendered template's does
        assert tokenizer.encode_rendered(TEXTS[0]) == hf.encode(TEXTS[0], add_special_tokens=False).ids
