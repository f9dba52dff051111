"""Finite weights that overflow at run time: the request gets a 422 naming the model (never a 500, never a
token sampled from NaN) on every endpoint that reads the model's values, and the server keeps serving."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import httpx
import pytest

from moe_serve.server.settings import ServerSettings
from tests.conftest import edit_weights
from tests.server.conftest import RunningServer, start_server


def overflowing(src: Path, dst: Path, head: str) -> Path:
    """A copy of `src` whose final norm and head weights are finite but whose product passes float32's range."""
    shutil.copytree(src, dst)

    def scale(tensors: dict) -> None:
        tensors["norm.weight"] *= 1e30
        tensors[head] *= 1e30

    edit_weights(dst, scale)
    return dst


@pytest.fixture(scope="module")
def server(artifacts, tmp_path_factory) -> RunningServer:
    root = tmp_path_factory.mktemp("overflow")
    models = (
        str(artifacts["lm"]),
        str(overflowing(artifacts["lm"], root / "hot-lm", "lm_head.weight")),
        str(overflowing(artifacts["clf"], root / "hot-clf", "classifier.weight")),
    )
    running = start_server(ServerSettings(models=models))
    yield running
    running.stop()


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", {"model": "hot-lm", "prompt": "hello", "max_tokens": 2}),
        ("/v1/completions", {"model": "hot-lm", "prompt": "hello", "max_tokens": 2, "logprobs": 2}),
        ("/v1/completions", {"model": "hot-lm", "prompt": "hello", "max_tokens": 2, "echo": True, "logprobs": 0}),
        ("/v1/chat/completions", {"model": "hot-lm", "messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/score", {"model": "hot-lm", "input": ["hello there"]}),
        ("/v1/classify", {"model": "hot-clf", "input": ["hello there"]}),
    ],
    ids=["completion", "logprobs", "echo logprobs", "chat", "score", "classify"],
)
def test_non_finite_values_are_a_422_naming_the_model(server: RunningServer, path: str, body: dict) -> None:
    response = httpx.post(server.url + path, json=body, timeout=60)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert "model 'hot-" in error["message"] and "non-finite" in error["message"], error


def test_a_request_to_another_model_at_the_same_time_is_unaffected(server: RunningServer) -> None:
    async def both() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            hot = {"model": "hot-lm", "prompt": "hello", "max_tokens": 4, "logprobs": 1}
            cool = {"model": "tiny-lm", "prompt": "hello", "max_tokens": 4, "logprobs": 1}
            return await asyncio.gather(http.post("/v1/completions", json=hot), http.post("/v1/completions", json=cool))

    hot, cool = asyncio.run(both())
    assert hot.status_code == 422 and cool.status_code == 200, (hot.text, cool.text)
    assert len(cool.json()["choices"][0]["logprobs"]["token_logprobs"]) == 4
