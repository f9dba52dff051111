"""The Batch API's persistent state: an embedded SQLite database (files, batches, and every batch line's
result, stored the moment it completes) beside a folder holding the files' bytes.

One server owns a data dir at a time (an exclusive lock, released by the kernel even on kill -9), so no
batch is ever run by two processes. Every change of state is one transaction; file bytes are written
before the row that names them, and bytes without a row (a kill in between) are removed at the next open.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, BinaryIO

from moe_serve.batch.jsonl import LineResult, to_json
from moe_serve.errors import NotFoundError, UnavailableError, ValidationError

DATABASE = "batches.sqlite3"
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")
PAGE = 1000  # result rows read at a time while finalizing (the lock is released between pages)
SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, filename TEXT NOT NULL, purpose TEXT NOT NULL, bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL, completion_window TEXT NOT NULL,
    status TEXT NOT NULL, outcome TEXT, metadata TEXT, errors TEXT, total INTEGER NOT NULL DEFAULT 0,
    output_file_id TEXT, error_file_id TEXT, created_at INTEGER NOT NULL, expires_at INTEGER,
    in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER, expired_at INTEGER,
    cancelling_at INTEGER, cancelled_at INTEGER
);
CREATE TABLE IF NOT EXISTS results (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, is_ok INTEGER NOT NULL, prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL, output TEXT NOT NULL, PRIMARY KEY (batch_id, line)
) WITHOUT ROWID;
"""


@dataclass(slots=True)
class FileRecord:
    id: str
    filename: str
    purpose: str
    bytes: int
    created_at: int


@dataclass(slots=True)
class BatchRecord:
    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    outcome: str | None  # the status finalizing leads to: completed, expired or cancelled
    metadata: dict[str, str] | None
    errors: dict[str, Any] | None  # why validation failed: {"object": "list", "data": [...]}
    total: int
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    expires_at: int | None
    in_progress_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    completed: int = 0  # lines answered with status 200
    failed: int = 0  # lines answered otherwise
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def is_finished(self) -> bool:
        return self.status not in UNFINISHED


