"""The Batch API's worker and the shared runner without a model (answers are faked, the store is real):
validation errors, resuming with only the lines not stored, cancelling, expiring, a full engine queue, and
the in-flight window that narrows while interactive requests run."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import pytest

from moe_serve.api.errors import ApiError
from moe_serve.batch import jobs as jobs_module
from moe_serve.batch.core import error_result, run_items
from moe_serve.batch.jobs import BatchJobs, JobConfig
from moe_serve.batch.jsonl import BatchItem, LineResult, parse_input, response_line
from moe_serve.batch.store import Store
from moe_serve.errors import EngineOverloadedError, ValidationError
from tests.batch.test_batch_store import Clock


def request_line(custom_id: str, url: str = "/v1/completions", **body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": {"prompt": custom_id, **body}})


@pytest.fixture
def store(tmp_path: Path):
    s = Store(tmp_path / "data", Clock())
    yield s
    s.close()


class FakeAnswers:
    """answer() without a model: echoes the prompt; `fail` in a body gives a 400; `block` never returns."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.on_call = lambda item: None

    async def __call__(self, models, item: BatchItem) -> LineResult:
        self.calls.append(item.custom_id)
        self.on_call(item)
        await asyncio.sleep(0)
        if item.body.get("block"):
            await asyncio.Event().wait()
        if item.body.get("fail"):
            return error_result(item, ApiError(400, "bad prompt", "invalid_request_error", "prompt"))
        return LineResult(response_line(item, 200, {"echo": item.body["prompt"]}), item.line, 2, 3)


@pytest.fixture
def answers(monkeypatch: pytest.MonkeyPatch) -> FakeAnswers:
    fake = FakeAnswers()
    monkeypatch.setattr(jobs_module, "answer", fake)
    return fake


def submit(store: Store, lines: list[str], endpoint: str = "/v1/completions") -> str:
    source = store.add_file(io.BytesIO(("\n".join(lines) + "\n").encode()), "in.jsonl", "batch")
    return store.add_batch(endpoint, source.id, "24h", None, 3600).id


def drive(jobs: BatchJobs, max_steps: int = 20) -> None:
    async def steps() -> None:
        for _ in range(max_steps):
            if not await jobs.step():
                return
        raise AssertionError("the batches did not finish")

    asyncio.run(steps())


def lines_of(store: Store, file_id: str | None) -> list[dict]:
    return [json.loads(x) for x in store.file_path(file_id).read_text().splitlines()] if file_id else []


def test_validation_lists_every_bad_line(store: Store, answers: FakeAnswers) -> None:
    lines = [
        request_line("a"),
        "{not json",
        request_line("b", url="/v1/score"),
        request_line("a"),
        json.dumps({"custom_id": "c", "url": "/v1/completions", "body": {}, "label": "x"}),
        json.dumps({"custom_id": 5, "url": "/v1/completions", "body": {}}),
    ]
    batch_id = submit(store, lines)
    drive(BatchJobs(store, None, lambda: False))  # type: ignore[arg-type]  # no line runs
    batch = store.get_batch(batch_id)
    assert batch.status == "failed" and batch.failed_at is not None and answers.calls == []
    errors = {e["line"]: (e["code"], e["param"]) for e in batch.errors["data"]}
    assert errors == {
        2: ("invalid_json", None),
        3: ("invalid_request", "url"),
        4: ("duplicate_custom_id", "custom_id"),
        5: ("invalid_request", "label"),  # moe-serve batch's extension, not the API's
        6: ("invalid_request", "custom_id"),
    }
    assert "not the batch's endpoint '/v1/completions'" in batch.errors["data"][1]["message"]
    assert all(set(e) == {"code", "message", "param", "line"} for e in batch.errors["data"])


def test_empty_and_oversized_files_fail(store: Store, answers: FakeAnswers) -> None:
    empty, large = submit(store, [""]), submit(store, [request_line(f"r{i}") for i in range(3)])
    drive(BatchJobs(store, None, lambda: False, JobConfig(max_requests=2)))  # type: ignore[arg-type]
    assert store.get_batch(empty).errors["data"][0]["code"] == "empty_file"
    assert store.get_batch(large).errors["data"][0]["code"] == "too_many_requests"


