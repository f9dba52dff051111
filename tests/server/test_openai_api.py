"""End to end through a real uvicorn server and the official `openai` client."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest


def test_openai_client_completion_reports_k(server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    response = client.completions.create(
        model="tiny-lm", prompt="ROMEO.", max_tokens=6, temperature=0, extra_body={"experts_per_token": 3}
    )
    assert len(response.choices) == 1 and response.choices[0].finish_reason in {"length", "stop"}
    assert response.usage.experts_per_token == 3  # the k used, reported back
    assert response.usage.prompt_tokens == len("ROMEO.") + 1  # with BOS
    default = client.completions.create(model="tiny-lm", prompt="ROMEO.", max_tokens=2)
    assert default.usage.experts_per_token == 2
    models = client.models.list()
    cards = {m.id: m for m in models.data}
    assert (
        cards["tiny-lm"].experts_per_token == {"default": 2, "min": 1, "max": 4}
        and cards["tiny-clf"].task == "sequence_classification"
    )


def test_openai_client_streaming_equals_non_streaming(server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    kwargs = dict(
        model="tiny-lm",
        prompt="JULIET.",
        max_tokens=12,
        temperature=0,
        extra_body={"experts_per_token": 1, "ignore_eos": True},
    )
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].usage.experts_per_token == 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_token_id_prompts_lists_n_and_logprobs(client) -> None:
    body = {
        "model": "tiny-lm",
        "prompt": [[256, 72, 105], [256, 79]],
        "max_tokens": 3,
        "n": 2,
        "temperature": 0.8,
        "seed": 5,
        "logprobs": 2,
    }
    data = client.post("/v1/completions", json=body).json()
    assert [c["index"] for c in data["choices"]] == [0, 1, 2, 3]
    for choice in data["choices"]:
        assert len(choice["logprobs"]["token_logprobs"]) == len(choice["logprobs"]["tokens"]) <= 3
        assert all(len(top) == 2 for top in choice["logprobs"]["top_logprobs"])
    assert data["usage"]["prompt_tokens"] == 5


async def _completion(http: httpx.AsyncClient, prompt: str, k: int) -> str:
    body = {
        "model": "tiny-lm",
        "prompt": prompt,
        "max_tokens": 10,
        "temperature": 0,
        "experts_per_token": k,
        "ignore_eos": True,
    }
    response = await http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["experts_per_token"] == k
    return response.json()["choices"][0]["text"]


def test_32_concurrent_mixed_k_requests_equal_one_at_a_time(server) -> None:
    prompts = [(f"Scene {i}: " + "To be or not " * (i % 5), 1 + i % 4) for i in range(32)]

    async def run() -> tuple[list[str], list[str]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            alone = [await _completion(http, p, k) for p, k in prompts]
            together = await asyncio.gather(*(_completion(http, p, k) for p, k in prompts))
        return alone, list(together)

    alone, together = asyncio.run(run())
    assert together == alone


def test_chat_with_template_and_without(client) -> None:
    client_ = openai.OpenAI(base_url=str(client.base_url) + "/v1", api_key="x")
    chat = client_.chat.completions.create(
        model="tiny-lm", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
    )
    assert chat.choices[0].message.role == "assistant" and chat.usage.experts_per_token == 2
    chunks = list(
        client_.chat.completions.create(
            model="tiny-lm", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    response = client.post(
        "/v1/chat/completions", json={"model": "tiny-clf", "messages": [{"role": "user", "content": "Hi"}]}
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "model"


def test_classify_and_score(client) -> None:
    data = client.post(
        "/v1/classify",
        json={
            "model": "tiny-clf",
            "input": ["Out, damned spot!", "If music be the food of love"],
            "experts_per_token": 2,
        },
    ).json()
    assert [d["index"] for d in data["data"]] == [0, 1]
    assert all(d["label"] in d["probs"] and abs(sum(d["probs"].values()) - 1) < 1e-5 for d in data["data"])
    assert data["usage"]["experts_per_token"] == 2 and data["usage"]["approximate"] is True
    scored = client.post(
        "/v1/score",
        json={
            "model": "tiny-lm",
            "input": "Exit, pursued by a bear.",
            "experts_per_token": 4,
            "return_token_logprobs": True,
        },
    ).json()
    item = scored["data"][0]
    assert item["num_bytes"] == 24 and len(item["token_logprobs"]) == item["num_tokens"] == 24
    assert scored["usage"]["experts_per_token"] == 4
    assert client.post("/v1/score", json={"model": "tiny-clf", "input": "x y"}).status_code == 400


def test_streaming_client_that_disconnects_frees_its_slot(server, client) -> None:
    body = {
        "model": "tiny-lm",
        "prompt": "Long",
        "max_tokens": 64,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
    }
    with httpx.Client(base_url=server.url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            received = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: {") for line in received)
        # leaving the block closes the connection mid-stream
    engine = server.app.state.ctx.models["tiny-lm"].engine
    for _ in range(200):
        if engine.num_running == 0 and engine.num_requests == 0:
            break
        asyncio.run(asyncio.sleep(0.05))
    assert engine.num_running == 0
    metrics = client.get("/metrics").text
    assert 'moe_serve_num_requests_running{model="tiny-lm"} 0.0' in metrics
    assert (
        client.post("/v1/completions", json={"model": "tiny-lm", "prompt": "after", "max_tokens": 2}).status_code == 200
    )


def test_metrics_have_latency_histograms_by_k(client) -> None:
    for k in (1, 4):
        assert (
            client.post(
                "/v1/completions", json={"model": "tiny-lm", "prompt": "k", "max_tokens": 3, "experts_per_token": k}
            ).status_code
            == 200
        )
    text = client.get("/metrics").text
    for name in (
        "moe_serve_time_to_first_token_seconds",
        "moe_serve_e2e_request_latency_seconds",
        "moe_serve_request_queue_time_seconds",
        "moe_serve_inter_token_latency_seconds",
    ):
        for k in ("1", "4"):
            assert f"{name}_count{{" in text and f'k="{k}"' in text
            assert any(
                line.startswith(name + "_count") and f'k="{k}"' in line and 'model="tiny-lm"' in line
                for line in text.splitlines()
            ), (name, k)
    assert 'moe_serve_requests_total{endpoint="/v1/completions",model="tiny-lm",status="200"}' in text
    assert 'moe_serve_expert_tokens_total{expert="0",layer="1",model="tiny-lm"}' in text
    assert "moe_serve_generation_tokens_total" in text and "moe_serve_num_requests_waiting" in text


def test_non_streaming_client_that_disconnects_frees_its_slot(server, monkeypatch) -> None:
    import time

    engine = server.app.state.ctx.models["tiny-lm"].engine
    runner = engine.engine.runner
    execute = runner.execute

    def slow_execute(*args, **kwargs):  # 64 steps now take over 3 s
        time.sleep(0.05)
        return execute(*args, **kwargs)

    monkeypatch.setattr(runner, "execute", slow_execute)
    body = {"model": "tiny-lm", "prompt": "Long", "max_tokens": 64, "ignore_eos": True}
    started = time.monotonic()
    with httpx.Client(base_url=server.url, timeout=0.5) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json=body)
    while engine.num_requests or engine.num_running:
        assert time.monotonic() - started < 2.0, "the request kept running after its client left"
        time.sleep(0.05)