class Store:
    def __init__(self, data_dir: Path, clock: Callable[[], float] = time.time) -> None:
        self.data_dir = data_dir
        self.files_dir = data_dir / "files"
        self.clock = clock
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self._lock_file = open(data_dir / "lock", "a+b")  # noqa: SIM115  # held open: the lock lives with it
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise UnavailableError(
                f"the data dir {data_dir} is in use by another moe-serve server; give each server its own --data-dir"
            ) from None
        self._db = sqlite3.connect(data_dir / DATABASE, isolation_level=None, check_same_thread=False)
        self._db.row_factory = sqlite3.Row
        # WAL: a committed result survives the process being killed, at no fsync per line.
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)
        self._mutex = threading.RLock()  # the event loop and the finalizing thread share the connection
        self._remove_orphans()

    def close(self) -> None:
        with self._mutex:
            self._db.close()
        self._lock_file.close()

    def now(self) -> int:
        return int(self.clock())

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._mutex:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _query(self, sql: str, *args: Any) -> list[sqlite3.Row]:
        with self._mutex:
            return self._db.execute(sql, args).fetchall()

    def _remove_orphans(self) -> None:
        known = {row["id"] for row in self._query("SELECT id FROM files")}
        for path in self.files_dir.iterdir():
            if path.name not in known:
                path.unlink(missing_ok=True)

    # ---- files ----------------------------------------------------------------------------------

    def add_file(self, source: BinaryIO, filename: str, purpose: str) -> FileRecord:
        """Copy an upload into the data dir (blocking: the server calls this in a thread)."""
        file_id = f"file-{uuid.uuid4().hex[:24]}"
        path = self.files_dir / file_id
        with open(path.with_suffix(".part"), "wb") as out:
            shutil.copyfileobj(source, out, 1 << 20)
            out.flush()
            os.fsync(out.fileno())
        path.with_suffix(".part").rename(path)
        record = FileRecord(file_id, filename, purpose, path.stat().st_size, self.now())
        with self._transaction() as db:
            db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?)", _values(record))
        return record

    def get_file(self, file_id: str, parameter: str = "file_id") -> FileRecord:
        rows = self._query("SELECT * FROM files WHERE id = ?", file_id)
        if not rows:
            raise NotFoundError(f"no file {file_id!r}", parameter=parameter)
        return FileRecord(**dict(rows[0]))

    def file_path(self, file_id: str) -> Path:
        return self.files_dir / self.get_file(file_id).id

    def list_files(
        self, *, purpose: str | None, limit: int, order: str, after: str | None
    ) -> tuple[list[FileRecord], bool]:
        """A page of files, newest first ("desc") or oldest first, after the file `after`; and whether more follow."""
        where, args = self._page("files", order, after)
        if purpose is not None:
            where, args = where + " AND purpose = ?", [*args, purpose]
        direction = "DESC" if order == "desc" else "ASC"
        rows = self._query(f"SELECT * FROM files WHERE {where} ORDER BY rowid {direction} LIMIT ?", *args, limit + 1)
        return [FileRecord(**dict(r)) for r in rows[:limit]], len(rows) > limit

    def delete_file(self, file_id: str) -> None:
        self.get_file(file_id)
        with self._transaction() as db:
            user = db.execute(
                f"SELECT id FROM batches WHERE input_file_id = ? AND status IN ({_marks(UNFINISHED)})",
                (file_id, *UNFINISHED),
            ).fetchone()
            if user is not None:
                raise ValidationError(
                    f"file {file_id!r} is the input of batch {user['id']}, which has not finished; cancel it first",
                    parameter="file_id",
                )
            db.execute("DELETE FROM files WHERE id = ?", (file_id,))
        (self.files_dir / file_id).unlink(missing_ok=True)

    def _page(self, table: str, order: str, after: str | None) -> tuple[str, list[Any]]:
        """The WHERE clause of a page that starts after the row `after` (a cursor: its id)."""
        if after is None:
            return "1", []
        if not self._query(f"SELECT 1 FROM {table} WHERE id = ?", after):
            raise NotFoundError(f"no {table[:-1]} {after!r} to list after", parameter="after")
        comparison = "<" if order == "desc" else ">"
        return f"rowid {comparison} (SELECT rowid FROM {table} WHERE id = ?)", [after]

    # ---- batches --------------------------------------------------------------------------------

    def add_batch(
        self, endpoint: str, input_file_id: str, completion_window: str, metadata: dict | None, window_seconds: int
    ) -> BatchRecord:
        batch_id, now = f"batch_{uuid.uuid4().hex[:24]}", self.now()
        with self._transaction() as db:
            db.execute(
                "INSERT INTO batches (id, endpoint, input_file_id, completion_window, status, metadata, created_at, "
                "expires_at) VALUES (?, ?, ?, ?, 'validating', ?, ?, ?)",
                (batch_id, endpoint, input_file_id, completion_window, _json(metadata), now, now + window_seconds),
            )
        return self.get_batch(batch_id)

    def get_batch(self, batch_id: str) -> BatchRecord:
        rows = self._query("SELECT * FROM batches WHERE id = ?", batch_id)
        if not rows:
            raise NotFoundError(f"no batch {batch_id!r}", parameter="batch_id")
        return self._batch(rows[0])

    def list_batches(self, *, limit: int, after: str | None) -> tuple[list[BatchRecord], bool]:
        """A page of batches, newest first, after the batch `after`; and whether more follow."""
        where, args = self._page("batches", "desc", after)
        rows = self._query(f"SELECT * FROM batches WHERE {where} ORDER BY rowid DESC LIMIT ?", *args, limit + 1)
        return [self._batch(r) for r in rows[:limit]], len(rows) > limit

    def unfinished_batches(self) -> list[BatchRecord]:
        rows = self._query(f"SELECT * FROM batches WHERE status IN ({_marks(UNFINISHED)}) ORDER BY rowid", *UNFINISHED)
        return [self._batch(r) for r in rows]

    def transition(self, batch_id: str, status: str, *, expected: tuple[str, ...], **columns: Any) -> bool:
        """Move a batch to `status` (stamping `<status>_at`) if it is in one of the `expected` states:
        False when it is not (another change came first, such as a cancel)."""
        with self._transaction() as db:
            return self._transition(db, batch_id, status, expected, columns)

    def _transition(
        self, db: sqlite3.Connection, batch_id: str, status: str, expected: tuple[str, ...], columns: dict[str, Any]
    ) -> bool:
        columns = {f"{status}_at": self.now(), **columns}
        sets = ", ".join(f"{name} = ?" for name in columns)
        values = (_json(v) if isinstance(v, dict | list) else v for v in columns.values())
        cursor = db.execute(
            f"UPDATE batches SET status = ?, {sets} WHERE id = ? AND status IN ({_marks(expected)})",
            (status, *values, batch_id, *expected),
        )
        return cursor.rowcount == 1

    def _batch(self, row: sqlite3.Row) -> BatchRecord:
        data = dict(row)
        data["metadata"] = json.loads(data["metadata"]) if data["metadata"] else None
        data["errors"] = json.loads(data["errors"]) if data["errors"] else None
        (counts,) = self._query(
            "SELECT count(*) AS n, coalesce(sum(is_ok), 0) AS ok, coalesce(sum(prompt_tokens), 0) AS p, "
            "coalesce(sum(completion_tokens), 0) AS c FROM results WHERE batch_id = ?",
            data["id"],
        )
        return BatchRecord(
            **data, completed=counts["ok"], failed=counts["n"] - counts["ok"], prompt_tokens=counts["p"],
            completion_tokens=counts["c"],
        )  # fmt: skip

    # ---- results --------------------------------------------------------------------------------

    def add_results(self, batch_id: str, results: list[LineResult]) -> None:
        """Store answered lines; a line stored already keeps its first answer (a line is answered once)."""
        with self._transaction() as db:
            _insert_results(db, batch_id, results)

    def expire(self, batch_id: str, results: list[LineResult]) -> bool:
        """An in-progress batch past its window: the lines not answered get `results` (batch_expired), and
        the batch finalizes as expired; both in one transaction, so a kill cannot leave one without the other."""
        with self._transaction() as db:
            if not self._transition(db, batch_id, "finalizing", ("in_progress",), {"outcome": "expired"}):
                return False
            _insert_results(db, batch_id, results)
            return True

    def done_lines(self, batch_id: str) -> set[int]:
        return {row["line"] for row in self._query("SELECT line FROM results WHERE batch_id = ?", batch_id)}

    def finalize(self, batch_id: str) -> BatchRecord:
        """Write the output file (lines answered 200) and the error file (the others), in input order, and
        move the batch to its outcome (blocking: the server calls this in a thread)."""
        batch = self.get_batch(batch_id)
        assert batch.outcome is not None and batch.status in ("finalizing", "cancelling"), batch.status
        written: dict[bool, FileRecord] = {}
        parts = {is_ok: self.files_dir / f"{uuid.uuid4().hex}.part" for is_ok in (True, False)}
        try:
            with open(parts[True], "wb") as ok_out, open(parts[False], "wb") as error_out:
                last = 0
                while rows := self._query(
                    "SELECT line, is_ok, output FROM results WHERE batch_id = ? AND line > ? ORDER BY line LIMIT ?",
                    batch_id, last, PAGE,
                ):  # fmt: skip
                    for row in rows:
                        (ok_out if row["is_ok"] else error_out).write(row["output"].encode("utf-8") + b"\n")
                    last = rows[-1]["line"]
                for out in (ok_out, error_out):
                    out.flush()
                    os.fsync(out.fileno())
            for is_ok, part in parts.items():
                size = part.stat().st_size
                if size:
                    file_id = f"file-{uuid.uuid4().hex[:24]}"
                    part.rename(self.files_dir / file_id)
                    name = f"{batch_id}_{'output' if is_ok else 'error'}.jsonl"
                    written[is_ok] = FileRecord(file_id, name, "batch_output", size, self.now())
        finally:
            for part in parts.values():
                part.unlink(missing_ok=True)
        output, errors = written.get(True), written.get(False)
        with self._transaction() as db:  # the files and the batch's new state together, or neither
            for record in written.values():
                db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?)", _values(record))
            columns = {"output_file_id": output.id if output else None, "error_file_id": errors.id if errors else None}
            if not self._transition(db, batch_id, batch.outcome, ("finalizing", "cancelling"), columns):
                raise RuntimeError(f"batch {batch_id} left {batch.status} while it was finalized")  # rolled back
        return self.get_batch(batch_id)


def _insert_results(db: sqlite3.Connection, batch_id: str, results: list[LineResult]) -> None:
    db.executemany(
        "INSERT OR IGNORE INTO results VALUES (?, ?, ?, ?, ?, ?)",
        [(batch_id, r.item_line, int(r.is_ok), r.prompt_tokens, r.completion_tokens, to_json(r.line)) for r in results],
    )


def _values(record: Any) -> tuple:
    return tuple(getattr(record, f.name) for f in fields(record))


def _marks(values: tuple) -> str:
    return ", ".join("?" * len(values))


def _json(value: Any) -> str | None:
    return json.dumps(value) if value is not None else None
