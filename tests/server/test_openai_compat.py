"""What third-party clients rely on: GET /v1/models/{id}, vLLM's tokenizer endpoints,
chat logprobs and content parts, Hugging Face's chat-template environment, and every OpenAI/vLLM field not
implemented refused by name."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from moe_serve import LLM
from moe_serve.api import protocol as p
from moe_serve.api.prepare import render_chat
from moe_serve.api.protocol import NOT_IMPLEMENTED
from moe_serve.testing import create_random_artifact
from tests.conftest import lm_config

LM = {"model": "tiny-lm"}


def test_models_retrieve_with_the_openai_client(server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    card = client.models.retrieve("tiny-lm")
    assert card.id == "tiny-lm" and card.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-5")


def test_tokenize_gives_the_ids_a_completion_runs_on(client: httpx.Client) -> None:
    tokens = client.post("/tokenize", json={**LM, "prompt": "Hello"}).json()
    usage = client.post("/v1/completions", json={**LM, "prompt": "Hello", "max_tokens": 1}).json()["usage"]
    assert tokens["count"] == len(tokens["tokens"]) == usage["prompt_tokens"] == 6  # BOS + 5 bytes
    assert tokens["max_model_len"] == 128
    bare = client.post("/tokenize", json={**LM, "prompt": "Hello", "add_special_tokens": False}).json()
    assert bare["tokens"] == tokens["tokens"][1:]
    with_strs = client.post("/tokenize", json={**LM, "prompt": "Hi", "return_token_strs": True}).json()
    assert len(with_strs["token_strs"]) == with_strs["count"]
    assert client.post("/detokenize", json={**LM, "tokens": bare["tokens"]}).json() == {"prompt": "Hello"}


def test_tokenize_messages_equals_what_chat_runs_on(client: httpx.Client) -> None:
    messages = [{"role": "user", "content": "hi"}]
    tokens = client.post("/tokenize", json={**LM, "messages": messages}).json()
    chat = client.post("/v1/chat/completions", json={**LM, "messages": messages, "max_tokens": 1}).json()
    assert tokens["count"] == chat["usage"]["prompt_tokens"]


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/tokenize", {**LM, "prompt": "x", "messages": [{"role": "user", "content": "y"}]}, None),
        ("/tokenize", {**LM}, None),
        ("/detokenize", {**LM, "tokens": [100000]}, "tokens"),
        ("/tokenize", {"model": "gpt-5", "prompt": "x"}, "model"),
    ],
    ids=["both inputs", "no input", "id out of vocabulary", "unknown model"],
)
def test_tokenizer_endpoints_refuse_bad_input(client: httpx.Client, path: str, body: dict, param) -> None:
    response = client.post(path, json=body)
    assert response.status_code in (400, 404) and response.json()["error"]["param"] == param


def test_tokenizer_info(server, client: httpx.Client) -> None:
    # Two models served: without a name, only when they tokenize alike (vLLM's clients send none).
    shared = len({m.tokenizer_key for m in server.app.state.ctx.models.values()}) == 1
    assert client.get("/tokenizer_info").status_code == (200 if shared else 400)
    info = client.get("/tokenizer_info", params={"model": "tiny-lm"}).json()
    assert info["model"] == "tiny-lm" and info["vocab_size"] == 257 and info["add_bos_token"] is True  # bytes + BOS
    assert info["model_max_length"] == 128 and "{% for m in messages %}" in info["chat_template"]


def test_chat_logprobs_with_the_openai_client(server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    messages = [{"role": "user", "content": "hi"}]
    kwargs = {"model": "tiny-lm", "messages": messages, "max_tokens": 6, "temperature": 0, "logprobs": True}
    whole = client.chat.completions.create(**kwargs, top_logprobs=3)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 6
    for entry in content:  # greedy: the chosen token is the most likely of the alternatives
        assert len(entry.top_logprobs) == 3 and entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
    streamed = [
        entry.logprob
        for chunk in client.chat.completions.create(**kwargs, top_logprobs=3, stream=True)
        if chunk.choices and chunk.choices[0].logprobs
        for entry in chunk.choices[0].logprobs.content
    ]
    assert streamed == pytest.approx([entry.logprob for entry in content])
    plain = client.chat.completions.create(**{**kwargs, "logprobs": False})
    assert plain.choices[0].logprobs is None


def test_content_given_as_text_parts(client: httpx.Client) -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    as_parts = client.post("/tokenize", json={**LM, "messages": [{"role": "user", "content": parts}]}).json()
    as_text = client.post("/tokenize", json={**LM, "messages": [{"role": "user", "content": "a\nb"}]}).json()
    assert as_parts["tokens"] == as_text["tokens"]
    image = [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    body = {**LM, "messages": [{"role": "user", "content": image}], "max_tokens": 1}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400 and "messages" in response.json()["error"]["param"]


# ---- every field not implemented: refused by name, unless it says "off" ---------------------------

ON_VALUES = {
    "length_penalty": 0.5, "bad_words": ["x"], "allowed_token_ids": [5, 6], "spaces_between_special_tokens": False,
    "prompt_logprobs": 1, "truncate_prompt_tokens": 4, "suffix": "end", "guided_decoding_backend": "xgrammar",
    "guided_whitespace_pattern": " ", "logits_processors": ["x"],
    "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto", "functions": [{"name": "f"}],
    "function_call": "auto", "audio": {"voice": "alloy"}, "modalities": ["audio"],
    "prediction": {"type": "content", "content": "x"}, "best_of": 2,
    "echo": True, "chat_template": "{{ messages }}", "chat_template_kwargs": {"enable_thinking": False},
}  # fmt: skip


def test_the_table_of_refused_fields_is_complete() -> None:
    assert set(ON_VALUES) == set(NOT_IMPLEMENTED)


def test_implemented_vllm_fields_pass_through_http(client: httpx.Client) -> None:
    # EOS forced first by logit_bias (JSON's string keys), held back by min_tokens: exactly 3 tokens.
    body = {**LM, "prompt": "x", "max_tokens": 8, "logit_bias": {"256": 100}, "min_tokens": 3}
    assert client.post("/v1/completions", json=body).json()["usage"]["completion_tokens"] == 3
    chat = {**LM, "messages": [{"role": "user", "content": "x"}], "max_tokens": 8, "logit_bias": {"256": 100}}
    assert client.post("/v1/chat/completions", json=chat).json()["usage"]["completion_tokens"] == 0
    for field, value in [("presence_penalty", 3), ("min_p", 2), ("stop_token_ids", [999]), ("logit_bias", {"a": 1})]:
        response = client.post("/v1/completions", json={**LM, "prompt": "x", field: value})
        assert response.status_code == 400 and response.json()["error"]["param"].startswith(field), field


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("field", sorted(NOT_IMPLEMENTED))
def test_a_field_we_do_not_implement_is_refused_by_name(client: httpx.Client, endpoint: str, field: str) -> None:
    if endpoint == "/v1/completions" and field == "echo":
        pytest.skip("echo is implemented for completions")
    if endpoint == "/v1/chat/completions" and field in ("tools", "tool_choice"):
        pytest.skip("tools are implemented for chat (tests/server/test_structured_outputs.py)")
    body = {**LM, "max_tokens": 1}
    body |= {"prompt": "x"} if endpoint == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    refused = client.post(endpoint, json={**body, field: ON_VALUES[field]})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == field and "not implemented" in refused.json()["error"]["message"]
    off = NOT_IMPLEMENTED[field][-1]  # the value that means "not used" (None where that is the only one)
    assert client.post(endpoint, json={**body, field: off}).status_code == 200


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(
    "options,param",
    [
        ({"continuous_usage_stats": True}, "stream_options"),
        ({"include_usage": True, "per_chunk": 1}, "stream_options.per_chunk"),
    ],
    ids=["vLLM's continuous_usage_stats", "an unknown option"],
)
def test_a_stream_option_we_do_not_implement_is_refused_by_name(
    client: httpx.Client, endpoint: str, options: dict, param: str
) -> None:
    body = {**LM, "max_tokens": 1, "stream": True}
    body |= {"prompt": "x"} if endpoint == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    refused = client.post(endpoint, json={**body, "stream_options": options})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == param and next(iter(options.keys() - {"include_usage"})) in error["message"]
    off = {"include_usage": True, "continuous_usage_stats": False}  # the value that means "not used" is accepted
    assert client.post(endpoint, json={**body, "stream_options": off}).status_code == 200


# ---- Hugging Face's template environment ---------------------------------------------------------------

MIXTRAL_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}\n    {%- set system_message = messages[0]['content'] %}\n"
    "    {%- set loop_messages = messages[1:] %}\n{%- else %}\n"
    "    {%- set loop_messages = messages %}\n{%- endif %}\n\n"
    "{{- bos_token }}\n{%- for message in loop_messages %}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\n"
    "        {{- raise_exception('After the optional system message, conversation roles must alternate "
    "user/assistant/user/assistant/...') }}\n    {%- endif %}\n    {%- if message['role'] == 'user' %}\n"
    "        {%- if loop.first and system_message is defined %}\n"
    "            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}\n"
    "        {%- else %}\n            {{- ' [INST] ' + message['content'] + ' [/INST]' }}\n        {%- endif %}\n"
    "    {%- elif message['role'] == 'assistant' %}\n        {{- ' ' + message['content'] + eos_token}}\n"
    "    {%- else %}\n        {{- raise_exception('Only user and assistant roles are supported!') }}\n"
    "    {%- endif %}\n{%- endfor %}\n"
)
TOOLING_TEMPLATE = (
    "{% for m in messages %}\n{% if m.role == 'system' %}{% continue %}{% endif %}\n  {{ m | tojson }}\n"
    "{% if loop.index > 3 %}{% break %}{% endif %}\n{% endfor %}\n"
    "{% if add_generation_prompt %}{{ strftime_now('%Y') }} é>{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Où est-il?"},
    {"role": "assistant", "content": "Here."},
    {"role": "user", "content": "And now?"},
]


@pytest.mark.parametrize("template", [MIXTRAL_TEMPLATE, TOOLING_TEMPLATE], ids=["mixtral", "loops-tojson-time"])
def test_templates_render_as_transformers_renders_them(tmp_path, template: str) -> None:
    from transformers import PreTrainedTokenizerFast

    path = create_random_artifact(tmp_path / "m", lm_config(chat_template=template))
    llm = LLM(str(path))
    special = llm.engine.inputs.tokenizer.id_to_token(256)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), bos_token=special, eos_token=special)
    expected = hf.apply_chat_template(MESSAGES, chat_template=template, tokenize=False, add_generation_prompt=True)
    assert render_chat(llm.engine.inputs, [p.ChatMessage(**m) for m in MESSAGES]) == expected


def test_raise_exception_in_a_template_is_a_400_naming_messages(tmp_path) -> None:
    from moe_serve.server.settings import ServerSettings
    from tests.server.conftest import start_server

    path = create_random_artifact(tmp_path / "mixtral-like", lm_config(chat_template=MIXTRAL_TEMPLATE))
    running = start_server(ServerSettings(models=(str(path),)))
    try:
        twice = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
        response = httpx.post(running.url + "/v1/chat/completions", json={"messages": twice, "max_tokens": 1})
        ok = httpx.post(running.url + "/v1/chat/completions", json={"messages": twice[:1], "max_tokens": 1})
    finally:
        running.stop()
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    assert "roles must alternate" in response.json()["error"]["message"]
    assert ok.status_code == 200


# ---- echo: the prompt's logprobs, as lm-evaluation-harness's loglikelihood requests need --------------


def test_echo_with_max_tokens_0_scores_the_prompt(server, client: httpx.Client) -> None:
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    echoed = oai.completions.create(model="tiny-lm", prompt="Hello", echo=True, max_tokens=0, logprobs=1)
    choice = echoed.choices[0]
    assert choice.text == "Hello" and echoed.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp.tokens == ["", "H", "e", "l", "l", "o"] and lp.text_offset == [0, 0, 1, 2, 3, 4]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    scored = client.post("/v1/score", json={**LM, "input": "Hello", "return_token_logprobs": True}).json()
    assert lp.token_logprobs[1:] == pytest.approx(scored["data"][0]["token_logprobs"], abs=1e-5)
    for value, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert len(top) == 1 and max(top.values()) >= value - 1e-6  # the most likely token's logprob


def test_echo_with_generation_appends_the_completion(client: httpx.Client) -> None:
    ascii_only = {"97": 60, "98": 60, "99": 60}  # a random model's bytes are rarely whole characters
    body = {**LM, "prompt": "Hello", "max_tokens": 3, "temperature": 0, "logprobs": 2, "logit_bias": ascii_only}
    plain = client.post("/v1/completions", json=body).json()["choices"][0]
    echoed = client.post("/v1/completions", json={**body, "echo": True}).json()["choices"][0]
    assert echoed["text"] == "Hello" + plain["text"]
    assert len(echoed["logprobs"]["tokens"]) == 6 + 3
    assert echoed["logprobs"]["token_logprobs"][6:] == pytest.approx(plain["logprobs"]["token_logprobs"])
    offsets, text = echoed["logprobs"]["text_offset"], echoed["text"]
    assert all(text[o:].startswith(t) for o, t in zip(offsets, echoed["logprobs"]["tokens"], strict=True))
    assert plain["logprobs"]["text_offset"][0] == 0


def test_streamed_text_offsets_continue_across_chunks(client: httpx.Client) -> None:
    ascii_only = {"97": 60, "98": 60, "99": 60}
    body = {
        **LM,
        "prompt": "Hi",
        "max_tokens": 5,
        "temperature": 0,
        "logprobs": 0,
        "stream": True,
        "logit_bias": ascii_only,
    }
    offsets, text = [], ""
    with client.stream("POST", "/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line.removeprefix("data: "))["choices"][0]
                if choice["logprobs"]:
                    offsets += choice["logprobs"]["text_offset"]
                text += choice["text"]
    whole = client.post("/v1/completions", json={**body, "stream": False}).json()["choices"][0]
    assert text == whole["text"] and offsets == whole["logprobs"]["text_offset"]


@pytest.mark.parametrize(
    "body,param",
    [({"prompt": "x", "max_tokens": 0}, "max_tokens"), ({"prompt": "x", "echo": True, "stream": True}, "echo")],
    ids=["max_tokens 0 without echo", "echo with stream"],
)
def test_echo_limits(client: httpx.Client, body: dict, param: str) -> None:
    response = client.post("/v1/completions", json={**LM, **body})
    assert response.status_code == 400 and response.json()["error"]["param"] == param


# ---- k in the model name, for clients that cannot send extra fields ------------------------------------


def test_a_k_suffix_selects_k(server, client: httpx.Client) -> None:
    ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert {"tiny-lm", "tiny-lm:k1", "tiny-lm:k4", "tiny-clf"} <= set(ids)
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    card = oai.models.retrieve("tiny-lm:k1")
    assert card.id == "tiny-lm:k1" and card.experts_per_token == {"default": 1, "min": 1, "max": 1}
    done = oai.completions.create(model="tiny-lm:k1", prompt="x", max_tokens=1)
    assert done.usage.experts_per_token == 1
    chat = oai.chat.completions.create(model="tiny-lm:k3", messages=[{"role": "user", "content": "x"}], max_tokens=1)
    assert chat.usage.experts_per_token == 3
    clash = client.post("/v1/completions", json={"model": "tiny-lm:k1", "prompt": "x", "experts_per_token": 2})
    assert clash.status_code == 400 and clash.json()["error"]["param"] == "experts_per_token"
    too_big = client.post("/v1/completions", json={"model": "tiny-lm:k9", "prompt": "x", "max_tokens": 1})
    assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "experts_per_token"
    assert client.post("/v1/completions", json={"model": "nope:k1", "prompt": "x"}).status_code == 404
