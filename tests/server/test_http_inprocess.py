"""The HTTP API in-process (the FastAPI app through an ASGI transport, no socket) on tiny random models:
fast enough for `make test-fast`. The real-uvicorn and real-client tests are in the other modules."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import pytest

from moe_serve.config import EngineConfig, RequestLimits
from moe_serve.server.app import create_app
from moe_serve.server.settings import ServerSettings


def inprocess_app(*models: str) -> Iterator[object]:
    """The app serving `models` (small limits), its engines shut down afterwards: a fixture's body."""
    settings = ServerSettings(
        models=models, limits=RequestLimits(max_tokens_cap=64), engine=EngineConfig(max_num_seqs=8)
    )
    app = create_app(settings)
    yield app
    for served in app.state.ctx.models.values():
        served.engine.shutdown()


@pytest.fixture(scope="module")
def app(artifacts) -> Iterator[object]:
    yield from inprocess_app(str(artifacts["lm"]), str(artifacts["clf"]))


def call(app, method: str, path: str, **kwargs) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(go())


def sse_events(response: httpx.Response) -> list:
    lines = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_completion_streamed_equals_whole_and_reports_k(app) -> None:
    body = {
        "model": "tiny-lm",
        "prompt": "ROMEO.",
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "experts_per_token": 3,
    }
    whole = call(app, "POST", "/v1/completions", json=body)
    assert whole.status_code == 200, whole.text
    data = whole.json()
    assert data["usage"]["experts_per_token"] == 3 and data["usage"]["completion_tokens"] == 8
    stream = call(
        app, "POST", "/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    events = sse_events(stream)
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == data["choices"][0]["text"]
    assert events[-1]["usage"]["experts_per_token"] == 3


def test_chat_classify_score_and_models(app) -> None:
    chat = call(
        app,
        "POST",
        "/v1/chat/completions",
        json={"model": "tiny-lm", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
    )
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["role"] == "assistant"
    classified = call(
        app, "POST", "/v1/classify", json={"model": "tiny-clf", "input": ["a", "b"], "experts_per_token": 2}
    )
    assert [d["index"] for d in classified.json()["data"]] == [0, 1] and classified.json()["usage"][
        "approximate"
    ] is True
    scored = call(app, "POST", "/v1/score", json={"model": "tiny-lm", "input": "To be", "return_token_logprobs": True})
    assert scored.json()["data"][0]["num_tokens"] == 5 and len(scored.json()["data"][0]["token_logprobs"]) == 5
    cards = {m["id"]: m for m in call(app, "GET", "/v1/models").json()["data"]}
    assert cards["tiny-lm"]["experts_per_token"] == {"default": 2, "min": 1, "max": 4}


@pytest.mark.parametrize(
    "body,status,param",
    [
        ({"model": "tiny-lm", "prompt": "x", "experts_per_token": 9}, 400, "experts_per_token"),
        ({"model": "nope", "prompt": "x"}, 404, "model"),
        ({"model": "tiny-lm", "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
        ({"model": "tiny-lm", "prompt": "x", "max_tokens": 65}, 400, "max_tokens"),
    ],
)
def test_errors_use_the_envelope(app, body: dict, status: int, param: str) -> None:
    response = call(app, "POST", "/v1/completions", json=body)
    assert response.status_code == status
    assert response.json()["error"]["param"] == param and response.json()["error"]["code"] == status


def test_streaming_validation_error_is_a_400_before_the_stream(app) -> None:
    response = call(app, "POST", "/v1/completions", json={"model": "tiny-lm", "prompt": "x", "stream": True, "n": 0})
    assert response.status_code == 400 and response.json()["error"]["param"] == "n"


def test_metrics_exports_engine_gauges(app) -> None:
    call(app, "POST", "/v1/completions", json={"model": "tiny-lm", "prompt": "x", "max_tokens": 2})
    text = call(app, "GET", "/metrics").text
    for name in (
        "moe_serve_num_requests_running",
        "moe_serve_kv_cache_usage_ratio",
        "moe_serve_expert_tokens_total",
        "moe_serve_e2e_request_latency_seconds_bucket",
    ):
        assert name in text


@pytest.mark.parametrize(
    ("prompt", "place"), [([None, 5, 6], "prompt[0]"), ([[1, 2], [3, None]], "prompt[1][1]"), ([7, None], "prompt[1]")]
)
def test_a_null_token_id_is_named_by_its_place(app, prompt: list, place: str) -> None:
    """lm-evaluation-harness's rolling perplexity sends null as the prefix token of a model with neither BOS nor
    EOS: the 400 names where, and the option that fixes it."""
    r = call(app, "POST", "/v1/completions", json={"model": "tiny-lm", "prompt": prompt, "max_tokens": 1, "echo": True})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "prompt"
    assert error["message"].startswith(f"{place} is null") and "custom_prefix_token_id" in error["message"]
