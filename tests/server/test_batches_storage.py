"""The Files and Batch API over a real uvicorn server when its data dir fails: a
corrupt database or a data dir that cannot be used is a 503 naming it on these routes while the model keeps
serving (and the server starts); a full disk is a 507 that leaves no partial upload behind; the quota on
stored bytes (uploads checked as they arrive, concurrent ones together, a batch's answers); uploads never
spooled to the system temp dir; and a batch that meets a full disk pauses, counts it in /metrics, and
completes."""

from __future__ import annotations

import errno
import json
import os
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from moe_serve.batch.jobs import JobConfig
from moe_serve.batch.store import DATABASE, Store
from moe_serve.server.settings import ServerSettings
from tests.server.conftest import RunningServer, start_server
from tests.server.test_batches_api import TERMINAL, content, request, upload


def serve(artifacts, data_dir: Path, **settings) -> RunningServer:
    return start_server(ServerSettings(models=(str(artifacts["lm"]),), data_dir=str(data_dir), **settings))


@pytest.fixture
def running() -> Iterator[list[RunningServer]]:
    servers: list[RunningServer] = []
    yield servers
    for server in servers:
        server.stop()


def assert_data_dir_unavailable(response: httpx.Response, data_dir: Path) -> None:
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["code"] == 503 and error["type"] == "service_unavailable"
    assert str(data_dir) in error["message"] and response.headers["retry-after"]


def assert_model_serves(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
    assert response.status_code == 200, response.text


def test_a_corrupt_database_is_a_503_naming_the_data_dir_while_the_model_serves(
    artifacts, tmp_path: Path, running: list[RunningServer]
) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / DATABASE).write_bytes(b"\x13garbage, not sqlite" * 1000)
    running.append(server := serve(artifacts, data_dir))  # starts: the models do not depend on the data dir
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for method, path in [("GET", "/v1/batches"), ("GET", "/v1/files"), ("GET", "/v1/batches/batch_x")]:
            assert_data_dir_unavailable(http.request(method, path), data_dir)
        assert_model_serves(http)
        assert http.get("/health").status_code == 200
        (data_dir / DATABASE).unlink()  # the operator moves the corrupt file away: no restart needed
        assert http.get("/v1/batches").status_code == 200


def test_a_data_dir_that_cannot_be_used_is_a_503_naming_it(
    artifacts, tmp_path: Path, running: list[RunningServer]
) -> None:
    data_dir = tmp_path / "a-file"
    data_dir.write_text("not a directory")
    running.append(server := serve(artifacts, data_dir))
    with httpx.Client(base_url=server.url, timeout=60) as http:
        files = {"file": ("a.jsonl", b"{}\n"), "purpose": (None, b"batch")}
        assert_data_dir_unavailable(http.post("/v1/files", files=files), data_dir)
        assert_data_dir_unavailable(http.get("/v1/files"), data_dir)
        body = {"input_file_id": "file-x", "endpoint": "/v1/completions", "completion_window": "24h"}
        assert_data_dir_unavailable(http.post("/v1/batches", json=body), data_dir)
        assert_model_serves(http)


