"""experts_per_token "auto" over HTTP (in-process, tiny random models): 400s naming the field (no latency
target, with a `moe` policy, not a k), every endpoint taking it, usage reporting the mean k it ran with, and
its metrics (the k "auto" runs with now, the mean k by policy, latency labelled k="auto")."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from moe_serve.config import EngineConfig, RequestLimits
from moe_serve.layers.routers import router_config
from moe_serve.server.app import create_app
from moe_serve.server.settings import ServerSettings
from moe_serve.testing import create_random_artifact
from tests.conftest import NUM_EXPERTS, classifier_config, moe_config
from tests.server.test_http_inprocess import call, sse_events

GENERATE = {"model": "tiny-lm", "prompt": "ROMEO.", "max_tokens": 6, "temperature": 0, "ignore_eos": True}


def serve(*models: str, engine: EngineConfig) -> Iterator[object]:
    app = create_app(ServerSettings(models=models, limits=RequestLimits(max_tokens_cap=64), engine=engine))
    yield app
    for served in app.state.ctx.models.values():
        served.engine.shutdown()


@pytest.fixture(scope="module")
def app(artifacts, tmp_path_factory) -> Iterator[object]:
    """A target no test comes near: "auto" runs at the model's max k."""
    topk = classifier_config(moe=moe_config(router=router_config("topk_uniform")))
    clf = create_random_artifact(tmp_path_factory.mktemp("auto") / "tiny-clf-topk", topk, seed=23)
    yield from serve(str(artifacts["lm"]), str(clf), engine=EngineConfig(max_num_seqs=8, target_itl_ms=10_000))


@pytest.fixture(scope="module")
def untargeted(artifacts) -> Iterator[object]:
    yield from serve(str(artifacts["lm"]), engine=EngineConfig(max_num_seqs=8))


def error(response) -> dict:
    assert response.status_code == 400, response.text
    return response.json()["error"]


def test_auto_without_a_target_is_a_400_naming_the_field(untargeted) -> None:
    refused = error(call(untargeted, "POST", "/v1/completions", json={**GENERATE, "experts_per_token": "auto"}))
    assert refused["param"] == "experts_per_token" and "--target-itl-ms" in refused["message"]
    score = call(
        untargeted, "POST", "/v1/score", json={"model": "tiny-lm", "input": "hi there", "experts_per_token": "auto"}
    )
    assert error(score)["param"] == "experts_per_token"


def test_bad_auto_requests_are_400s_naming_the_field(app) -> None:
    both = {**GENERATE, "experts_per_token": "auto", "moe": {"policy": "top_p", "p": 0.5}}
    refused = error(call(app, "POST", "/v1/completions", json=both))
    assert refused["param"] == "moe" and "not both" in refused["message"]
    pooled = {
        "model": "tiny-lm",
        "input": "hi there",
        "experts_per_token": "auto",
        "moe": {"policy": "top_p", "p": 0.5},
    }
    assert error(call(app, "POST", "/v1/score", json=pooled))["param"] == "moe"
    assert error(call(app, "POST", "/v1/completions", json={**GENERATE, "experts_per_token": "fast"}))["param"] == (
        "experts_per_token"
    )
    suffix = {**GENERATE, "model": "tiny-lm:k2", "experts_per_token": "auto"}
    assert error(call(app, "POST", "/v1/completions", json=suffix))["param"] == "experts_per_token"


def check_auto_usage(usage: dict) -> None:
    assert usage["experts_per_token"] is None  # no one fixed k: the server chose it step by step
    assert usage["experts_per_token_mean"] == NUM_EXPERTS  # no load: every step ran at the model's max k
    assert usage["experts_per_token_details"] is None


def test_every_endpoint_takes_auto_and_reports_the_k_used(app) -> None:
    whole = call(app, "POST", "/v1/completions", json={**GENERATE, "experts_per_token": "auto"})
    assert whole.status_code == 200, whole.text
    check_auto_usage(whole.json()["usage"])
    fixed = call(app, "POST", "/v1/completions", json={**GENERATE, "experts_per_token": NUM_EXPERTS}).json()
    assert whole.json()["choices"][0]["text"] == fixed["choices"][0]["text"]
    streamed = call(
        app,
        "POST",
        "/v1/completions",
        json={**GENERATE, "experts_per_token": "auto", "stream": True, "stream_options": {"include_usage": True}},
    )
    check_auto_usage(sse_events(streamed)[-1]["usage"])
    chat = {"model": "tiny-lm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    check_auto_usage(
        call(app, "POST", "/v1/chat/completions", json={**chat, "experts_per_token": "auto"}).json()["usage"]
    )
    score = call(app, "POST", "/v1/score", json={"model": "tiny-lm", "input": "hi there", "experts_per_token": "auto"})
    check_auto_usage(score.json()["usage"])
    classify = {"model": "tiny-clf-topk", "input": ["Exit, pursued by a bear."], "experts_per_token": "auto"}
    check_auto_usage(call(app, "POST", "/v1/classify", json=classify).json()["usage"])


def test_metrics_export_auto_k(app) -> None:
    assert call(app, "POST", "/v1/completions", json={**GENERATE, "experts_per_token": "auto"}).status_code == 200
    text = call(app, "GET", "/metrics").text
    assert f'moe_serve_auto_experts_per_token{{model="tiny-lm"}} {float(NUM_EXPERTS)}' in text
    assert 'moe_serve_experts_per_token_count{model="tiny-lm",policy="auto"}' in text
    assert 'moe_serve_inter_token_latency_seconds_count{k="auto",model="tiny-lm"}' in text
    data = call(app, "GET", "/dashboard/data").json()
    assert data["auto_k"] == {"tiny-lm": NUM_EXPERTS, "tiny-clf-topk": NUM_EXPERTS}


def test_no_auto_k_metric_without_a_target(untargeted) -> None:
    assert "moe_serve_auto_experts_per_token{" not in call(untargeted, "GET", "/metrics").text
    assert call(untargeted, "GET", "/dashboard/data").json()["auto_k"] == {}


def test_batch_files_take_auto(artifacts, tmp_path) -> None:
    """`moe-serve batch` lines go through the same preparation: "auto" with the engine's target, 400 without."""
    from moe_serve.batch.runner import run_batch

    generate = {key: value for key, value in GENERATE.items() if key != "model"}  # the batch's --model
    lines = [
        {
            "custom_id": "gen",
            "method": "POST",
            "url": "/v1/completions",
            "body": {**generate, "experts_per_token": "auto"},
        },
        {
            "custom_id": "score",
            "method": "POST",
            "url": "/v1/score",
            "body": {"input": "hi there", "experts_per_token": "auto"},
        },
    ]
    inputs = tmp_path / "in.jsonl"
    inputs.write_text("".join(json.dumps(line) + "\n" for line in lines))
    lm = str(artifacts["lm"])
    _, written = run_batch(
        inputs,
        tmp_path / "out.jsonl",
        default_model=lm,
        engine_config=EngineConfig(target_itl_ms=10_000),
        progress=False,
    )
    for result in written:
        assert result["response"]["status_code"] == 200, result
        check_auto_usage(result["response"]["body"]["usage"])
    _, refused = run_batch(inputs, tmp_path / "out2.jsonl", default_model=lm, progress=False)
    assert {r["response"]["body"]["error"]["param"] for r in refused} == {"experts_per_token"}
