"""The Batch API when its data dir fails, without a model: a full disk or an I/O
error pauses a batch, which resumes with nothing lost once space comes back; a line's own failure is that
line's error; a batch given up on still gets its output file; a data dir that cannot be used (a file, a
corrupt database) is a StorageError naming it, with its lock released; a failed upload leaves no bytes
behind; and the quota on stored files."""

from __future__ import annotations

import asyncio
import errno
import fcntl
import io
import json
import os
import sqlite3
from pathlib import Path

import pytest

from moe_serve.batch import core as core_module
from moe_serve.batch import jobs as jobs_module
from moe_serve.batch.core import answer
from moe_serve.batch.jobs import BatchJobs, JobConfig
from moe_serve.batch.jsonl import BatchItem, LineResult, response_line, to_json
from moe_serve.batch.store import DATABASE, QuotaError, StorageError, Store
from moe_serve.config import RequestLimits
from tests.batch.test_batch_jobs import FakeAnswers, lines_of, request_line, submit
from tests.batch.test_batch_store import Clock

FAST = JobConfig(retry_delay=0.001, max_retry_delay=0.002, max_failures=3)


@pytest.fixture
def store(tmp_path: Path):
    s = Store(tmp_path / "data", Clock())
    yield s
    s.close()


@pytest.fixture
def answers(monkeypatch: pytest.MonkeyPatch) -> FakeAnswers:
    fake = FakeAnswers()
    monkeypatch.setattr(jobs_module, "answer", fake)
    return fake


def failing(times: int, exc: BaseException, real):
    """`real`, failing with `exc` on its first `times` calls (a disk that fills, then has room again)."""
    calls = {"n": 0}

    def call(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] <= times:
            raise exc
        return real(*args, **kwargs)

    call.calls = calls  # type: ignore[attr-defined]
    return call


def leftovers(store: Store) -> set[str]:
    """Bytes in the files folder without a row: what a failure left behind."""
    known = {row["id"] for row in store._query("SELECT id FROM files")}
    return {p.name for p in store.files_dir.iterdir()} - known


def run_to_the_end(jobs: BatchJobs, max_steps: int = 200) -> list[str]:
    """Step until no batch is unfinished; the statuses the batches were seen in after each step."""
    seen: list[str] = []

    async def steps() -> None:
        for _ in range(max_steps):
            if not await jobs.step():
                return
            seen.extend(b.status for b in jobs.store.list_batches(limit=100, after=None)[0])
        raise AssertionError("the batches did not finish")

    asyncio.run(steps())
    return seen


