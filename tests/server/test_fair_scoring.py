"""Fair scoring over HTTP: a request's total work (prompts or inputs x tokens) is bounded by
`max_request_tokens`, refused with a 400 that names it; large scoring and echo responses are built and
rendered off the event loop (the same JSON as before), so /health answers while they are."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from moe_serve.api import responses
from moe_serve.config import EngineConfig, RequestLimits
from moe_serve.server.settings import ServerSettings
from tests.server.conftest import start_server

LM = "tiny-lm"


@pytest.fixture(scope="module")
def bounded(artifacts):
    running = start_server(
        ServerSettings(
            models=(str(artifacts["lm"]), str(artifacts["clf"])),
            limits=RequestLimits(max_tokens_cap=64, max_request_tokens=100),
            engine=EngineConfig(max_num_seqs=16),
        )
    )
    yield running
    running.stop()


def assert_names_the_bound(response: httpx.Response, param: str, total: int | None = None) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert "max_request_tokens" in error["message"] and "at most 100 tokens" in error["message"], error["message"]
    if total is not None:
        assert f"{total} tokens in all" in error["message"], error["message"]


def test_score_classify_and_completions_past_the_work_bound_are_400_naming_it(bounded) -> None:
    with httpx.Client(base_url=bounded.url, timeout=60) as client:
        ids = [[5] * 30] * 4  # 120 tokens in all
        echo = {"model": LM, "prompt": ids, "echo": True, "logprobs": 2, "max_tokens": 0}
        assert_names_the_bound(client.post("/v1/completions", json=echo), "prompt", 120)
        texts = ["word " * 10] * 4  # tiny-lm: a token per character, 200 in all
        assert_names_the_bound(client.post("/v1/score", json={"model": LM, "input": texts}), "input")
        assert_names_the_bound(client.post("/v1/classify", json={"model": "tiny-clf", "input": texts}), "input")
        # Within the bound: answered.
        assert client.post("/v1/completions", json={**echo, "prompt": ids[:3]}).status_code == 200
        assert client.post("/v1/score", json={"model": LM, "input": ["word"] * 3}).status_code == 200


def test_the_bound_is_an_option_with_a_default() -> None:
    assert RequestLimits().max_request_tokens >= 16 * 4096  # one 16 x 4,096-token score fits by default
    with pytest.raises(ValueError, match="max_request_tokens"):
        RequestLimits(max_request_tokens=0)


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize(
    ("builder", "path", "body"),
    [
        ("score_response", "/v1/score", {"model": LM, "input": "hello", "return_token_logprobs": True}),
        ("completion_response", "/v1/completions", {"model": LM, "prompt": "hi", "echo": True, "logprobs": 5}),
        ("classify_response", "/v1/classify", {"model": "tiny-clf", "input": "word"}),
    ],
)
def test_large_responses_are_built_off_the_event_loop(server, monkeypatch, builder: str, path: str, body) -> None:
    """A 2 MB echo or score body took seconds to build on the event loop, and /health waited for it (6.1 s):
    the body is built (and rendered) in a worker thread, with no event loop running there."""
    built, seen = getattr(responses, builder), []

    def spy(*args, **kwargs):
        seen.append(_loop_running())
        return built(*args, **kwargs)

    monkeypatch.setattr(responses, builder, spy)
    response = httpx.post(server.url + path, json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert seen == [False]


def test_echoed_logprobs_are_the_same_json_as_the_response_model(client) -> None:
    body = {"model": LM, "prompt": "to be or not", "echo": True, "logprobs": 3, "max_tokens": 2}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200 and response.headers["content-type"] == "application/json"
    choice = response.json()["choices"][0]
    logprobs = choice["logprobs"]
    assert logprobs["token_logprobs"][0] is None and len(logprobs["tokens"]) == len(logprobs["top_logprobs"])
    assert all(len(top) <= 3 for top in logprobs["top_logprobs"][1:])
    assert "usage" in response.json() and response.json()["usage"]["prompt_tokens"] > 0
