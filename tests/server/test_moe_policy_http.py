"""The `moe` policy over HTTP (in-process, tiny random models): 400s naming the field, the mean k in usage
(with per-layer details), every endpoint taking it, and its metric."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from moe_serve.layers.routers import router_config
from moe_serve.testing import create_random_artifact
from tests.conftest import NUM_EXPERTS, classifier_config, moe_config
from tests.server.test_http_inprocess import call, inprocess_app, sse_events

POLICY = {"policy": "top_p", "p": 0.6, "min": 1, "max": 3}


@pytest.fixture(scope="module")
def app(artifacts, tmp_path_factory) -> Iterator[object]:
    topk = classifier_config(moe=moe_config(router=router_config("topk_uniform")))
    clf_topk = create_random_artifact(tmp_path_factory.mktemp("policy") / "tiny-clf-topk", topk, seed=23)
    yield from inprocess_app(str(artifacts["lm"]), str(artifacts["clf"]), str(clf_topk))


BAD = {
    "p zero": ({"policy": "top_p", "p": 0}, "moe.p"),
    "p above one": ({"policy": "top_p", "p": 1.01}, "moe.p"),
    "p missing": ({"policy": "top_p"}, "moe.p"),
    "min above max": ({"policy": "top_p", "p": 0.5, "min": 3, "max": 2}, "moe.min"),
    "min zero": ({"policy": "top_p", "p": 0.5, "min": 0}, "moe.min"),
    "max above the model's": ({"policy": "top_p", "p": 0.5, "max": NUM_EXPERTS + 1}, "moe.max"),
    "unknown policy": ({"policy": "entropy", "p": 0.5}, "moe.policy"),
    "unknown field": ({"policy": "top_p", "p": 0.5, "k": 2}, "moe.k"),
    "not an object": ("top_p", "moe"),
}


@pytest.mark.parametrize(("policy", "param"), BAD.values(), ids=BAD.keys())
@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions", "/v1/score"])
def test_bad_policies_are_400s_naming_the_field(app, policy, param: str, endpoint: str) -> None:
    body = {"model": "tiny-lm", "moe": policy, "max_tokens": 2}
    if endpoint == "/v1/score":
        body = {"model": "tiny-lm", "moe": policy, "input": "hello there"}
    elif endpoint == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    response = call(app, "POST", endpoint, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert param in error["message"] or param == "moe"


def test_refusals_that_depend_on_the_model(app) -> None:
    smear = call(app, "POST", "/v1/classify", json={"model": "tiny-clf", "input": "hi", "moe": POLICY})
    assert smear.status_code == 400 and smear.json()["error"]["param"] == "moe.policy"
    assert "router kind soft_merge" in smear.json()["error"]["message"]
    both = {"model": "tiny-lm", "prompt": "hi", "max_tokens": 2, "moe": POLICY, "experts_per_token": 2}
    assert call(app, "POST", "/v1/completions", json=both).json()["error"]["param"] == "moe"
    suffix = {"model": "tiny-lm:k2", "prompt": "hi", "max_tokens": 2, "moe": POLICY}
    assert call(app, "POST", "/v1/completions", json=suffix).json()["error"]["param"] == "moe"


def check_usage(usage: dict, tokens_layers: tuple[int, ...] = (1,)) -> None:
    assert usage["experts_per_token"] is None
    assert 1 <= usage["experts_per_token_mean"] <= 3
    details = usage["experts_per_token_details"]
    assert details["policy"] == "top_p" and details["p"] == 0.6 and (details["min"], details["max"]) == (1, 3)
    assert [d["layer"] for d in details["per_layer"]] == list(tokens_layers)
    layer_means = [d["mean"] for d in details["per_layer"]]
    assert sum(layer_means) / len(layer_means) == pytest.approx(usage["experts_per_token_mean"])


def test_usage_reports_the_mean_k_on_every_endpoint(app) -> None:
    body = {"model": "tiny-lm", "prompt": "ROMEO.", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    whole = call(app, "POST", "/v1/completions", json={**body, "moe": POLICY})
    assert whole.status_code == 200, whole.text
    check_usage(whole.json()["usage"])
    streamed = call(
        app,
        "POST",
        "/v1/completions",
        json={**body, "moe": POLICY, "stream": True, "stream_options": {"include_usage": True}},
    )
    events = sse_events(streamed)
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == whole.json()["choices"][0]["text"]
    assert events[-1]["usage"] == whole.json()["usage"]

    fixed = call(app, "POST", "/v1/completions", json={**body, "experts_per_token": 2}).json()["usage"]
    assert fixed["experts_per_token"] == 2 and fixed["experts_per_token_mean"] == 2.0
    assert fixed["experts_per_token_details"] is None

    chat = {"model": "tiny-lm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "moe": POLICY}
    reply = call(app, "POST", "/v1/chat/completions", json=chat)
    assert reply.status_code == 200, reply.text
    check_usage(reply.json()["usage"])

    scored = call(app, "POST", "/v1/score", json={"model": "tiny-lm", "input": ["hello there", "ay"], "moe": POLICY})
    assert scored.status_code == 200, scored.text
    check_usage(scored.json()["usage"])

    classified = call(app, "POST", "/v1/classify", json={"model": "tiny-clf-topk", "input": "hi", "moe": POLICY})
    assert classified.status_code == 200, classified.text
    check_usage(classified.json()["usage"])
    assert classified.json()["usage"]["approximate"] is False


def test_metrics_record_the_mean_k_by_policy(app) -> None:
    call(app, "POST", "/v1/score", json={"model": "tiny-lm", "input": "hello there", "moe": POLICY})
    call(app, "POST", "/v1/score", json={"model": "tiny-lm", "input": "hello there", "experts_per_token": 3})
    text = call(app, "GET", "/metrics").text
    assert 'moe_serve_experts_per_token_count{model="tiny-lm",policy="top_p"}' in text
    assert 'moe_serve_experts_per_token_sum{model="tiny-lm",policy="fixed"}' in text
    assert 'k="top_p"' in text  # latency histograms label a policy's requests by the policy
