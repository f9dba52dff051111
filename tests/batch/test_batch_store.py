"""The Batch API's SQLite store: files and their bytes, pagination, one owner per data dir, results stored
once, finalizing into output and error files, and what a kill leaves behind cleaned up at the next open."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from moe_serve.batch.jsonl import LineResult
from moe_serve.batch.store import Store
from moe_serve.errors import NotFoundError, UnavailableError, ValidationError


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def store(tmp_path: Path):
    s = Store(tmp_path / "data", Clock())
    yield s
    s.close()


def result(line: int, ok: bool = True, tokens: tuple[int, int] = (3, 4)) -> LineResult:
    status = 200 if ok else 400
    body = {"text": f"answer {line}"} if ok else {"error": {"message": "bad", "type": "x", "param": None, "code": 400}}
    output = {
        "id": f"batch_req_{line}",
        "custom_id": f"c{line}",
        "response": {"status_code": status, "request_id": f"batch_req_{line}", "body": body},
        "error": None,
    }
    return LineResult(output, line, *tokens)


def test_files_keep_their_bytes_and_list_in_pages(store: Store) -> None:
    ids = [store.add_file(io.BytesIO(f"file {i}\n".encode()), f"f{i}.jsonl", "batch").id for i in range(5)]
    record = store.get_file(ids[0])
    assert (record.filename, record.purpose, record.bytes) == ("f0.jsonl", "batch", 7)
    assert store.file_path(ids[0]).read_bytes() == b"file 0\n"
    page, has_more = store.list_files(purpose=None, limit=2, order="desc", after=None)
    assert [f.id for f in page] == [ids[4], ids[3]] and has_more
    page, has_more = store.list_files(purpose=None, limit=10, order="desc", after=ids[3])
    assert [f.id for f in page] == [ids[2], ids[1], ids[0]] and not has_more
    page, _ = store.list_files(purpose=None, limit=2, order="asc", after=ids[0])
    assert [f.id for f in page] == ids[1:3]
    assert store.list_files(purpose="batch_output", limit=10, order="desc", after=None) == ([], False)
    with pytest.raises(NotFoundError) as missing:
        store.list_files(purpose=None, limit=2, order="desc", after="file-nope")
    assert missing.value.parameter == "after"
    store.delete_file(ids[0])
    with pytest.raises(NotFoundError) as gone:
        store.get_file(ids[0])
    assert gone.value.parameter == "file_id" and not (store.files_dir / ids[0]).exists()


def test_a_data_dir_has_one_owner(tmp_path: Path) -> None:
    first = Store(tmp_path / "data")
    with pytest.raises(UnavailableError, match="in use by another moe-serve server"):
        Store(tmp_path / "data")
    first.close()
    Store(tmp_path / "data").close()  # released with its owner


def test_bytes_without_a_row_are_removed_at_the_next_open(tmp_path: Path) -> None:
    store = Store(tmp_path / "data")
    kept = store.add_file(io.BytesIO(b"x\n"), "in.jsonl", "batch")
    store.close()
    (tmp_path / "data" / "files" / "file-orphan").write_bytes(b"written, then killed before its row")
    (tmp_path / "data" / "files" / "abc.part").write_bytes(b"half an upload")
    store = Store(tmp_path / "data")
    assert sorted(p.name for p in store.files_dir.iterdir()) == [kept.id]
    store.close()


def test_batch_states_results_once_and_finalizing(store: Store) -> None:
    source = store.add_file(io.BytesIO(b"{}\n"), "in.jsonl", "batch")
    batch = store.add_batch("/v1/completions", source.id, "24h", {"team": "nlp"}, 3600)
    assert (batch.status, batch.created_at, batch.expires_at, batch.metadata) == (
        "validating", 1_000_000, 1_003_600, {"team": "nlp"}
    )  # fmt: skip
    with pytest.raises(ValidationError, match="cancel it first"):
        store.delete_file(source.id)  # an unfinished batch still reads it
    assert store.transition(batch.id, "in_progress", expected=("validating",), total=4)
    assert not store.transition(batch.id, "in_progress", expected=("validating",))  # the state moved on
    store.add_results(batch.id, [result(3), result(1, ok=False)])
    store.add_results(batch.id, [result(3, tokens=(100, 100)), result(2)])  # line 3 keeps its first answer
    batch = store.get_batch(batch.id)
    assert (batch.total, batch.completed, batch.failed) == (4, 2, 1)
    assert (batch.prompt_tokens, batch.completion_tokens) == (9, 12)
    assert store.done_lines(batch.id) == {1, 2, 3}
    assert store.transition(batch.id, "finalizing", expected=("in_progress",), outcome="completed")
    done = store.finalize(batch.id)
    assert done.status == "completed" and done.completed_at == done.finalizing_at == 1_000_000
    output = store.file_path(done.output_file_id).read_text().splitlines()
    errors = store.file_path(done.error_file_id).read_text().splitlines()
    assert [json.loads(x)["custom_id"] for x in output] == ["c2", "c3"]  # input order, each once
    assert [json.loads(x)["custom_id"] for x in errors] == ["c1"]
    assert store.get_file(done.output_file_id).purpose == "batch_output"
    assert store.get_file(done.output_file_id).filename == f"{batch.id}_output.jsonl"
    store.delete_file(source.id)  # finished: its input may go


def test_batch_pages_are_newest_first(store: Store) -> None:
    source = store.add_file(io.BytesIO(b"{}\n"), "in.jsonl", "batch")
    ids = [store.add_batch("/v1/score", source.id, "24h", None, 60).id for _ in range(3)]
    page, has_more = store.list_batches(limit=2, after=None)
    assert [b.id for b in page] == [ids[2], ids[1]] and has_more
    page, has_more = store.list_batches(limit=2, after=ids[1])
    assert [b.id for b in page] == [ids[0]] and not has_more
    with pytest.raises(NotFoundError) as missing:
        store.get_batch("batch_nope")
    assert missing.value.parameter == "batch_id"


def test_an_expired_batch_records_its_unanswered_lines_with_its_state(store: Store) -> None:
    source = store.add_file(io.BytesIO(b"{}\n"), "in.jsonl", "batch")
    batch = store.add_batch("/v1/score", source.id, "24h", None, 60)
    store.transition(batch.id, "in_progress", expected=("validating",), total=2)
    store.add_results(batch.id, [result(1)])
    expired = LineResult({"id": "r2", "custom_id": "c2", "response": None, "error": {"code": "batch_expired"}}, 2)
    assert store.expire(batch.id, [expired])
    assert not store.expire(batch.id, [expired])  # once
    done = store.finalize(batch.id)
    assert (done.status, done.completed, done.failed) == ("expired", 1, 1) and done.expired_at is not None