def fail_fsync(monkeypatch: pytest.MonkeyPatch, times: int) -> None:
    """The disk is full for the next `times` fsyncs (where an upload's bytes meet the disk), then has room."""
    real, left = os.fsync, {"n": times}

    def fsync(fd: int) -> None:
        if left["n"] > 0:
            left["n"] -= 1
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def test_an_upload_on_a_full_disk_is_a_507_that_leaves_nothing_behind(
    artifacts, tmp_path: Path, running: list[RunningServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    data_dir = tmp_path / "data"
    running.append(server := serve(artifacts, data_dir))
    sdk = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    sdk.files.list()  # the data dir is opened
    fail_fsync(monkeypatch, 1)
    with pytest.raises(openai.APIStatusError) as full:
        sdk.files.create(file=("big.jsonl", b"{}\n" * 10_000), purpose="batch")
    error = full.value.response.json()["error"]
    assert full.value.status_code == 507 and error["code"] == 507 and error["type"] == "insufficient_storage"
    assert str(data_dir) in error["message"] and "no space left" in error["message"]
    assert list((data_dir / "files").iterdir()) == []  # no .part file left to keep the disk full
    assert sdk.files.create(file=("small.jsonl", b"{}\n" * 29), purpose="batch").bytes == 87  # the next one works
    metrics = httpx.get(server.url + "/metrics").text
    assert 'moe_serve_batch_storage_errors_total{stage="request"} 1.0' in metrics


def test_uploads_past_the_stored_files_quota_are_a_507_naming_it(
    artifacts, tmp_path: Path, running: list[RunningServer]
) -> None:
    data_dir = tmp_path / "data"
    running.append(server := serve(artifacts, data_dir, max_stored_bytes=4000))
    sdk = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    sdk.files.create(file=("one.jsonl", b"{}\n" * 1000), purpose="batch")
    with pytest.raises(openai.APIStatusError) as over:
        sdk.files.create(file=("two.jsonl", b"{}\n" * 500), purpose="batch")
    error = over.value.response.json()["error"]
    assert over.value.status_code == 507 and "--max-stored-bytes 4000" in error["message"]
    assert error["param"] == "file"
    assert [f.filename for f in sdk.files.list()] == ["one.jsonl"]
    assert len(list((data_dir / "files").iterdir())) == 1
    sdk.files.create(file=("three.jsonl", b"{}\n" * 333), purpose="batch")  # what fits is still taken


def test_a_batch_meeting_a_full_disk_pauses_and_completes_with_every_answer(
    artifacts, tmp_path: Path, running: list[RunningServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    running.append(server := serve(artifacts, tmp_path / "data"))
    server.app.state.batches.config = JobConfig(retry_delay=0.05, max_retry_delay=0.2)  # before the worker starts
    sdk = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    input_file = upload(sdk, [request(f"r{i}", {"prompt": f"line {i}", "max_tokens": 3}) for i in range(6)])
    full = sqlite3.OperationalError("database or disk is full")
    full.sqlite_errorcode = 13  # type: ignore[attr-defined]  # SQLITE_FULL
    real, left = Store._insert_results, {"n": 3}

    def insert_results(*args, **kwargs) -> None:
        if left["n"] > 0:
            left["n"] -= 1
            raise full
        real(*args, **kwargs)

    monkeypatch.setattr(Store, "_insert_results", insert_results)
    batch = sdk.batches.create(input_file_id=input_file, endpoint="/v1/completions", completion_window="24h")
    seen, deadline = set(), time.monotonic() + 120
    while batch.status not in TERMINAL and time.monotonic() < deadline:
        batch = sdk.batches.retrieve(batch.id)
        seen.add(batch.status)
        time.sleep(0.02)
    assert "failed" not in seen and batch.status == "completed", (seen, batch)
    assert batch.request_counts.completed == 6 and batch.error_file_id is None
    output = content(sdk, batch.output_file_id)
    assert [x["custom_id"] for x in output] == [f"r{i}" for i in range(6)]
    assert all(x["response"]["status_code"] == 200 for x in output)
    metrics = httpx.get(server.url + "/metrics").text
    assert 'moe_serve_batch_storage_errors_total{stage="in_progress"} 3.0' in metrics
    assert json.dumps(output)  # the output is whole JSON


def test_uploads_stream_into_the_data_dir_never_the_system_temp_dir(
    artifacts, tmp_path: Path, running: list[RunningServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-temp-dir"))  # a spooled upload would fail here
    data_dir = tmp_path / "data"
    running.append(server := serve(artifacts, data_dir, max_stored_bytes=4 << 20))
    sdk = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    stored = sdk.files.create(file=("big.jsonl", b"{}\n" * 1_000_000), purpose="batch")  # 3 MB
    assert stored.bytes == 3_000_000
    for _ in range(3):  # past the quota: refused as the bytes arrive, nothing left behind
        with pytest.raises(openai.APIStatusError) as over:
            sdk.files.create(file=("more.jsonl", b"{}\n" * 1_000_000), purpose="batch")
        assert over.value.status_code == 507 and "--max-stored-bytes" in over.value.response.json()["error"]["message"]
    assert [p.name for p in (data_dir / "files").iterdir()] == [stored.id]
    assert server.app.state.batches.store.stored_bytes() == 3_000_000
    with httpx.Client(base_url=server.url, timeout=60) as http:  # refused by name before any file data is stored
        response = http.post(
            "/v1/files", data={"purpose": "batch", "expires_after[anchor]": "x"}, files={"file": b"{}"}
        )
        assert response.status_code == 400 and response.json()["error"]["param"] == "expires_after"
        response = http.post("/v1/files", content=b"{}", headers={"content-type": "application/json"})
        assert response.status_code == 400 and "multipart/form-data" in response.json()["error"]["message"]
    assert [p.name for p in (data_dir / "files").iterdir()] == [stored.id]


def test_a_batch_waits_at_the_quota_and_a_cancel_ends_it_with_what_is_stored(
    artifacts, tmp_path: Path, running: list[RunningServer]
) -> None:
    """The answers count against the quota: a batch that would pass it stops there (it is not failed) and a
    cancel ends it with the answers stored; the stored bytes never pass the quota."""
    quota = 3000
    running.append(server := serve(artifacts, tmp_path / "data", max_stored_bytes=quota))
    server.app.state.batches.config = JobConfig(retry_delay=0.05, max_retry_delay=0.2)  # before the worker starts
    sdk = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    body = {"max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 2}  # answers of ~1 KB each
    input_file = upload(sdk, [request(f"r{i}", {"prompt": f"line {i}", **body}) for i in range(8)])
    batch = sdk.batches.create(input_file_id=input_file, endpoint="/v1/completions", completion_window="24h")
    store: Store = server.app.state.batches.store
    deadline, counts = time.monotonic() + 60, []
    while time.monotonic() < deadline and (len(counts) < 20 or counts[-1] != counts[-20]):
        batch = sdk.batches.retrieve(batch.id)
        counts.append(batch.request_counts.completed)
        assert store.stored_bytes() <= quota
        time.sleep(0.05)
    assert batch.status == "in_progress" and 0 < counts[-1] < 8, (batch.status, counts)
    sdk.batches.cancel(batch.id)
    deadline = time.monotonic() + 60
    while batch.status not in TERMINAL and time.monotonic() < deadline:
        batch = sdk.batches.retrieve(batch.id)
        time.sleep(0.05)
    assert batch.status == "cancelled" and batch.request_counts.completed == counts[-1]
    assert len(content(sdk, batch.output_file_id)) == counts[-1]
    assert store.stored_bytes() <= quota
