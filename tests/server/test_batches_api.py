"""The OpenAI Files and Batch API through a real uvicorn server and the official `openai` SDK: upload, create,
poll, read the output and error files (each line in the strict OpenAI batch-output shape), list with
pagination, cancel, delete; and the 400/404/413 answers, in the one error envelope."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator

import httpx
import openai
import pytest

from moe_serve.server.app import create_app
from moe_serve.server.settings import ServerSettings, is_interactive_path
from tests.batch.test_batch import assert_strict
from tests.server.conftest import RunningServer, start_server

TERMINAL = ("completed", "failed", "expired", "cancelled")


@pytest.fixture
def sdk(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def request(custom_id: str, body: dict, url: str = "/v1/completions") -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def upload(sdk: openai.OpenAI, lines: list) -> str:
    text = "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n"
    return sdk.files.create(file=("requests.jsonl", text.encode()), purpose="batch").id


def wait(sdk: openai.OpenAI, batch_id: str, until=lambda b: b.status in TERMINAL, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = sdk.batches.retrieve(batch_id)
        if until(batch):
            return batch
        time.sleep(0.05)
    raise AssertionError(f"batch {batch_id} is still {batch.status}")


def content(sdk: openai.OpenAI, file_id: str | None) -> list[dict]:
    return [json.loads(x) for x in sdk.files.content(file_id).text.splitlines()] if file_id else []


def test_a_completions_batch_end_to_end(sdk: openai.OpenAI) -> None:
    ok = {f"gen-{i}": {"prompt": f"Act {i}.", "max_tokens": 6, "temperature": 0, "ignore_eos": True} for i in range(5)}
    ok["k1"] = {"prompt": "Scene.", "max_tokens": 4, "temperature": 0, "experts_per_token": 1}
    ok["suffix"] = {"model": "tiny-lm:k3", "prompt": "Scene.", "max_tokens": 4, "temperature": 0}
    bad = {
        "badk": ({"model": "tiny-lm", "prompt": "x", "experts_per_token": 99}, "experts_per_token"),
        "stream": ({"model": "tiny-lm", "prompt": "x", "stream": True}, "stream"),
        "no-model": ({"prompt": "x"}, "model"),  # two models are served: a line must name one
        "classifier": ({"model": "tiny-clf", "prompt": "x"}, None),
        "nowhere": ({"model": "no-such-model", "prompt": "x"}, "model"),
    }
    lines = [request(c, {"model": "tiny-lm", **b} if "model" not in b else b) for c, b in ok.items()]
    lines += [request(c, b) for c, (b, _) in bad.items()]
    file_id = upload(sdk, lines)
    uploaded = sdk.files.retrieve(file_id)
    assert (uploaded.purpose, uploaded.filename, uploaded.status) == ("batch", "requests.jsonl", "processed")
    created = sdk.batches.create(
        input_file_id=file_id, endpoint="/v1/completions", completion_window="24h", metadata={"run": "nightly"}
    )
    assert created.status == "validating" and created.expires_at == created.created_at + 24 * 3600
    batch = wait(sdk, created.id)
    assert batch.status == "completed" and batch.metadata == {"run": "nightly"} and batch.errors is None
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (len(ok) + len(bad), len(ok), len(bad))
    assert created.created_at <= batch.in_progress_at <= batch.finalizing_at <= batch.completed_at
    output, errors = content(sdk, batch.output_file_id), content(sdk, batch.error_file_id)
    assert_strict(output + errors)
    assert sorted(x["custom_id"] for x in output) == sorted(ok)
    assert sorted(x["custom_id"] for x in errors) == sorted(bad)
    for x in errors:
        assert x["response"]["status_code"] in (400, 404)
        param = bad[x["custom_id"]][1]
        assert param is None or x["response"]["body"]["error"]["param"] == param
    # Each answer is the one the interactive endpoint gives (greedy), with the k used in the body.
    answers = {x["custom_id"]: x["response"]["body"] for x in output}
    for custom_id, body in ok.items():
        body = {"model": "tiny-lm", **body}
        model, prompt = body.pop("model"), body.pop("prompt")
        live = sdk.completions.create(model=model, prompt=prompt, extra_body=body)
        assert answers[custom_id]["choices"][0]["text"] == live.choices[0].text, custom_id
        assert answers[custom_id]["usage"]["experts_per_token"] == live.usage.experts_per_token
    assert answers["k1"]["usage"]["experts_per_token"] == 1 and answers["suffix"]["usage"]["experts_per_token"] == 3
    assert batch.usage.input_tokens == sum(a["usage"]["prompt_tokens"] for a in answers.values())
    assert batch.usage.output_tokens == sum(a["usage"]["completion_tokens"] for a in answers.values())
    outputs = sdk.files.retrieve(batch.output_file_id)
    assert outputs.purpose == "batch_output" and outputs.filename == f"{batch.id}_output.jsonl"
    assert {batch.output_file_id, batch.error_file_id, file_id} <= {f.id for f in sdk.files.list()}
    inputs = list(sdk.files.list(purpose="batch"))
    assert file_id in {f.id for f in inputs} and {f.purpose for f in inputs} == {"batch"}
    assert sdk.files.delete(batch.output_file_id).deleted
    with pytest.raises(openai.NotFoundError) as gone:
        sdk.files.content(batch.output_file_id)
    assert gone.value.body["param"] == "file_id"


@pytest.mark.parametrize(
    "endpoint,body,kind",
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}, "chat.completion"),
        ("/v1/classify", {"model": "tiny-clf", "input": ["Out, damned spot!"]}, "list"),
        ("/v1/score", {"input": "To be, or not to be"}, "list"),
    ],
)
def test_every_batch_endpoint(sdk: openai.OpenAI, endpoint: str, body: dict, kind: str) -> None:
    body = {"model": "tiny-lm", **body}
    file_id = upload(sdk, [request(f"line-{i}", body, endpoint) for i in range(3)])
    batch = wait(sdk, sdk.batches.create(input_file_id=file_id, endpoint=endpoint, completion_window="24h").id)
    output = content(sdk, batch.output_file_id)
    assert batch.status == "completed" and len(output) == 3 and batch.error_file_id is None
    assert_strict(output)
    assert {x["response"]["body"]["object"] for x in output} == {kind}


def test_a_file_that_fails_validation_fails_the_batch_with_its_errors(sdk: openai.OpenAI) -> None:
    lines = [
        request("a", {"prompt": "x"}),
        "{broken",
        request("b", {"input": "x"}, url="/v1/score"),
        request("a", {"prompt": "y"}),
    ]
    batch = wait(
        sdk,
        sdk.batches.create(input_file_id=upload(sdk, lines), endpoint="/v1/completions", completion_window="24h").id,
    )
    assert batch.status == "failed" and batch.failed_at is not None and batch.output_file_id is None
    assert [(e.line, e.code, e.param) for e in batch.errors.data] == [
        (2, "invalid_json", None),
        (3, "invalid_request", "url"),
        (4, "duplicate_custom_id", "custom_id"),
    ]


def test_bad_requests_are_refused_by_name(sdk: openai.OpenAI, server: RunningServer) -> None:
    file_id = upload(sdk, [request("a", {"prompt": "x", "max_tokens": 1})])
    create = dict(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")

    def refused(call, param: str, status: type = openai.BadRequestError) -> str:
        with pytest.raises(status) as error:
            call()
        assert error.value.body["param"] == param, error.value.body
        return error.value.body["message"]

    jsonl = ("x.jsonl", b"{}\n")
    assert "purpose must be 'batch'" in refused(lambda: sdk.files.create(file=jsonl, purpose="fine-tune"), "purpose")
    anchor = {"anchor": "created_at", "seconds": 3600}
    refused(lambda: sdk.files.create(file=jsonl, purpose="batch", expires_after=anchor), "expires_after")
    refused(lambda: sdk.batches.create(**create, output_expires_after=anchor), "output_expires_after")
    refused(lambda: sdk.batches.create(**create, extra_body={"priority": "high"}), "priority")
    refused(lambda: sdk.batches.create(**{**create, "completion_window": "1h"}), "completion_window")
    refused(lambda: sdk.batches.create(**{**create, "endpoint": "/v1/embeddings"}), "endpoint")
    refused(lambda: sdk.batches.create(**create, metadata={f"k{i}": "v" for i in range(17)}), "metadata")
    nope = {**create, "input_file_id": "file-nope"}
    refused(lambda: sdk.batches.create(**nope), "input_file_id", openai.NotFoundError)
    refused(lambda: sdk.batches.retrieve("batch_nope"), "batch_id", openai.NotFoundError)
    refused(lambda: sdk.batches.cancel("batch_nope"), "batch_id", openai.NotFoundError)
    refused(lambda: sdk.files.retrieve("file-nope"), "file_id", openai.NotFoundError)
    refused(lambda: sdk.files.delete("file-nope"), "file_id", openai.NotFoundError)
    refused(lambda: sdk.batches.list(after="batch_nope"), "after", openai.NotFoundError)
    refused(lambda: sdk.batches.list(limit=0), "limit")
    with httpx.Client(base_url=server.url) as http:
        missing = http.post("/v1/files", data={"purpose": "batch"}).json()["error"]
        assert (missing["param"], missing["code"], missing["type"]) == ("file", 400, "invalid_request_error")
    # A finished batch's output cannot be a batch's input; a batch's input stays while the batch may read it.
    done = wait(sdk, sdk.batches.create(**create).id)
    refused(lambda: sdk.batches.create(**{**create, "input_file_id": done.output_file_id}), "input_file_id")
    refused(lambda: sdk.batches.cancel(done.id), "batch_id")


def test_batches_list_newest_first_in_pages(sdk: openai.OpenAI) -> None:
    file_id = upload(sdk, [request("a", {"input": "x"}, url="/v1/score")])
    create = dict(input_file_id=file_id, endpoint="/v1/score", completion_window="24h")
    ids = [sdk.batches.create(**create).id for _ in range(3)]
    first = sdk.batches.list(limit=2)
    assert [b.id for b in first.data] == ids[:0:-1] and first.has_more
    second = sdk.batches.list(limit=2, after=first.data[-1].id)
    assert second.data[0].id == ids[0]
    every = [b.id for b in sdk.batches.list(limit=1)]  # the SDK follows the pages itself
    assert [i for i in every if i in ids] == ids[::-1]
    for batch_id in ids:
        wait(sdk, batch_id)


def test_cancel_keeps_what_was_answered(sdk: openai.OpenAI) -> None:
    body = {"model": "tiny-lm", "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    lines = [request(f"r{i}", {**body, "prompt": f"Line {i}."}) for i in range(300)]
    created = sdk.batches.create(input_file_id=upload(sdk, lines), endpoint="/v1/completions", completion_window="24h")
    wait(sdk, created.id, until=lambda b: b.request_counts.completed >= 1)
    cancelling = sdk.batches.cancel(created.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at is not None
    batch = wait(sdk, created.id)
    assert batch.status == "cancelled" and batch.cancelled_at is not None
    output = content(sdk, batch.output_file_id)
    assert_strict(output)
    assert len(output) == batch.request_counts.completed < 300 and batch.request_counts.total == 300
    assert len({x["custom_id"] for x in output}) == len(output) and batch.error_file_id is None


@pytest.fixture(scope="module")
def small_server(artifacts, tmp_path_factory) -> Iterator[RunningServer]:
    settings = ServerSettings(
        models=(str(artifacts["lm"]),), max_upload_bytes=4096, data_dir=str(tmp_path_factory.mktemp("small-data"))
    )
    running = start_server(settings)
    yield running
    running.stop()


def test_uploads_over_the_limit_get_413_announced_or_streamed(small_server: RunningServer) -> None:
    sdk = openai.OpenAI(base_url=small_server.url + "/v1", api_key="unused", max_retries=0)
    assert sdk.files.create(file=("small.jsonl", b"{}\n" * 100), purpose="batch").bytes == 300
    with pytest.raises(openai.APIStatusError) as announced:
        sdk.files.create(file=("big.jsonl", b"{}\n" * 2000), purpose="batch")
    assert announced.value.status_code == 413
    boundary = uuid.uuid4().hex
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--{boundary}\r\n'
        f'Content-Disposition: form-data; name="file"; filename="big.jsonl"\r\n\r\n'
    ).encode()

    def chunked() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield head
        for _ in range(100):
            yield b"{}\n" * 100
        yield f"\r\n--{boundary}--\r\n".encode()

    with httpx.Client(base_url=small_server.url, timeout=60) as http:
        response = http.post(
            "/v1/files", content=chunked(), headers={"content-type": f"multipart/form-data; boundary={boundary}"}
        )
    assert response.status_code == 413 and response.json()["error"]["code"] == 413
    assert [f.filename for f in sdk.files.list()] == ["small.jsonl"]  # nothing of the refused ones kept


def test_a_data_dir_belongs_to_one_server(sdk: openai.OpenAI, server: RunningServer, artifacts) -> None:
    sdk.batches.list()  # the session server holds its data dir
    settings = ServerSettings(models=(str(artifacts["lm"]),), data_dir=str(server.app.state.batches.data_dir))
    app = create_app(settings)

    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.get("/v1/batches")

    try:
        response = asyncio.run(call())
    finally:
        for served in app.state.ctx.models.values():
            served.engine.shutdown()
    assert response.status_code == 503
    assert "in use by another moe-serve server" in response.json()["error"]["message"]


def test_only_model_work_counts_as_interactive() -> None:
    assert all(map(is_interactive_path, ["/v1/completions", "/v1/chat/completions", "/v1/score", "/tokenize"]))
    assert not any(map(is_interactive_path, ["/v1/files", "/v1/files/f/content", "/v1/batches/b/cancel", "/health"]))
