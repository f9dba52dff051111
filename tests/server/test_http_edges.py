"""The HTTP edge under abuse: tokenizer requests are bounded, the connection limit answers in the envelope,
chat templates are bounded in work and memory (and per-request templates refused by name), the small ones
(auth scheme, strict floats, 499 for a cancelled stream, `name:k1` echoed), and usage reports the prompt
tokens the prefix cache served."""

from __future__ import annotations

import json
import logging
import socket
import time

import httpx
import openai
import pytest

from moe_serve.api.protocol import MAX_DETOKENIZE_TOKENS, MAX_MESSAGES
from moe_serve.chat_template import TemplateEnvironment
from moe_serve.server.settings import ServerSettings
from moe_serve.testing import create_random_artifact
from tests.conftest import lm_config
from tests.server.conftest import start_server

LM = {"model": "tiny-lm", "max_tokens": 2}
USER = {"role": "user", "content": "hi"}


def assert_refused(response: httpx.Response, param: str, *words: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert all(word in error["message"] for word in words), error["message"]


# ---- 5: tokenizer requests are bounded ----------------------------------------------------------------


def test_tokenize_and_chat_refuse_more_messages_than_the_bound(client) -> None:
    messages = [USER] * (MAX_MESSAGES + 1)
    assert_refused(client.post("/tokenize", json={"model": "tiny-lm", "messages": messages}), "messages", "2048")
    assert_refused(client.post("/v1/chat/completions", json={**LM, "messages": messages}), "messages", "2048")
    response = client.post("/tokenize", json={"model": "tiny-lm", "messages": [USER] * 3})
    assert response.status_code == 200 and response.json()["count"] > 0


def test_detokenize_refuses_more_ids_than_the_bound(client) -> None:
    response = client.post("/detokenize", json={"model": "tiny-lm", "tokens": [65] * (MAX_DETOKENIZE_TOKENS + 1)})
    assert_refused(response, "tokens", str(MAX_DETOKENIZE_TOKENS))
    assert client.post("/detokenize", json={"model": "tiny-lm", "tokens": [65, 66]}).json()["prompt"] == "AB"


# ---- 6: the connection limit answers in the error envelope, with Retry-After --------------------------


def test_past_the_connection_limit_requests_get_a_503_envelope_with_retry_after(artifacts) -> None:
    running = start_server(ServerSettings(models=(str(artifacts["lm"]),), max_connections=2))
    port = int(running.url.rsplit(":", 1)[1])
    idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(2)]
    try:
        time.sleep(0.2)  # the server has accepted them
        with httpx.Client(base_url=running.url, timeout=10) as http:
            response = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
            assert response.status_code == 503, response.text
            assert response.headers["retry-after"] == "1"
            assert response.headers["content-type"] == "application/json"
            assert response.json()["error"]["type"] == "service_unavailable"
            assert "maximum of 2 connections" in response.json()["error"]["message"]
        with httpx.Client(base_url=running.url, timeout=10) as http:
            assert http.get("/health").status_code == 200  # the probes are exempt: a full server is alive
        for sock in idle:
            sock.close()
        idle.clear()
        time.sleep(0.2)
        response = httpx.post(running.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=10)
        assert response.status_code == 200
    finally:
        for sock in idle:
            sock.close()
        running.stop()


# ---- 7: templates are bounded in work and memory; per-request templates are refused by name -----------

