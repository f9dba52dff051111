"""Constrained decoding: a request's StructuredOutput compiled into a grammar, and one matcher per sequence
that says which tokens its grammar can take next. The grammar work is llguidance's (what vLLM's "guidance"
backend, SGLang and llama.cpp's optional path use: vllm/v1/structured_output/backend_guidance.py was the
model here), chosen over xgrammar because it compiles lazily (no per-schema compile step of seconds), needs
no other package, and bounds its own work per step ("fuel"), so no schema can stall the engine.

Where the work runs: compiling happens where requests are prepared (the server's preparation threads, the
caller of LLM), never on the engine thread, and compiled grammars are cached by what they depend on. The
engine thread computes masks (microseconds a row: benchmarks/structured_cost.py) and advances each matcher
by its sequence's token. A row's mask depends only on its own tokens, so a constrained row and a free one
batched together each get what they get alone, bitwise.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

from moe_serve.errors import ValidationError
from moe_serve.structured_output import StructuredOutput
from moe_serve.tokenizer import Tokenizer

if TYPE_CHECKING:
    import llguidance
    from llguidance._lib import JsonCompileOptions

# Compact JSON (", " and ": " only, no other whitespace), as OpenAI's structured outputs read: a model cannot
# wander in whitespace until max_tokens, and no blank line (a chat template's stop string) can appear.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
GRAMMAR_CACHE_SIZE = 256  # compiled grammars kept per model, least recently used first out


class GrammarMatcher:
    """One sequence's position in its grammar."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def consume(self, token_id: int) -> bool:
        """Advance by the token the sequence took; False if the grammar cannot take it (the masks make
        that impossible unless the grammar failed: see `error`)."""
        return bool(self.matcher.consume_token(token_id))

    @property
    def is_stopped(self) -> bool:
        """The grammar is complete and can take nothing more: the sequence is done."""
        return bool(self.matcher.is_stopped())

    @property
    def error(self) -> str:
        return str(self.matcher.get_error() or "")


class Grammar:
    """A compiled grammar, validated against the model's tokenizer; a cache entry, never advanced itself."""

    __slots__ = ("_pristine",)

    def __init__(self, pristine: llguidance.LLMatcher) -> None:
        self._pristine = pristine

    def matcher(self) -> GrammarMatcher:
        """A fresh matcher for one sequence (a copy of the compiled state: nothing is compiled again)."""
        return GrammarMatcher(self._pristine.deep_copy())


class Grammars:
    """The grammar compiler of one model: its tokenizer as llguidance reads it (built on first use: about
    a second for a 150,000-token vocabulary) and a cache of compiled grammars. Thread-safe."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width: ids past the tokenizer's are never allowed
        self._eos_token_ids = list(eos_token_ids)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[tuple[str, str], Grammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, output: StructuredOutput) -> Grammar:
        """The request's grammar, compiled (or from the cache); a grammar the library refuses is a 400 naming
        the field that carried it."""
        with self._lock:
            cached = self._cache.get(output.key)
            if cached is not None:
                self._cache.move_to_end(output.key)
                return cached
        import llguidance

        def refused(reason: str) -> ValidationError:
            return ValidationError(f"{output.parameter} cannot be compiled: {reason}", parameter=output.parameter)

        tokenizer = self._llg_tokenizer()
        try:
            source = _grammar_source(output)
        except ValueError as exc:
            raise refused(str(exc)) from None
        # Built with the GIL released; a grammar it cannot build leaves it in an error state (it never raises).
        matcher = llguidance.LLMatcher(tokenizer, source, log_level=0)
        if matcher.is_error():
            raise refused(matcher.get_error())
        # The first mask, computed here: llguidance builds its lexer lazily, so the first one costs the most,
        # and a grammar that fails only there (its lexer over the work limit) is still the request's 400.
        probe = Grammar(matcher).matcher()
        token_bitmask([probe], self.vocab_size)
        if probe.matcher.is_error():
            raise refused(probe.error)
        grammar = Grammar(matcher)
        with self._lock:
            self._cache[output.key] = grammar
            while len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance

                self._ll_tokenizer = llguidance.LLTokenizer(
                    self._tokenizer.hf.to_str(), n_vocab=self.vocab_size, eos_token=self._eos_token_ids or None
                )
            return self._ll_tokenizer


def _grammar_source(output: StructuredOutput) -> str:
    """llguidance's grammar for the request (ValueError: a spec it cannot read)."""
    import llguidance

    kind = output.kind
    if kind == "json":
        schema = _closed_objects(json.loads(output.spec))
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
    # "grammar": Lark, or GBNF as llama.cpp's server takes it (llguidance converts it)
    return llguidance.grammar_from(kind, output.spec)


# Where a schema holds further schemas: maps of them, and single ones or lists of them.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = (
    "items",
    "prefixItems",
    "additionalItems",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "allOf",
    "anyOf",
    "oneOf",
)


def _closed_objects(schema: Any) -> Any:
    """The schema with every object that declares properties but says nothing of others closed to them
    (additionalProperties false), as OpenAI's strict mode requires and vLLM's disable_additional_properties
    does: JSON Schema's default admits any further key, and a model given that freedom may write keys
    until max_tokens. What it generates still validates against the schema as given."""
    if isinstance(schema, list):
        return [_closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    closed = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(closed.get(key), dict):
            closed[key] = {name: _closed_objects(s) for name, s in closed[key].items()}
    for key in (*_SUBSCHEMAS, "additionalProperties"):
        if isinstance(closed.get(key), (dict, list)):
            closed[key] = _closed_objects(closed[key])
    if "additionalProperties" not in closed and isinstance(closed.get("properties"), dict):
        closed["additionalProperties"] = False
    return closed


def token_bitmask(matchers: list[GrammarMatcher], width: int) -> torch.Tensor:
    """[R, ceil(width / 32)] int32: which tokens each row's grammar can take next (only EOS once it is
    complete), bit b of word w for token 32 w + b (llguidance's layout; kernels.ops.mask_logits applies it).

    Row by row on this thread, each row written by llguidance in place (what llguidance.torch's
    fill_next_token_bitmask does; that module is not imported: it wraps a function in torch.compile, whose
    import took 0.8 s of the first constrained step). llguidance's parallel executor is not used either: it
    keeps threads of its own that, on a machine whose cores run the model's threads, cost the step more than
    they save (a batch of 64 steps took 5.6 against 3.8 ms with it, 0.1 ms of masks;
    benchmarks/structured_cost.py)."""
    bitmask = torch.empty((len(matchers), -(-width // 32)), dtype=torch.int32)
    row_bytes = bitmask.shape[1] * bitmask.element_size()
    for row, matcher in enumerate(matchers):
        matcher.matcher.unsafe_compute_mask_ptr(bitmask[row].data_ptr(), row_bytes)
    return bitmask
