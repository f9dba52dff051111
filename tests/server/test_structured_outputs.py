"""Structured outputs and tool calls through the clients people use, unchanged, against a real uvicorn
server: the openai SDK's `chat.completions.parse`, instructor, pydantic-ai, a LangChain model with two tools
under tool_choice "required"; vLLM's guided_* and structured_outputs fields; tool calls in the model's own
format ("auto", a template that declares Hermes' <tool_call>) and tool messages through the template; the
Batch API's lines. The bundled LMs know Shakespeare, not JSON: what validates is the grammar's doing."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Iterator
from typing import Annotated, Literal

import httpx
import openai
import pydantic
import pytest

from moe_serve.config import EngineConfig
from moe_serve.server.settings import ServerSettings
from moe_serve.testing import create_random_artifact
from tests.conftest import lm_config
from tests.server.conftest import start_server
from tests.server.test_chat_clients import loopback_only  # noqa: F401  # autouse: nothing leaves this machine

pytestmark = pytest.mark.slow

LM = "shakespeare-smoe"  # trained at k = 8 of 16
MESSAGES = [{"role": "user", "content": "Who comes there?"}]

# Qwen 2.5's tool section, shortened: the tools as JSON, calls as <tool_call> JSON </tool_call>, tool results.
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
# Tools
<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>
Call a function as <tool_call>{"name": <name>, "arguments": <args>}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{% for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>{{ message.tool_call_id }}: {{ message.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


class Scene(pydantic.BaseModel):
    speaker: str = pydantic.Field(max_length=12)
    lines: int = pydantic.Field(ge=1, le=99)
    mood: Literal["merry", "sad"]


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Elsinore", "Verona"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
COUNT = {
    "type": "function",
    "function": {
        "name": "count",
        "parameters": {
            "type": "object",
            "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["n"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def base_url(tmp_path_factory) -> Iterator[str]:
    hermes = create_random_artifact(
        tmp_path_factory.mktemp("hermes") / "hermes-lm",
        lm_config(chat_template=HERMES_TEMPLATE, max_position_embeddings=2048),
        seed=41,
    )
    settings = ServerSettings(
        models=(LM, str(hermes)),
        engine=EngineConfig(max_num_seqs=8),
        data_dir=str(tmp_path_factory.mktemp("batch-data")),
    )
    running = start_server(settings)
    yield running.url + "/v1"
    running.stop()


@pytest.fixture
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)


def test_openai_parse_at_k1_and_the_trained_k_in_one_batch_streamed_and_not(client: openai.OpenAI) -> None:
    results: dict[str, Scene] = {}

    def parse(k: int | None) -> None:
        extra = {"experts_per_token": k} if k else None
        reply = client.chat.completions.parse(
            model=LM, messages=MESSAGES, response_format=Scene, temperature=0.7, seed=k or 0, extra_body=extra
        )
        assert reply.choices[0].finish_reason == "stop"
        assert reply.usage.experts_per_token == (k or 8)
        results[f"k{k}"] = reply.choices[0].message.parsed

    threads = [threading.Thread(target=parse, args=(k,)) for k in (1, None)]  # concurrent: one batch
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(results) == {"k1", "kNone"} and all(isinstance(s, Scene) for s in results.values())
    with client.chat.completions.stream(model=LM, messages=MESSAGES, response_format=Scene, temperature=0) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_completion().choices[0].message.parsed
    whole = client.chat.completions.parse(model=LM, messages=MESSAGES, response_format=Scene, temperature=0)
    assert isinstance(streamed, Scene) and streamed == whole.choices[0].message.parsed


def test_json_object_guided_choice_regex_grammar_and_structured_outputs(client: openai.OpenAI) -> None:
    def content(**extra: object) -> str:
        reply = client.chat.completions.create(model=LM, messages=MESSAGES, max_tokens=200, seed=1, extra_body=extra)
        return reply.choices[0].message.content or ""

    obj = client.chat.completions.create(
        model=LM, messages=MESSAGES, max_tokens=400, temperature=0, response_format={"type": "json_object"}
    )
    assert obj.choices[0].finish_reason != "stop" or isinstance(json.loads(obj.choices[0].message.content), dict)
    assert content(guided_choice=["aye", "nay"]) in ("aye", "nay")
    assert re.fullmatch(r"[A-Z]{2}-\d{3}", content(guided_regex=r"[A-Z]{2}-\d{3}"))
    assert content(guided_grammar='root ::= "my " ("lord" | "liege")') in ("my lord", "my liege")
    assert content(structured_outputs={"choice": ["Elsinore", "Verona"]}) in ("Elsinore", "Verona")
    scene = content(structured_outputs={"json": Scene.model_json_schema()})
    Scene.model_validate_json(scene)
    # Completions take them too.
    text = client.completions.create(model=LM, prompt="HAMLET.\n", max_tokens=8, extra_body={"guided_choice": ["O"]})
    assert text.choices[0].text == "O"


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
            "response_format",
            "cannot be compiled",
        ),
        ({"guided_regex": "(("}, "guided_regex", "unclosed group"),
        ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice", "one structured output"),
        ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, None, "whitespace_pattern"),
        ({"guided_decoding_backend": "xgrammar", "guided_regex": "a"}, "guided_decoding_backend", "not implemented"),
        ({"tools": [WEATHER]}, "tool_choice", '"auto"'),  # the play template declares no tool-call format
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "nope",
        ),
        ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tool_choice", "give either"),
        ({"guided_json": {"type": "object"}, "ignore_eos": True}, "ignore_eos", "grammar decides"),
    ],  # fmt: skip
)
def test_what_cannot_be_served_is_a_400_naming_the_field(
    base_url: str, body: dict, param: str | None, message: str
) -> None:
    reply = httpx.post(f"{base_url}/chat/completions", json={"model": LM, "messages": MESSAGES, **body}, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert message in error["message"] and (param is None or error["param"] == param), error


def test_tool_choice_required_and_named_return_valid_calls_streamed_and_not(client: openai.OpenAI) -> None:
    tools = [WEATHER, COUNT]
    required = client.chat.completions.create(model=LM, messages=MESSAGES, tools=tools, tool_choice="required", seed=2)
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert 1 <= len(choice.message.tool_calls) <= 16
    for call in choice.message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        arguments = json.loads(call.function.arguments)
        assert (call.function.name, list(arguments)) in (("get_weather", ["city"]), ("count", ["n"]))
    one = client.chat.completions.create(
        model=LM, messages=MESSAGES, tools=tools, tool_choice="required", parallel_tool_calls=False, temperature=0
    )
    assert len(one.choices[0].message.tool_calls) == 1
    named = client.chat.completions.create(
        model=LM, messages=MESSAGES, tools=tools, tool_choice={"type": "function", "function": {"name": "get_weather"}}
    )
    call = named.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Elsinore", "Verona")
    chunks = list(
        client.chat.completions.create(
            model=LM, messages=MESSAGES, tools=tools, tool_choice="required", parallel_tool_calls=False,
            temperature=0, stream=True,
        )
    )  # fmt: skip
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not any(d.content for d in deltas)  # the call's JSON is never sent as content
    streamed = [t for d in deltas for t in d.tool_calls or []]
    assert [(t.index, t.function.name, t.function.arguments) for t in streamed] == [
        (0, c.function.name, c.function.arguments) for c in one.choices[0].message.tool_calls
    ]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_auto_reads_the_templates_tool_call_format_and_tool_messages_round_trip(base_url: str) -> None:
    """The random model writes no calls of its own: a guided regex makes it write one in Hermes' format, and
    tool_choice "none" keeps the tools in the prompt while reading nothing back."""
    model = "hermes-lm"
    call = '<tool_call>{"name": "count", "arguments": {"n": 3}}</tool_call>'
    body = {"model": model, "messages": MESSAGES, "tools": [WEATHER, COUNT], "max_tokens": 80}
    auto = httpx.post(f"{base_url}/chat/completions", json={**body, "guided_regex": "Hm\\. " + re.escape(call)}).json()
    choice = auto["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Hm."
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in choice["message"]["tool_calls"]
    ] == [("count", {"n": 3})]
    none = httpx.post(
        f"{base_url}/chat/completions", json={**body, "tool_choice": "none", "guided_regex": re.escape(call)}
    )
    assert (
        none.json()["choices"][0]["message"]["content"] == call and none.json()["choices"][0]["finish_reason"] == "stop"
    )
    bare = httpx.post(
        f"{base_url}/chat/completions", json={"model": model, "messages": MESSAGES, "max_tokens": 1}
    ).json()
    assert auto["usage"]["prompt_tokens"] > bare["usage"]["prompt_tokens"] + 100  # the tools were in the prompt
    # Streamed: the text before the call goes out as content, the call as one tool_calls delta.
    with httpx.stream(
        "POST",
        f"{base_url}/chat/completions",
        json={**body, "stream": True, "guided_regex": "Hm\\. " + re.escape(call)},
    ) as stream:
        events = [json.loads(x[6:]) for x in stream.iter_lines() if x.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert "".join(d.get("content") or "" for d in deltas).strip() == "Hm."
    assert [t["function"]["name"] for d in deltas for t in d.get("tool_calls") or []] == ["count"]
    # The conversation continues: the call and its result go back through the template.
    history = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": choice["message"]["tool_calls"]},
        {"role": "tool", "tool_call_id": choice["message"]["tool_calls"][0]["id"], "content": "three"},
    ]
    follow = httpx.post(f"{base_url}/chat/completions", json={**body, "messages": history, "tool_choice": "none"})
    assert follow.status_code == 200, follow.text
    grown = follow.json()["usage"]["prompt_tokens"] - auto["usage"]["prompt_tokens"]
    assert grown >= len(call) + len("three")
    no_id = httpx.post(
        f"{base_url}/chat/completions", json={**body, "messages": [*MESSAGES, {"role": "tool", "content": "x"}]}
    )
    assert no_id.status_code == 400 and "tool_call_id" in no_id.json()["error"]["message"]


def test_instructor_and_pydantic_ai_get_typed_results(base_url: str) -> None:
    instructor = pytest.importorskip("instructor")
    typed = instructor.from_openai(
        openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0), mode=instructor.Mode.JSON_SCHEMA
    )
    scene = typed.chat.completions.create(model=LM, messages=MESSAGES, response_model=Scene, max_retries=0)
    assert isinstance(scene, Scene)
    tools_mode = instructor.from_openai(openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0))
    assert isinstance(tools_mode.chat.completions.create(model=LM, messages=MESSAGES, response_model=Scene), Scene)

    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(LM, provider=OpenAIProvider(base_url=base_url, api_key="unused"))
    agent = Agent(model, output_type=Scene)  # a tool call the agent requires: tool_choice "required"
    result = asyncio.run(agent.run("Who comes there?"))
    assert isinstance(result.output, Scene)


def test_a_langchain_model_with_two_tools_gets_well_formed_calls(base_url: str) -> None:
    pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: Literal["Elsinore", "Verona"]) -> str:
        """The weather in a city."""
        return "fog"

    @tool
    def count(n: Annotated[int, pydantic.Field(ge=0, le=9)]) -> int:  # bounded: a Shakespeare LM counts on and on
        """Count to n."""
        return n

    chat = ChatOpenAI(model=LM, base_url=base_url, api_key="unused", max_retries=0, temperature=0.5, max_tokens=1000)
    reply = chat.bind_tools([get_weather, count], tool_choice="required").invoke("Who comes there?")
    assert reply.tool_calls and reply.response_metadata["finish_reason"] == "tool_calls"
    for call in reply.tool_calls:
        assert call["name"] in ("get_weather", "count") and call["id"]
        (get_weather if call["name"] == "get_weather" else count).invoke(call["args"])  # the arguments validate
    # An agent's loop, on the model whose template takes tool messages: call under "required", run the
    # tools, hand their results back as ToolMessages, and read the reply under "none".
    from langchain_core.messages import HumanMessage, ToolMessage

    agent_model = ChatOpenAI(model="hermes-lm", base_url=base_url, api_key="unused", max_retries=0, max_tokens=600)
    history: list = [HumanMessage("Who comes there?")]
    step = agent_model.bind_tools([get_weather, count], tool_choice="required").invoke(history)
    assert step.tool_calls and step.response_metadata["finish_reason"] == "tool_calls"
    history.append(step)
    for call in step.tool_calls:
        result = (get_weather if call["name"] == "get_weather" else count).invoke(call["args"])
        history.append(ToolMessage(str(result), tool_call_id=call["id"]))
    answer = agent_model.bind_tools([get_weather, count], tool_choice="none").invoke(history)
    assert isinstance(answer.content, str) and not answer.tool_calls
    assert answer.usage_metadata["input_tokens"] > step.usage_metadata["input_tokens"]  # the results went in


def test_batch_api_lines_carry_structured_outputs(base_url: str) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    lines = [
        {"custom_id": "schema", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": LM, "messages": MESSAGES, "response_format": {
             "type": "json_schema", "json_schema": {"name": "Scene", "schema": Scene.model_json_schema()}}}},
        {"custom_id": "choice", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": LM, "messages": MESSAGES, "max_tokens": 8, "guided_choice": ["yea", "nay"]}},
        {"custom_id": "tools", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": LM, "messages": MESSAGES, "tools": [COUNT], "tool_choice": "required"}},
    ]  # fmt: skip
    upload = client.files.create(file=("in.jsonl", "\n".join(map(json.dumps, lines)).encode()), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    for _ in range(600):
        batch = client.batches.retrieve(batch.id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            break
        threading.Event().wait(0.1)
    assert batch.status == "completed", batch.errors
    out = {
        x["custom_id"]: x["response"]["body"]
        for x in map(json.loads, client.files.content(batch.output_file_id).text.splitlines())
    }
    Scene.model_validate_json(out["schema"]["choices"][0]["message"]["content"])
    assert out["choice"]["choices"][0]["message"]["content"] in ("yea", "nay")
    assert out["tools"]["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "count"


def test_moe_serve_batch_files_carry_structured_outputs(tmp_path) -> None:
    from moe_serve.batch.runner import run_batch

    lines = [
        {"custom_id": "regex", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "HAMLET.\n", "max_tokens": 16, "guided_regex": "[0-9]{3}"}},
        {"custom_id": "tools", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": MESSAGES, "tools": [WEATHER], "tool_choice": "required"}},
    ]  # fmt: skip
    inputs, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inputs.write_text("\n".join(map(json.dumps, lines)) + "\n")
    run_batch(inputs, output, default_model=LM, progress=False)
    out = {x["custom_id"]: x["response"]["body"] for x in map(json.loads, output.read_text().splitlines())}
    assert re.fullmatch("[0-9]{3}", out["regex"]["choices"][0]["text"])
    call = out["tools"]["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call["name"] == "get_weather" and json.loads(call["arguments"])["city"] in ("Elsinore", "Verona")
