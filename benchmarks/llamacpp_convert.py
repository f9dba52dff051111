"""llama.cpp's convert_hf_to_gguf.py on a benchmark model, with one change made here rather than in the vendored
files: the vocabulary.

The benchmark models carry moe-serve's byte-level tokenizer (a BPE with no merges), which the converter does
not recognise (it identifies pre-tokenizers by hashing how a test text is tokenized) and whose empty merges list
llama.cpp's loader refuses. The benchmarks feed token ids, never text, so the vocabulary is written with the
default pre-tokenizer and a one-entry placeholder merges list: the token table (and the model's vocabulary
size) is all that matters. Run by benchmarks.llamacpp with the vendored llama.cpp and gguf-py on PYTHONPATH:

    python -m benchmarks.llamacpp_convert HF_DIR --outtype f32 --outfile OUT.gguf
"""

from __future__ import annotations

import sys

import convert_hf_to_gguf  # type: ignore[import-not-found]
import gguf  # type: ignore[import-not-found]
from conversion.base import TextModel  # type: ignore[import-not-found]
from conversion.llama import LlamaModel  # type: ignore[import-not-found]


def byte_level_vocab(self: TextModel) -> None:
    """LlamaModel.set_vocab for a tokenizer.json BPE whose pre-tokenizer has no llama.cpp name."""
    tokens, toktypes, pre = self.get_vocab_base()
    writer = self.gguf_writer
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(toktypes)
    special = gguf.SpecialVocab(self.dir_model, load_merges=True)
    if not special.merges:  # the loader requires the key; ids are fed directly, so the merge is never applied
        special.merges = [f"{tokens[0]} {tokens[1]}"]
    special.add_to_gguf(writer)


def main() -> None:
    TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
    LlamaModel.set_vocab = byte_level_vocab
    sys.argv[0] = convert_hf_to_gguf.__file__
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