RUNAWAY_TEMPLATES = {
    # builds a string that doubles on every turn (16 M characters) and never emits it
    "concat in a loop": (
        "{% set ns = namespace(s='x') %}{% for i in range(24) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    ),
    # 64 ** 4 = 16.7 M iterations that emit nothing
    "nested loops": (
        "{% for a in range(64) %}{% for b in range(64) %}{% for c in range(64) %}{% for d in range(64) %}"
        "{% endfor %}{% endfor %}{% endfor %}{% endfor %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    ),
    # a macro's output is built in memory (4,000 characters of literal text), never emitted
    "macro output": (
        "{% macro m() %}{% for i in range(200) %}yyyyyyyyyyyyyyyyyyyy{% endfor %}{% endmacro %}"
        "{% set x = m() %}{{ messages[0]['content'] }}"
    ),
    "recursion": "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
}


@pytest.mark.slow
@pytest.mark.parametrize("template", RUNAWAY_TEMPLATES.values(), ids=RUNAWAY_TEMPLATES.keys())
def test_a_template_that_builds_without_emitting_or_loops_for_ever_is_stopped(tmp_path, template: str) -> None:
    path = create_random_artifact(tmp_path / "tpl", lm_config(chat_template=template, max_position_embeddings=64))
    running = start_server(ServerSettings(models=(str(path),)))
    try:
        body = {"messages": [{"role": "user", "content": "y" * 40}], "max_tokens": 1}
        started = time.monotonic()
        response = httpx.post(running.url + "/v1/chat/completions", json=body, timeout=60)
        elapsed = time.monotonic() - started
    finally:
        running.stop()
    assert_refused(response, "messages", "chat template")
    assert elapsed < 10


def test_the_render_budget_bounds_steps_and_time() -> None:
    nested = "{% for a in range(1000) %}{% for b in range(1000) %}{% for c in range(1000) %}{% endfor %}{% endfor %}"
    with pytest.raises(Exception, match="more than 1000 steps"):
        "".join(TemplateEnvironment(4000, max_steps=1000).render_parts(nested + "{% endfor %}"))
    with pytest.raises(Exception, match="more than 0.05 seconds"):
        "".join(TemplateEnvironment(4000, max_steps=10**12, max_seconds=0.05).render_parts(nested + "{% endfor %}"))
    ordinary = (
        "{% for m in messages %}{{ '<|' ~ m['role'] ~ '|>' ~ m['content']|trim }}{% if not loop.last %}{{ '\\n' }}"
        "{% endif %}{% endfor %}{{ messages|map(attribute='role')|join(',') }}"
    )
    messages = [{"role": "user", "content": " a "}, {"role": "assistant", "content": "b"}]
    assert "".join(TemplateEnvironment(4000).render_parts(ordinary, messages=messages)) == (
        "<|user|>a\n<|assistant|>buser,assistant"
    )


@pytest.mark.parametrize(
    "field,value", [("chat_template", "{{ messages }}"), ("chat_template_kwargs", {"enable_thinking": False})]
)
def test_a_requests_own_chat_template_is_refused_by_name(client, field: str, value: object) -> None:
    body = {**LM, "messages": [USER], field: value}
    assert_refused(client.post("/v1/chat/completions", json=body), field, "not implemented")
    assert_refused(client.post("/tokenize", json={"model": "tiny-lm", "messages": [USER], field: value}), field)
    assert client.post("/v1/chat/completions", json={**LM, "messages": [USER], "chat_template_kwargs": {}}).is_success


# ---- 8: the small ones ----------------------------------------------------------------------------------


def test_the_bearer_scheme_is_case_insensitive(artifacts) -> None:
    running = start_server(ServerSettings(models=(str(artifacts["lm"]),), api_key="s3cret"))
    try:
        with httpx.Client(base_url=running.url, timeout=30) as http:
            body = {"prompt": "x", "max_tokens": 1}
            for scheme in ("Bearer", "bearer", "BEARER"):
                response = http.post("/v1/completions", json=body, headers={"Authorization": f"{scheme} s3cret"})
                assert response.status_code == 200, scheme
            for wrong in ("bearer S3CRET", "Basic s3cret", "bearers3cret", "s3cret"):
                assert http.post("/v1/completions", json=body, headers={"Authorization": wrong}).status_code == 401
    finally:
        running.stop()


@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty", "min_p", "repetition_penalty"])
def test_float_fields_are_strict_like_integer_fields(client, field: str) -> None:
    assert_refused(client.post("/v1/completions", json={**LM, "prompt": "x", field: "1"}), field, "number")
    assert_refused(client.post("/v1/completions", json={**LM, "prompt": "x", field: True}), field, "number")
    assert client.post("/v1/completions", json={**LM, "prompt": "x", field: 1}).status_code == 200


def test_a_stream_the_client_cancels_is_logged_as_499(server, caplog, monkeypatch) -> None:
    engine = server.app.state.ctx.models["tiny-lm"].engine
    step = engine.engine.step
    monkeypatch.setattr(engine.engine, "step", lambda: time.sleep(0.02) or step())  # 60 tokens outlast the client
    body = {**LM, "prompt": "bye", "max_tokens": 60, "ignore_eos": True, "stream": True}
    with caplog.at_level(logging.INFO, logger="moe_serve.access"):
        with (
            httpx.Client(base_url=server.url, timeout=30) as http,
            http.stream("POST", "/v1/completions", json=body) as r,
        ):
            assert r.status_code == 200
            next(r.iter_lines())  # the stream has started; then the client leaves
        deadline = time.monotonic() + 10
        while engine.num_requests and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "moe_serve.access"]
    streamed = [line for line in lines if line["path"] == "/v1/completions"]
    assert streamed and streamed[-1]["status"] == 499, lines
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_k_variant_is_echoed_as_the_model_asked_for(client) -> None:
    completion = client.post("/v1/completions", json={**LM, "model": "tiny-lm:k1", "prompt": "x"}).json()
    assert completion["model"] == "tiny-lm:k1" and completion["usage"]["experts_per_token"] == 1
    chat = client.post("/v1/chat/completions", json={**LM, "model": "tiny-lm:k1", "messages": [USER]}).json()
    assert chat["model"] == "tiny-lm:k1"
    body = {**LM, "model": "tiny-lm:k1", "prompt": "x", "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert chunks and all(chunk["model"] == "tiny-lm:k1" for chunk in chunks)
    assert client.post("/v1/completions", json={**LM, "prompt": "x"}).json()["model"] == "tiny-lm"


# ---- 12: usage reports the prompt tokens the prefix cache served ------------------------------------------


def test_a_repeated_prompt_reports_cached_tokens_with_the_openai_client(server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    prompt = "The same long prompt, repeated word for word, is found in the prefix cache. "  # 77 tokens
    first = client.completions.create(model="tiny-lm", prompt=prompt + "A", max_tokens=2)
    second = client.completions.create(model="tiny-lm", prompt=prompt + "A", max_tokens=2)
    assert first.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens >= 64  # four full blocks of 16
    assert second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens

    messages = [{"role": "user", "content": prompt + "B"}]
    client.chat.completions.create(model="tiny-lm", messages=messages, max_tokens=2)
    chat = client.chat.completions.create(model="tiny-lm", messages=messages, max_tokens=2)
    assert chat.usage.prompt_tokens_details.cached_tokens >= 64

    stream = client.chat.completions.create(
        model="tiny-lm", messages=messages, max_tokens=2, stream=True, stream_options={"include_usage": True}
    )
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert usage and usage[0].prompt_tokens_details.cached_tokens >= 64


def test_a_fresh_prompt_reports_no_cached_tokens(client) -> None:
    body = {**LM, "prompt": f"never seen before {time.time_ns()}", "max_tokens": 1}
    assert client.post("/v1/completions", json=body).json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
