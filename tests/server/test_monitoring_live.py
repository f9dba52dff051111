"""The monitoring tells the truth while work runs: generated tokens are counted as
they are generated, not when a request finishes, and the built-in dashboard's latency is of a recent window,
split by model and endpoint."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator

import httpx
import pytest

from moe_serve.config import EngineConfig
from moe_serve.server.metrics import Metrics
from moe_serve.server.settings import ServerSettings
from moe_serve.testing import create_random_artifact
from tests.conftest import lm_config
from tests.server.conftest import RunningServer, start_server


@pytest.fixture(scope="module")
def long_server(artifacts, tmp_path_factory) -> Iterator[RunningServer]:
    """The tiny LM with room for a long stream, and the tiny classifier."""
    root = tmp_path_factory.mktemp("long")
    long_lm = create_random_artifact(root / "long-lm", lm_config(max_position_embeddings=2048), seed=23)
    running = start_server(ServerSettings(models=(str(long_lm), str(artifacts["clf"])), engine=EngineConfig()))
    yield running
    running.stop()


def generated(http: httpx.Client, model: str) -> float:
    text = http.get("/metrics").text
    found = re.findall(rf'^moe_serve_generation_tokens_total{{[^}}]*model="{model}"[^}}]*}} (\S+)$', text, re.M)
    return sum(float(v) for v in found)


@pytest.mark.slow
def test_generation_tokens_are_counted_while_a_stream_runs(long_server: RunningServer) -> None:
    body = {"model": "long-lm", "prompt": "Enter", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(base_url=long_server.url, timeout=120) as http,
        httpx.Client(base_url=long_server.url, timeout=120) as scraper,
    ):
        before = generated(scraper, "long-lm")
        mid: float | None = None
        chunks = 0
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunks += 1
                if chunks == 100:  # well before the end: the counter has moved already
                    mid = generated(scraper, "long-lm") - before
                    finished_mid = '"finish_reason":"length"' in line
        after = generated(scraper, "long-lm") - before
    assert mid is not None and not finished_mid
    assert 50 <= mid < 1500, f"{mid} tokens counted after 100 of 1500 streamed"
    assert after == 1500  # every token once: none counted twice when the request finished


def test_non_streamed_tokens_are_counted_once(long_server: RunningServer) -> None:
    with httpx.Client(base_url=long_server.url, timeout=120) as http:
        before = generated(http, "long-lm")
        body = {"model": "long-lm", "prompt": "Exit", "max_tokens": 40, "ignore_eos": True, "n": 2}
        assert http.post("/v1/completions", json=body).status_code == 200
        assert generated(http, "long-lm") - before == 80


def test_dashboard_latency_is_split_by_model_and_endpoint(long_server: RunningServer) -> None:
    with httpx.Client(base_url=long_server.url, timeout=120) as http:
        assert (
            http.post("/v1/completions", json={"model": "long-lm", "prompt": "a", "max_tokens": 4}).status_code == 200
        )
        assert http.post("/v1/classify", json={"model": "tiny-clf", "input": "a bear"}).status_code == 200
        time.sleep(1.05)  # tokens/s covers whole seconds only: the one the completion ran in must be over
        data = http.get("/dashboard/data").json()
    assert data["window_seconds"] > 0
    rows = {(r["model"], r["endpoint"]) for r in data["latency"]}
    assert ("long-lm", "completions") in rows and ("tiny-clf", "classify") in rows
    assert all(r["p50"] <= r["p95"] and r["count"] >= 1 for r in data["latency"])
    assert set(data["models"]) == {"long-lm", "tiny-clf"}
    assert "long-lm" in data["throughput"] and data["throughput"]["long-lm"]
    json.dumps(data)  # plain JSON


def test_dashboard_latency_is_of_a_recent_window_not_since_start() -> None:
    clock = [1000.0]
    metrics = Metrics(clock=lambda: clock[0])
    metrics.record_pooling("a", "score", 2, 9.0, 10)  # slow, long ago
    clock[0] += 600
    metrics.record_pooling("a", "score", 2, 0.02, 10)
    metrics.record_pooling("b", "score", 2, 3.0, 10)
    recent = {(r["model"], r["k"]): r for r in metrics.recent.latency(window=60)}
    assert recent[("a", "2")]["count"] == 1 and recent[("a", "2")]["p95"] < 0.1  # the 9 s of 10 minutes ago is gone
    assert recent[("b", "2")]["p50"] > 1  # another model's latency is not pooled with this one's
