"""Bad input, auth, limits, overload, unexpected failures and graceful shutdown: every error in the
OpenAI envelope with the right status and `param`, and the server keeps serving."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from moe_serve.config import EngineConfig
from moe_serve.server.settings import ServerSettings
from moe_serve.testing import create_random_artifact
from tests.conftest import free_port, lm_config
from tests.server.conftest import start_server

BAD = {
    "malformed JSON": ('{"prompt": "x", "max_tokens": ', 400, None, "malformed JSON"),
    "prompt missing": ({"model": "tiny-lm"}, 400, "prompt", "prompt is required"),
    "max_tokens wrong type": ({"model": "tiny-lm", "prompt": "x", "max_tokens": "many"}, 400, "max_tokens", "integer"),
    "temperature wrong type": ({"model": "tiny-lm", "prompt": "x", "temperature": [1]}, 400, "temperature", "number"),
    "k zero": (
        {"model": "tiny-lm", "prompt": "x", "experts_per_token": 0},
        400,
        "experts_per_token",
        "greater than or equal to 1",
    ),
    "k above N": (
        {"model": "tiny-lm", "prompt": "x", "experts_per_token": 5},
        400,
        "experts_per_token",
        "between 1 and 4, got 5",
    ),
    "k as a word": (
        {"model": "tiny-lm", "prompt": "x", "experts_per_token": "two"},
        400,
        "experts_per_token",
        "integer",
    ),
    "max_tokens above cap": ({"model": "tiny-lm", "prompt": "x", "max_tokens": 65}, 400, "max_tokens", "at most 64"),
    "prompt longer than context": (
        {"model": "tiny-lm", "prompt": "x" * 200, "max_tokens": 1},
        400,
        "prompt",
        "context is 128 tokens",
    ),
    "prompt + max_tokens over context": (
        {"model": "tiny-lm", "prompt": "x" * 100, "max_tokens": 40},
        400,
        "max_tokens",
        "exceeds",
    ),
    "unknown model": ({"model": "gpt-5", "prompt": "x"}, 404, "model", "model 'gpt-5' does not exist"),
    "model required with two served": ({"prompt": "x"}, 400, "model", "model is required"),
    "unimplemented field": ({"model": "tiny-lm", "prompt": "x", "suffix": "end"}, 400, "suffix", "not implemented"),
}


@pytest.mark.parametrize("body,status,param,message", BAD.values(), ids=BAD.keys())
def test_bad_requests(client, body, status: int, param: str | None, message: str) -> None:
    if isinstance(body, str):
        response = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    else:
        response = client.post("/v1/completions", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and message in error["message"] and error["code"] == status
    assert client.post("/v1/completions", json={"model": "tiny-lm", "prompt": "ok", "max_tokens": 1}).status_code == 200


def test_body_too_large_is_413(client) -> None:
    response = client.post("/v1/completions", json={"model": "tiny-lm", "prompt": "x" * (1 << 20)})
    assert response.status_code == 413 and response.json()["error"]["type"] == "invalid_request_error"


def test_unexpected_failure_is_500_without_trace_and_server_keeps_serving(server, client, monkeypatch) -> None:
    runner = server.app.state.ctx.models["tiny-clf"].engine.engine.runner
    original = runner.execute

    def broken(*args, **kwargs):
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(runner, "execute", broken)
    response = client.post(
        "/v1/classify", json={"model": "tiny-clf", "input": "boom"}, headers={"x-request-id": "req-42"}
    )
    assert response.status_code == 500
    assert response.json()["error"]["message"] == "internal server error (request id req-42)"
    assert "secret" not in response.text and "Traceback" not in response.text
    monkeypatch.setattr(runner, "execute", original)
    assert client.post("/v1/classify", json={"model": "tiny-clf", "input": "fine"}).status_code == 200


def test_api_key(artifacts) -> None:
    running = start_server(ServerSettings(models=(str(artifacts["lm"]),), api_key="s3cret"))
    try:
        with httpx.Client(base_url=running.url) as http:
            missing = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
            assert missing.status_code == 401 and "missing API key" in missing.json()["error"]["message"]
            wrong = http.post(
                "/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"Authorization": "Bearer nope"}
            )
            assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
            ok = http.post(
                "/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"Authorization": "Bearer s3cret"}
            )
            assert ok.status_code == 200
            assert all(http.get(path).status_code == 200 for path in ("/health", "/ready"))
            assert http.get("/metrics").status_code == 401  # monitoring needs the key too, unless made public
            assert http.get("/metrics", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    finally:
        running.stop()


def test_overload_gets_429_with_retry_after_and_accepted_requests_complete(artifacts) -> None:
    running = start_server(
        ServerSettings(models=(str(artifacts["lm"]),), engine=EngineConfig(max_waiting=2, max_num_seqs=1))
    )

    async def flood() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=running.url, timeout=60) as http:
            body = {"prompt": "flood", "max_tokens": 24, "ignore_eos": True}
            return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(12)))

    try:
        responses = asyncio.run(flood())
    finally:
        running.stop()
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 429} and 429 in statuses and 200 in statuses
    for r in responses:
        if r.status_code == 429:
            assert r.headers["Retry-After"] == "1" and r.json()["error"]["type"] == "rate_limit_error"
        else:
            assert len(r.json()["choices"][0]["text"]) > 0


def test_work_the_queue_cannot_take_is_refused_before_it_is_tokenized(artifacts, monkeypatch) -> None:
    """A client refused with 429 retries; the server refuses its heavy request from the body's size alone,
    never tokenizing 130,000 tokens of text to say no (that stalled the engine thread: the GIL)."""
    running = start_server(
        ServerSettings(
            models=(str(artifacts["lm"]),),
            engine=EngineConfig(max_waiting=2, max_num_seqs=1, long_prefill_threshold=32),
        )
    )
    (served,) = running.app.state.ctx.models.values()
    tokenizer, release = served.engine.inputs.tokenizer, threading.Event()
    tokenized: list[str] = []
    encode_many, step = tokenizer.encode_many, served.engine.engine.step
    monkeypatch.setattr(tokenizer, "encode_many", lambda texts: tokenized.extend(texts) or encode_many(texts))
    monkeypatch.setattr(served.engine.engine, "step", lambda: release.wait(timeout=30) and step())
    admitted, refused = ["a" * 40, "b" * 40], ["c" * 40, "d" * 40]  # 41 tokens each with BOS: long work

    async def scenario() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=running.url, timeout=60) as http:
            first = asyncio.ensure_future(http.post("/v1/score", json={"input": admitted}))
            for _ in range(300):
                if served.engine.num_waiting == 2:
                    break
                await asyncio.sleep(0.01)
            second = await http.post("/v1/score", json={"input": refused})
            release.set()
            return await first, second

    try:
        first, second = asyncio.run(scenario())
    finally:
        release.set()
        running.stop()
    assert second.status_code == 429 and "long work" in second.json()["error"]["message"]
    assert first.status_code == 200 and len(first.json()["data"]) == 2
    assert tokenized == admitted  # the refused texts were never tokenized


def serve_process(artifact, *args: str) -> tuple[subprocess.Popen, str]:
    """`moe-serve serve` in its own process (signals are handled in the main thread), ready to answer."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "moe_serve.server", str(artifact), "--port", str(port), "--log-level", "warning", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    wait_ready(url)
    return process, url


