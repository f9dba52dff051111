"""The server's end-to-end tests again, with the onnxruntime backend (`moe-serve serve --backend onnxruntime`):
the same real uvicorn, the same `openai` client, the same assertions (per-request k, streaming, 32 concurrent
mixed-k requests equal to one at a time, chat, classify and score, disconnects, metrics with the expert load
counted by the graph). Each artifact is exported to ONNX on first use, as a user's would be."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from moe_serve.engine.onnx_backend import ExportedModel
from tests.server.conftest import RunningServer, start_test_server

pytest.importorskip("onnxruntime")

from tests.server.test_openai_api import *  # noqa: E402, F403  (collected here against the fixtures below)

pytestmark = pytest.mark.slow  # two exports and a server start


@pytest.fixture(scope="module")
def server(artifacts, tmp_path_factory) -> Iterator[RunningServer]:
    running = start_test_server(artifacts, tmp_path_factory, backend="onnxruntime")
    yield running
    running.stop()  # the `client` fixture of tests/server/conftest.py talks to this server


def test_the_backend_is_onnxruntime_and_refuses_a_moe_policy_with_a_400(server, client) -> None:
    for model in server.app.state.ctx.models.values():
        assert isinstance(model.artifact, ExportedModel)  # the graph, no torch model loaded
    body = {"model": "tiny-lm", "prompt": "x", "max_tokens": 2, "moe": {"policy": "top_p", "p": 0.5}}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "moe" and "onnxruntime" in error["message"]
    response = client.post("/v1/completions", json={"model": "tiny-lm", "prompt": "x", "experts_per_token": 9})
    assert response.status_code == 400 and response.json()["error"]["param"] == "experts_per_token"