def test_a_full_disk_pauses_the_batch_which_then_completes_with_nothing_lost(
    store: Store, answers: FakeAnswers, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch_id = submit(store, [request_line(f"r{i}") for i in range(6)])
    full = sqlite3.OperationalError("database or disk is full")
    full.sqlite_errorcode = 13  # type: ignore[attr-defined]  # SQLITE_FULL, as sqlite raises it
    monkeypatch.setattr(store, "_insert_results", failing(4, full, store._insert_results))
    stages: list[str] = []
    jobs = BatchJobs(store, None, lambda: False, FAST, on_storage_error=stages.append)  # type: ignore[arg-type]
    seen = run_to_the_end(jobs)
    assert "failed" not in seen and stages == ["in_progress"] * 4  # paused, counted, never failed
    batch = store.get_batch(batch_id)
    assert batch.status == "completed" and (batch.completed, batch.failed) == (6, 0)
    assert [x["custom_id"] for x in lines_of(store, batch.output_file_id)] == [f"r{i}" for i in range(6)]
    assert batch.error_file_id is None and not leftovers(store)


def test_finalizing_on_a_full_disk_is_tried_again_and_leaves_no_bytes_behind(
    store: Store, answers: FakeAnswers, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch_id = submit(store, [request_line("a"), request_line("b", fail=True)])
    monkeypatch.setattr(os, "fsync", failing(3, OSError(errno.ENOSPC, "No space left on device"), os.fsync))
    stages: list[str] = []
    jobs = BatchJobs(store, None, lambda: False, FAST, on_storage_error=stages.append)  # type: ignore[arg-type]
    seen = run_to_the_end(jobs)
    assert "failed" not in seen and stages == ["finalizing"] * 3
    batch = store.get_batch(batch_id)
    assert batch.status == "completed" and (batch.completed, batch.failed) == (1, 1)
    assert [x["custom_id"] for x in lines_of(store, batch.output_file_id)] == ["a"]
    assert [x["custom_id"] for x in lines_of(store, batch.error_file_id)] == ["b"]
    assert not leftovers(store)  # no .part, no output file of a failed try


def test_a_batch_cancelled_while_the_disk_is_full_keeps_its_answers(
    store: Store, answers: FakeAnswers, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch_id = submit(store, [request_line(f"r{i}") for i in range(4)])
    stored = {"n": 0}
    real_add = store.add_results

    def add_results(batch: str, results: list[LineResult]) -> None:
        if stored["n"] >= 2:  # two answers stored, then the disk is full until the batch is cancelled
            if store.get_batch(batch).status == "in_progress":
                raise OSError(errno.ENOSPC, "No space left on device")
        real_add(batch, results)
        stored["n"] += len(results)

    monkeypatch.setattr(store, "add_results", add_results)
    jobs = BatchJobs(store, None, lambda: False, FAST)  # type: ignore[arg-type]

    async def scenario() -> None:
        for _ in range(4):
            await jobs.step()
        assert store.get_batch(batch_id).status == "in_progress"
        jobs.cancel(batch_id)
        while await jobs.step():
            pass

    asyncio.run(scenario())
    batch = store.get_batch(batch_id)
    # The two stored answers and the one kept in memory while the disk was full are all in the output file.
    assert batch.status == "cancelled" and batch.completed == 3
    assert [x["custom_id"] for x in lines_of(store, batch.output_file_id)] == ["r0", "r1", "r2"]


class BrokenModels:
    """LineModels whose `boom` line hits a bug (a RuntimeError), the others answered by a fake _run."""

    limits = RequestLimits()

    def resolve(self, request, item: BatchItem):
        if item.custom_id == "boom":
            raise RuntimeError("a bug in this line's preparation")
        return "m", None, request

    async def prepare(self, fn, *args):
        return fn(*args)


def test_a_line_that_fails_unexpectedly_is_that_lines_error(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    async def fake_run(models, name, engine, item, request) -> LineResult:
        return LineResult(response_line(item, 200, {"echo": item.body["prompt"]}), item.line, 1, 1)

    monkeypatch.setattr(core_module, "_run", fake_run)
    batch_id = submit(store, [request_line("a"), request_line("boom"), request_line("c")])
    jobs = BatchJobs(store, BrokenModels(), lambda: False, FAST)
    seen = run_to_the_end(jobs)
    batch = store.get_batch(batch_id)
    assert "failed" not in seen and batch.status == "completed" and (batch.completed, batch.failed) == (2, 1)
    assert [x["custom_id"] for x in lines_of(store, batch.output_file_id)] == ["a", "c"]
    (error,) = lines_of(store, batch.error_file_id)
    assert error["custom_id"] == "boom" and error["response"]["status_code"] == 500
    assert error["response"]["body"]["error"]["type"] == "internal_error"
    assert "a bug" not in json.dumps(error)  # a 500 reveals nothing


def test_answer_turns_an_unexpected_exception_into_the_lines_500() -> None:
    item = BatchItem(1, "boom", "/v1/completions", {"prompt": "x"}, None, None)
    result = asyncio.run(answer(BrokenModels(), item))
    assert not result.is_ok and result.line["response"]["status_code"] == 500


def test_a_batch_that_keeps_failing_is_given_up_with_an_output_file(
    store: Store, answers: FakeAnswers, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch_id = submit(store, [request_line(f"r{i}") for i in range(5)])
    real_add = store.add_results

    def add_results(batch: str, results: list[LineResult]) -> None:
        if any(r.item_line >= 3 for r in results):
            raise RuntimeError("a bug storing line 3")  # not the data dir: tried max_failures times, then given up
        real_add(batch, results)

    monkeypatch.setattr(store, "add_results", add_results)
    jobs = BatchJobs(store, None, lambda: False, FAST)  # type: ignore[arg-type]
    run_to_the_end(jobs)
    batch = store.get_batch(batch_id)
    assert batch.status == "failed" and batch.failed_at is not None
    assert batch.errors is not None and "gave up" in batch.errors["data"][0]["message"]
    assert [x["custom_id"] for x in lines_of(store, batch.output_file_id)] == ["r0", "r1"]
    unanswered = lines_of(store, batch.error_file_id)
    assert [x["custom_id"] for x in unanswered] == ["r2", "r3", "r4"]
    assert {x["error"]["code"] for x in unanswered} == {"batch_failed"}
    assert (batch.completed, batch.failed, batch.total) == (2, 3, 5)


# ---- the data dir itself ----------------------------------------------------------------------------


def assert_unlocked(data_dir: Path) -> None:
    with open(data_dir / "lock", "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError if the failed open kept its lock
        fcntl.flock(f, fcntl.LOCK_UN)


def test_a_corrupt_database_is_a_storage_error_naming_the_data_dir_and_releases_the_lock(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    Store(data_dir).close()
    (data_dir / DATABASE).write_bytes(b"this is not a database\x00" * 500)
    with pytest.raises(StorageError) as raised:
        Store(data_dir)
    assert str(data_dir) in str(raised.value) and not raised.value.is_full
    assert_unlocked(data_dir)


def test_a_data_dir_that_is_a_file_is_a_storage_error(tmp_path: Path) -> None:
    path = tmp_path / "not-a-dir"
    path.write_text("x")
    with pytest.raises(StorageError, match=str(path)):
        Store(path)


def test_a_store_error_after_open_names_the_data_dir(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    store.close()
    with pytest.raises(StorageError, match=str(store.data_dir)):
        store.list_batches(limit=10, after=None)


def test_a_failed_upload_leaves_nothing_and_the_next_one_succeeds(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "fsync", failing(1, OSError(errno.ENOSPC, "No space left on device"), os.fsync))
    with pytest.raises(StorageError) as raised:
        store.add_file(io.BytesIO(b"x" * 5000), "big.jsonl", "batch")
    assert raised.value.is_full and str(store.data_dir) in str(raised.value)
    assert list(store.files_dir.iterdir()) == []  # no .part left to fill the disk
    assert store.add_file(io.BytesIO(b"{}\n" * 29), "small.jsonl", "batch").bytes == 87


def test_uploads_past_the_quota_are_refused_and_leave_nothing(store: Store) -> None:
    store.max_stored_bytes = 1000
    store.add_file(io.BytesIO(b"a" * 600), "one.jsonl", "batch")
    with pytest.raises(QuotaError, match="--max-stored-bytes 1000") as raised:
        store.add_file(io.BytesIO(b"b" * 600), "two.jsonl", "batch")
    assert raised.value.is_full
    assert [f.filename for f in store.list_files(purpose=None, limit=10, order="asc", after=None)[0]] == ["one.jsonl"]
    assert len(list(store.files_dir.iterdir())) == 1 and store.stored_bytes() == 600
    store.add_file(io.BytesIO(b"c" * 400), "three.jsonl", "batch")  # exactly full is fine


def test_concurrent_uploads_cannot_pass_the_quota_together(store: Store) -> None:
    """Six uploads of 600 bytes at once under 1,000: each chunk is taken from the quota before it is written,
    so however the writes interleave the stored bytes never pass it, and what fails leaves nothing."""
    import threading

    store.max_stored_bytes = 1000
    barrier, outcomes = threading.Barrier(6), []

    def upload(i: int) -> None:
        writer = store.begin_upload()
        try:
            try:
                writer.write(b"a" * 300)
            finally:
                barrier.wait(timeout=30)  # all six have tried their first half before any writes its second
            writer.write(b"b" * 300)
            outcomes.append(writer.commit(f"{i}.jsonl", "batch"))
        except QuotaError as exc:
            outcomes.append(exc)
        finally:
            writer.abort()

    threads = [threading.Thread(target=upload, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stored = [o for o in outcomes if not isinstance(o, QuotaError)]
    assert len(outcomes) == 6 and len(stored) <= 1
    assert store.stored_bytes() == 600 * len(stored) == sum(f.stat().st_size for f in store.files_dir.iterdir())


def test_a_batchs_answers_count_against_the_quota_until_they_are_its_files(tmp_path: Path) -> None:
    from tests.batch.test_batch_store import result

    store = Store(tmp_path / "data", max_stored_bytes=10_000)
    source = store.add_file(io.BytesIO(b"{}\n" * 10), "in.jsonl", "batch")
    batch = store.add_batch("/v1/completions", source.id, "24h", None, 3600)
    store.transition(batch.id, "in_progress", expected=("validating",), total=100)
    answer_bytes = len(to_json(result(1).line).encode()) + 1
    store.add_results(batch.id, [result(i) for i in range(1, 6)])
    assert store.stored_bytes() == 30 + 5 * answer_bytes
    store.add_results(batch.id, [result(1)])  # answered already: keeps its first answer, counts nothing more
    assert store.stored_bytes() == 30 + 5 * answer_bytes
    room = (10_000 - store.stored_bytes()) // answer_bytes
    with pytest.raises(QuotaError, match="answers would pass the data dir's quota"):
        store.add_results(batch.id, [result(i) for i in range(6, 6 + room + 1)])
    assert store.done_lines(batch.id) == set(range(1, 6))  # all or nothing
    store.transition(batch.id, "finalizing", expected=("in_progress",), outcome="completed")
    done = store.finalize(batch.id)
    output = store.get_file(done.output_file_id)
    assert output.bytes == 5 * answer_bytes and store.stored_bytes() == 30 + output.bytes  # moved, not doubled
    assert store.get_batch(batch.id).completed == 5  # the counts stay
    store.close()
    reopened = Store(tmp_path / "data", max_stored_bytes=10_000)  # counted again from what is stored
    assert reopened.stored_bytes() == 30 + output.bytes
    reopened.delete_file(output.id)
    reopened.delete_file(source.id)
    assert reopened.stored_bytes() == 0
    db = sqlite3.connect(tmp_path / "data" / DATABASE)
    assert db.execute("SELECT sum(length(output)) FROM results").fetchone() == (0,)  # the text left the database