def wait_ready(url: str) -> None:
    """Until the server at `url` answers /ready 200 (at most about a minute)."""
    for _ in range(600):
        try:
            if httpx.get(url + "/ready").status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.1)


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests_and_refuses_new_ones_with_503(tmp_path) -> None:
    long_context = create_random_artifact(tmp_path / "long", lm_config(max_position_embeddings=4096))
    process, url = serve_process(long_context)
    try:

        async def long_request_then_sigterm() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                body = {"prompt": "drain", "max_tokens": 1500, "ignore_eos": True}  # a few seconds of work
                task = asyncio.create_task(http.post("/v1/completions", json=body))
                await asyncio.sleep(0.3)
                os.kill(process.pid, signal.SIGTERM)
                await asyncio.sleep(0.3)
                # Still listening while it drains: a new request gets a 503, /ready shows the drain.
                refused = await http.post("/v1/completions", json={"prompt": "late", "max_tokens": 1})
                ready = await http.get("/ready")
                return await task, refused, ready

        response, refused, ready = asyncio.run(long_request_then_sigterm())
        assert response.status_code == 200
        assert response.json()["usage"]["completion_tokens"] == 1500
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "5"
        assert refused.json()["error"]["type"] == "service_unavailable"
        assert ready.status_code == 503 and ready.json() == {"status": "draining"}
        # uvicorn re-raises the signal once drained, so the exit status is SIGTERM's (or 0).
        assert process.wait(timeout=30) in (0, -signal.SIGTERM)
    finally:
        if process.poll() is None:
            process.kill()


@pytest.mark.slow
def test_past_the_drain_timeout_requests_end_with_a_503_and_streams_with_an_error_event(tmp_path) -> None:
    long_context = create_random_artifact(tmp_path / "long", lm_config(max_position_embeddings=4096))
    process, url = serve_process(long_context, "--drain-timeout", "0.5", "--max-num-seqs", "1")
    try:

        async def scenario() -> tuple[httpx.Response, str]:
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                body = {"prompt": "never done", "max_tokens": 4000, "ignore_eos": True}  # seconds of work each
                plain = asyncio.create_task(http.post("/v1/completions", json=body))
                events: list[str] = []

                async def stream() -> None:
                    request = {**body, "stream": True}
                    async with http.stream("POST", "/v1/completions", json=request) as response:
                        assert response.status_code == 200
                        async for line in response.aiter_lines():
                            events.append(line)

                streamed = asyncio.create_task(stream())
                await asyncio.sleep(0.3)
                os.kill(process.pid, signal.SIGTERM)
                await streamed
                return await plain, "\n".join(events)

        plain, events = asyncio.run(scenario())
        assert plain.status_code == 503 and plain.json()["error"]["type"] == "service_unavailable"
        data = [line.removeprefix("data: ") for line in events.splitlines() if line.startswith("data: ")]
        assert data[-1] == "[DONE]" and json.loads(data[-2])["error"]["code"] == 503
        assert process.wait(timeout=30) in (0, -signal.SIGTERM)
    finally:
        if process.poll() is None:
            process.kill()