def test_a_resumed_batch_runs_only_the_lines_not_stored(store: Store, answers: FakeAnswers) -> None:
    batch_id = submit(store, [request_line(f"r{i}", fail=i == 4) for i in range(6)])
    jobs = BatchJobs(store, None, lambda: False)  # type: ignore[arg-type]
    asyncio.run(jobs.step())  # validated
    # What a server killed mid-run left: the answers to lines 1 and 3, stored.
    parsed = parse_input([x.encode() for x in [request_line(f"r{i}") for i in range(6)]], scope=batch_id)
    earlier = [LineResult(response_line(i, 200, {"echo": "before the kill"}), i.line) for i in parsed.items[0:3:2]]
    store.add_results(batch_id, earlier)
    drive(jobs)
    assert sorted(answers.calls) == ["r1", "r3", "r4", "r5"]
    batch = store.get_batch(batch_id)
    assert (batch.status, batch.total, batch.completed, batch.failed) == ("completed", 6, 5, 1)
    output = lines_of(store, batch.output_file_id)
    assert [x["custom_id"] for x in output] == ["r0", "r1", "r2", "r3", "r5"]
    assert output[0]["response"]["body"] == {"echo": "before the kill"}  # stored answers are not redone
    assert [x["custom_id"] for x in lines_of(store, batch.error_file_id)] == ["r4"]
    assert len({x["id"] for x in output}) == 5 and all(x["id"].startswith("batch_req_") for x in output)


def test_cancel_keeps_the_answers_so_far(store: Store, answers: FakeAnswers) -> None:
    batch_id = submit(store, [request_line(f"r{i}", block=i >= 3) for i in range(5)])
    jobs = BatchJobs(store, None, lambda: False, JobConfig(max_in_flight=1))  # type: ignore[arg-type]
    answers.on_call = lambda item: jobs.cancel(batch_id) if item.custom_id == "r3" else None
    drive(jobs)
    batch = store.get_batch(batch_id)
    assert batch.status == "cancelled" and batch.cancelling_at is not None and batch.cancelled_at is not None
    assert [x["custom_id"] for x in lines_of(store, batch.output_file_id)] == ["r0", "r1", "r2"]
    assert batch.error_file_id is None and answers.calls == ["r0", "r1", "r2", "r3"]
    assert jobs.cancel(batch_id).status == "cancelled"  # again: the same answer
    finished = submit(store, [request_line("done")])
    drive(jobs)
    with pytest.raises(ValidationError, match="is completed: only a validating or in_progress batch can be"):
        jobs.cancel(finished)


def test_a_batch_past_its_window_expires(store: Store, answers: FakeAnswers) -> None:
    batch_id = submit(store, [request_line(f"r{i}") for i in range(4)])
    jobs = BatchJobs(store, None, lambda: False)  # type: ignore[arg-type]
    asyncio.run(jobs.step())  # validated
    parsed = parse_input([request_line(f"r{i}").encode() for i in range(4)], scope=batch_id)
    store.add_results(batch_id, [LineResult(response_line(parsed.items[0], 200, {}), 1)])
    store.clock.now += 3601  # type: ignore[attr-defined]
    drive(jobs)
    batch = store.get_batch(batch_id)
    assert batch.status == "expired" and batch.expired_at is not None and answers.calls == []
    errors = lines_of(store, batch.error_file_id)
    assert [x["custom_id"] for x in errors] == ["r1", "r2", "r3"]
    assert errors[0]["response"] is None and errors[0]["error"]["code"] == "batch_expired"
    assert (batch.completed, batch.failed) == (1, 3)


def items(n: int) -> list[BatchItem]:
    return [BatchItem(i + 1, f"r{i}", "/v1/score", {}, None, None) for i in range(n)]


def test_the_window_narrows_while_interactive_requests_run() -> None:
    running, peak, busy = 0, {True: 0, False: 0}, {"now": True}

    async def answer_one(item: BatchItem) -> LineResult:
        nonlocal running
        running += 1
        peak[busy["now"]] = max(peak[busy["now"]], running)
        await asyncio.sleep(0.002)
        running -= 1
        if item.line == 10:
            busy["now"] = False  # the interactive traffic ends: the window widens again
        return LineResult(response_line(item, 200, {}), item.line)

    sunk: list[int] = []
    finished = asyncio.run(
        run_items(items(40), answer_one, lambda r: sunk.append(r.item_line), lambda: 1 if busy["now"] else 8)
    )
    assert finished and sorted(sunk) == list(range(1, 41))
    assert peak == {True: 1, False: 8}


def test_a_full_engine_queue_delays_an_item_and_never_answers_it_with_a_429() -> None:
    refused = set()

    async def answer_one(item: BatchItem) -> LineResult:
        if item.line % 2 and item.line not in refused:
            refused.add(item.line)
            raise EngineOverloadedError("queue full")
        return LineResult(response_line(item, 200, {}), item.line)

    sunk: list[LineResult] = []
    assert asyncio.run(run_items(items(6), answer_one, sunk.append, lambda: 4))
    assert sorted(r.item_line for r in sunk) == list(range(1, 7)) and refused == {1, 3, 5}
    assert all(r.is_ok for r in sunk)
