"""Tool calls read back from a reply: Hermes' format ("auto"), the grammar's array ("required") and a named
function's arguments; what is not a well-formed call of a given tool stays plain content."""

from __future__ import annotations

import json

import pytest

from moe_serve.api import protocol as p
from moe_serve.api.tools import FORMATS, MAX_CALLS, ToolPlan, plan
from moe_serve.errors import ValidationError

TOOLS = tuple(
    p.ToolSpec.model_validate({"type": "function", "function": {"name": name, "parameters": {"type": "object"}}})
    for name in ("count", "get_weather")
)
HERMES = FORMATS[0]


def calls(read) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in read[1]]


def test_auto_reads_hermes_calls_and_the_text_before_them() -> None:
    auto = ToolPlan("auto", TOOLS, format=HERMES)
    text = (
        'Let me see.\n<tool_call>\n{"name": "count", "arguments": {"n": 2}}\n</tool_call>\n'
        '<tool_call>{"name": "get_weather", "arguments": {}}'
    )
    read = auto.read(text)
    assert read is not None and read[0] == "Let me see."
    assert calls(read) == [("count", {"n": 2}), ("get_weather", {})]  # the last one unclosed at EOS
    assert calls(ToolPlan("auto", TOOLS, parallel=False, format=HERMES).read(text)) == [("count", {"n": 2})]
    ids = [c.id for c in read[1]]
    assert len(set(ids)) == 2 and all(i.startswith("call_") and len(i) == 29 for i in ids)


def test_auto_reads_mistrals_array_of_calls() -> None:
    mistral = next(f for f in FORMATS if f.name == "mistral")
    auto = ToolPlan("auto", TOOLS, format=mistral)
    read = auto.read('[TOOL_CALLS][{"name": "count", "arguments": {"n": 1}}, {"name": "get_weather", "arguments": {}}]')
    assert read is not None and read[0] is None
    assert calls(read) == [("count", {"n": 1}), ("get_weather", {})]
    assert auto.read('[TOOL_CALLS][{"name": "count", "arguments": {"n": 1}') is None  # cut short
    assert auto.read('[TOOL_CALLS]{"name": "count", "arguments": {}}') is None  # not an array
    template = "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]"
    request = p.ChatCompletionRequest(
        messages=[{"role": "user", "content": "x"}], tools=[t.model_dump() for t in TOOLS]
    )
    assert plan(request, template).format is mistral


@pytest.mark.parametrize(
    "text",
    [
        "no call at all",
        '<tool_call>{"name": "count", "arguments": {"n": 2}',  # cut short: not JSON
        '<tool_call>{"name": "launch", "arguments": {}}</tool_call>',  # not one of the tools
        '<tool_call>{"name": "count", "arguments": "n=2"}</tool_call>',  # arguments not an object
    ],
)
def test_what_is_not_a_well_formed_call_is_plain_content(text: str) -> None:
    assert ToolPlan("auto", TOOLS, format=HERMES).read(text) is None


def test_required_and_named_read_what_their_grammars_generate() -> None:
    required = ToolPlan("required", TOOLS)
    schema = json.loads(required.structured_output().spec)
    assert schema["minItems"] == 1 and schema["maxItems"] == MAX_CALLS
    assert [c["properties"]["name"] for c in schema["items"]["anyOf"]] == [{"const": "count"}, {"const": "get_weather"}]
    assert json.loads(ToolPlan("required", TOOLS, parallel=False).structured_output().spec)["maxItems"] == 1
    read = required.read('[{"name":"get_weather","parameters":{"city":"Rome"}}]')
    assert read[0] is None and calls(read) == [("get_weather", {"city": "Rome"})]
    assert required.read('[{"name":"get_weather","parameters":{"ci') is None  # cut by max_tokens
    named = ToolPlan("named", TOOLS, "count")
    assert json.loads(named.structured_output().spec) == {"type": "object"}
    assert calls(named.read('{"n":3}')) == [("count", {"n": 3})]
    assert ToolPlan("none", TOOLS).read('<tool_call>{"name": "count", "arguments": {}}</tool_call>') is None


def test_plan_checks_tools_against_tool_choice_and_the_template() -> None:
    def request(**fields) -> p.ChatCompletionRequest:
        return p.ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **fields)

    tools = [t.model_dump() for t in TOOLS]
    assert plan(request(), "") is None and plan(request(tool_choice="none"), "") is None
    assert plan(request(tools=tools), "{{ '<tool_call>' }}").format is HERMES
    assert plan(request(tools=tools, tool_choice="required"), "").mode == "required"
    for fields, message in [
        ({"tools": tools}, 'tool_choice "auto"'),
        ({"tool_choice": "auto"}, "needs tools"),
        ({"tools": tools * 2, "tool_choice": "required"}, "two functions of one name"),
        ({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "x"}}}, "not in tools"),
    ]:
        with pytest.raises(ValidationError, match=message):
            plan(request(**fields), "")
