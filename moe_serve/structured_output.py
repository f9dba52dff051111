"""A request's structured output: the constraint its generated text must satisfy (a JSON schema, any JSON
object, a regular expression, one of a list of strings, or a grammar). What the request asked for, checked
for size and shape; compiling it against a tokenizer is moe_serve.engine.grammar's job."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from moe_serve.errors import ValidationError

StructuredKind = Literal["json", "json_object", "regex", "choice", "grammar"]

# Bounds on what one request may ask the grammar compiler for (its own limits bound the work per step: see
# moe_serve.engine.grammar). A schema, regex or grammar of more than this many characters is refused.
MAX_SPEC_CHARS = 1 << 16
MAX_CHOICES = 1024
MAX_SCHEMA_DEPTH = 128  # nested objects and lists: deeper, Python's own recursion gives out before the library's


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """`spec`: a JSON schema as compact JSON text (its key order kept: properties are generated in order),
    the regex, the choices as a JSON list, or the grammar (Lark or GBNF); empty for json_object.
    `parameter`: the request field it came from, which its errors name."""

    kind: StructuredKind
    spec: str
    parameter: str

    def __post_init__(self) -> None:
        if len(self.spec) > MAX_SPEC_CHARS:
            raise ValidationError(
                f"{self.parameter} is {len(self.spec)} characters; at most {MAX_SPEC_CHARS}", parameter=self.parameter
            )

    @property
    def key(self) -> tuple[str, str]:
        """What its compiled grammar depends on (not which field carried it)."""
        return self.kind, self.spec

    @classmethod
    def of(cls, kind: StructuredKind, value: Any, parameter: str) -> StructuredOutput:
        """The constraint a request field of this kind asks for (its value already of the field's type)."""
        if kind == "json":
            return cls.json_schema(value, parameter)
        if kind == "json_object":
            return cls.json_object(parameter)
        if kind == "choice":
            return cls.choice(value, parameter)
        return cls.regex(value, parameter) if kind == "regex" else cls.grammar(value, parameter)

    @classmethod
    def json_schema(cls, schema: Any, parameter: str) -> StructuredOutput:
        """A schema given as an object, or as JSON text of one (vLLM's guided_json takes both)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise ValidationError(f"{parameter} is not valid JSON: {exc}", parameter=parameter) from None
        if not isinstance(schema, dict):
            raise ValidationError(f"{parameter} must be a JSON schema object", parameter=parameter)
        if _depth(schema) > MAX_SCHEMA_DEPTH:
            raise ValidationError(
                f"{parameter} nests objects and lists more than {MAX_SCHEMA_DEPTH} deep", parameter=parameter
            )
        return cls("json", json.dumps(schema, separators=(",", ":")), parameter)

    @classmethod
    def json_object(cls, parameter: str) -> StructuredOutput:
        return cls("json_object", "", parameter)

    @classmethod
    def regex(cls, pattern: str, parameter: str) -> StructuredOutput:
        if not pattern:
            raise ValidationError(f"{parameter} must not be empty", parameter=parameter)
        return cls("regex", pattern, parameter)

    @classmethod
    def choice(cls, choices: list[str], parameter: str) -> StructuredOutput:
        if not choices or len(choices) > MAX_CHOICES or not all(isinstance(c, str) and c for c in choices):
            raise ValidationError(
                f"{parameter} must be a list of 1 to {MAX_CHOICES} non-empty strings", parameter=parameter
            )
        return cls("choice", json.dumps(list(choices)), parameter)

    @classmethod
    def grammar(cls, text: str, parameter: str) -> StructuredOutput:
        if not text.strip():
            raise ValidationError(f"{parameter} must not be empty", parameter=parameter)
        return cls("grammar", text, parameter)


def _depth(value: Any) -> int:
    """How deep objects and lists nest in a JSON value (iteratively: the value may be deeper than recursion)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            if depth > MAX_SCHEMA_DEPTH:
                break
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest
