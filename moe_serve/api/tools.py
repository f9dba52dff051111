"""Tool calls on chat: a request's tools and tool_choice -> the constraint its reply is generated under, and
the reply read back into OpenAI's tool_calls.

- "required" and a named function are enforced by a grammar, so any model returns valid arguments:
  "required" generates a JSON array of {"name": ..., "parameters": {...}} objects (1 to MAX_CALLS; one when
  parallel_tool_calls is false), each name one of the tools and its parameters valid for that tool's schema,
  as vLLM does; a named function generates its arguments object.
- "auto" reads the model's own tool-call format, where its chat template declares one (FORMATS); a reply
  without a call is plain content. A template that declares none makes "auto" a 400: the server cannot know
  how the model would call a tool.
- "none" generates text; the tools still reach the template (as transformers and vLLM pass them).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from moe_serve.api import protocol as p
from moe_serve.errors import ValidationError
from moe_serve.structured_output import StructuredOutput

ANY_OBJECT: dict[str, Any] = {"type": "object"}  # a function declared without parameters takes any object
MAX_CALLS = 16  # calls in one "required" reply: a model that repeats itself still ends its array


@dataclass(frozen=True, slots=True)
class ToolCallFormat:
    """A model family's way of writing tool calls in text, each call a JSON object {"name", "arguments"}:
    between `start` and `end` one at a time (`end` given), or all in one JSON array after `start` (`end`
    None). A chat template that writes `start` declares the format."""

    name: str
    start: str
    end: str | None = None

    def calls(self, text: str) -> tuple[str | None, list[tuple[str, Any]]] | None:
        """(content before the first call or None, [(name, arguments)]); None when the text holds no
        well-formed call (it is then plain content)."""
        begin = text.find(self.start)
        if begin < 0:
            return None
        try:
            if self.end is None:
                bodies = json.loads(text[begin + len(self.start) :])
                if not isinstance(bodies, list):
                    return None
            else:
                pattern = re.escape(self.start) + r"(.*?)(?:" + re.escape(self.end) + r"|$)"
                bodies = [json.loads(body) for body in re.findall(pattern, text[begin:], re.S)]
        except ValueError:
            return None
        found = []
        for call in bodies:
            if not (
                isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(call.get("arguments"), dict)
            ):
                return None
            found.append((call["name"], call["arguments"]))
        content = text[:begin].strip()
        return (content or None), found


FORMATS = (
    # Hermes': Qwen 2 and 3, Qwen-MoE, Hermes and many fine-tunes (vLLM's `hermes` parser).
    ToolCallFormat("hermes", "<tool_call>", "</tool_call>"),
    # Mistral's (v3 and later tokenizers: Mixtral 8x22B Instruct v0.1, Mistral Small; vLLM's `mistral` parser).
    ToolCallFormat("mistral", "[TOOL_CALLS]"),
)


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How one chat request uses its tools."""

    mode: Literal["none", "auto", "required", "named"]
    tools: tuple[p.ToolSpec, ...]
    function: str | None = None  # the named function
    parallel: bool = True  # several calls in one reply (parallel_tool_calls)
    format: ToolCallFormat | None = None  # "auto": the model's own

    @property
    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as chat templates receive them (transformers' shape)."""
        return [t.model_dump(exclude_none=True) for t in self.tools]

    @property
    def reads_calls(self) -> bool:
        return self.mode != "none"

    def structured_output(self) -> StructuredOutput | None:
        """The grammar the reply is generated under ("required", a named function), or None."""
        schemas = {t.function.name: t.function.parameters or ANY_OBJECT for t in self.tools}
        if self.mode == "named":
            assert self.function is not None
            return StructuredOutput.json_schema(schemas[self.function], "tool_choice")
        if self.mode != "required":
            return None
        call = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": schema},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, schema in schemas.items()
        ]
        array = {
            "type": "array",
            "minItems": 1,
            "maxItems": MAX_CALLS if self.parallel else 1,
            "items": {"anyOf": call},
        }
        return StructuredOutput.json_schema(array, "tool_choice")

    def read(self, text: str) -> tuple[str | None, list[p.ToolCall]] | None:
        """The reply as (content, tool calls); None when it carries no calls (it is then plain content: "auto"
        without a call, or a constrained reply cut short by max_tokens)."""
        calls: list[tuple[str, Any]]
        content: str | None = None
        try:
            if self.mode == "named":
                assert self.function is not None
                calls = [(self.function, json.loads(text))]
            elif self.mode == "required":
                calls = [(c["name"], c["parameters"]) for c in json.loads(text)]
            elif self.mode == "auto":
                assert self.format is not None
                parsed = self.format.calls(text)
                if parsed is None:
                    return None
                content, calls = parsed
            else:
                return None
        except (ValueError, TypeError, KeyError):
            return None
        if not self.parallel:
            calls = calls[:1]
        names = {t.function.name for t in self.tools}
        if not calls or any(name not in names for name, _ in calls):
            return None
        return content, [
            p.ToolCall(
                id=f"call_{uuid.uuid4().hex[:24]}", function=p.ToolCallFunction(name=name, arguments=json.dumps(args))
            )
            for name, args in calls
        ]


def plan(request: p.ChatCompletionRequest, chat_template: str) -> ToolPlan | None:
    """The request's use of tools (None: it has none), checked against each other and the template."""
    choice = request.tool_choice
    if not request.tools:
        if choice not in (None, "none"):
            raise ValidationError("tool_choice needs tools", parameter="tool_choice")
        return None
    names = [t.function.name for t in request.tools]
    if len(set(names)) != len(names):
        raise ValidationError("tools has two functions of one name", parameter="tools")
    tools = tuple(request.tools)
    parallel = request.parallel_tool_calls is not False
    if isinstance(choice, p.NamedToolChoice):
        if choice.function.name not in names:
            raise ValidationError(
                f"tool_choice names function {choice.function.name!r}, which is not in tools ({', '.join(names)})",
                parameter="tool_choice",
            )
        return ToolPlan("named", tools, choice.function.name, parallel)
    if choice in ("none", "required"):
        return ToolPlan(choice, tools, parallel=parallel)
    found = next((f for f in FORMATS if f.start in chat_template), None)
    if found is None:
        raise ValidationError(
            'tool_choice "auto" (the default when tools are given) needs a chat template that declares a tool-call '
            f"format ({', '.join(f.name for f in FORMATS)}), and this model's does not: give tool_choice "
            '"required" or a named function (a grammar then makes any model call a tool), or "none"',
            parameter="tool_choice",
        )
    return ToolPlan("auto", tools, parallel=parallel, format=found)
