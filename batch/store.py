"""The Batch API's persistent state: an embedded SQLite database (files, batches, and every batch line's
result, stored the moment it completes) beside a folder holding the files' bytes.

One server owns a data dir at a time (an exclusive lock, released by the kernel even on kill -9), so no
batch is ever run by two processes. Every change of state is one transaction; file bytes are written
before the row that names them, and bytes without a row (a kill in between) are removed at the next open.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
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
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
SQLITE_FULL = 13  # "database or disk is full"
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


class StorageError(UnavailableError):
    """The data dir cannot be read or written now (a full disk, an I/O error, a read-only or unusable dir, a
    corrupt database): a 503 naming the data dir (507 when it is full), and for the batch worker a pause
    before the step is tried again, never a reason to fail a batch. `is_full`: no space (or quota) left."""

    def __init__(self, message: str, *, is_full: bool = False, parameter: str | None = None) -> None:
        super().__init__(message)
        self.is_full = is_full
        self.parameter = parameter


class QuotaError(StorageError):
    """An upload would take the stored files past --max-stored-bytes (507 naming the quota)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, is_full=True, parameter="file")


def is_storage_error(exc: BaseException) -> bool:
    """Whether `exc` is the data dir failing (an OSError; sqlite3's full disk, I/O error, locked, read-only or
    corrupt database), not a bug (a misused connection, a broken constraint) nor a request's fault."""
    if isinstance(exc, StorageError | OSError | sqlite3.OperationalError):
        return True
    return type(exc) is sqlite3.DatabaseError  # "file is not a database", "database disk image is malformed"


def storage_error(exc: BaseException, data_dir: Path, doing: str) -> StorageError:
    """`exc` (an OSError or sqlite3.Error) as the StorageError a client and the worker see."""
    if isinstance(exc, StorageError):
        return exc
    is_full = (isinstance(exc, OSError) and exc.errno in FULL_ERRNOS) or (
        isinstance(exc, sqlite3.Error) and getattr(exc, "sqlite_errorcode", None) == SQLITE_FULL
    )
    reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    if is_full:
        reason = "no space left on the device"
    return StorageError(f"the Batch API's data dir {data_dir} cannot be used ({doing}): {reason}", is_full=is_full)


class Store:
    def __init__(self, data_dir: Path, clock: Callable[[], float] = time.time) -> None:
        """Open (creating) the data dir. Raises UnavailableError when another server holds it, StorageError
        when it cannot be used (not a directory, read-only, a corrupt database); the lock is then released."""
        self.data_dir = data_dir
        self.files_dir = data_dir / "files"
        self.clock = clock
        self._lock_file: BinaryIO | None = None
        self._db: sqlite3.Connection | None = None
        try:
            self._open()
        except BaseException as exc:
            self._release()  # the lock too: another try (or server) may open the data dir once it is fixed
            if is_storage_error(exc):
                raise storage_error(exc, data_dir, "opening it") from exc
            raise

    def _open(self) -> None:
        data_dir = self.data_dir
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self._lock_file = open(data_dir / "lock", "a+b")  # noqa: SIM115  # held open: the lock lives with it
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            self._lock_file = None
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

    def _release(self) -> None:
        if self._db is not None:
            with contextlib.suppress(sqlite3.Error):
                self._db.close()
            self._db = None
        if self._lock_file is not None:
            with contextlib.suppress(OSError):
                self._lock_file.close()  # the flock goes with the descriptor
            self._lock_file = None

    def close(self) -> None:
        with self._mutex:
            self._release()

    @contextlib.contextmanager
    def _io(self, doing: str) -> Iterator[None]:
        """The data dir's own failures (OSError, sqlite3.Error) as StorageError naming it."""
        try:
            yield
        except (OSError, sqlite3.DatabaseError) as exc:
            if not is_storage_error(exc):
                raise
            raise storage_error(exc, self.data_dir, doing) from exc

    def now(self) -> int:
        return int(self.clock())

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._mutex, self._io("writing its database"):
            db = self._connection()
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                if db.in_transaction:  # sqlite may have rolled back already (a full disk, an I/O error)
                    with contextlib.suppress(sqlite3.Error):
                        db.execute("ROLLBACK")
                raise
            try:
                db.execute("COMMIT")
            except sqlite3.Error:
                if db.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        db.execute("ROLLBACK")
                raise

    def _query(self, sql: str, *args: Any) -> list[sqlite3.Row]:
        with self._mutex, self._io("reading its database"):
            return self._connection().execute(sql, args).fetchall()

    def _connection(self) -> sqlite3.Connection:
        if self._db is None:
            raise StorageError(f"the Batch API's data dir {self.data_dir} is closed")
        return self._db

    def _remove_orphans(self) -> None:
        known = {row["id"] for row in self._connection().execute("SELECT id FROM files").fetchall()}
        for path in self.files_dir.iterdir():
            if path.name not in known:
                path.unlink(missing_ok=True)

    def stored_bytes(self) -> int:
        """The bytes of every stored file (uploads and batch outputs): what --max-stored-bytes bounds."""
        (row,) = self._query("SELECT coalesce(sum(bytes), 0) AS n FROM files")
        return int(row["n"])

    # ---- files ----------------------------------------------------------------------------------

    def add_file(
        self, source: BinaryIO, filename: str, purpose: str, *, max_stored_bytes: int | None = None
    ) -> FileRecord:
        """Copy an upload into the data dir (blocking: the server calls this in a thread). Nothing of it is
        left behind when it fails: QuotaError when the stored files would pass `max_stored_bytes`,
        StorageError when the data dir fails (a full disk)."""
        file_id = f"file-{uuid.uuid4().hex[:24]}"
        path, part = self.files_dir / file_id, self.files_dir / f"{file_id}.part"
        room = None if max_stored_bytes is None else max_stored_bytes - self.stored_bytes()
        try:
            with self._io("storing an upload"):
                size = 0
                with open(part, "wb") as out:
                    while chunk := source.read(1 << 20):
                        size += len(chunk)
                        if room is not None and size > room:
                            raise QuotaError(
                                f"the stored files would pass the data dir's quota, --max-stored-bytes "
                                f"{max_stored_bytes} bytes ({max(room, 0)} bytes left); delete files to make room"
                            )
                        out.write(chunk)
                    out.flush()
                    os.fsync(out.fileno())
                part.rename(path)
                record = FileRecord(file_id, filename, purpose, size, self.now())
                with self._transaction() as db:
                    db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?)", _values(record))
        except BaseException:
            for leftover in (part, path):
                with contextlib.suppress(OSError):
                    leftover.unlink(missing_ok=True)
            raise
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
        with contextlib.suppress(OSError):  # the row is gone: bytes left behind are removed at the next open
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

    def give_up(self, batch_id: str, results: list[LineResult], errors: dict[str, Any]) -> bool:
        """An in-progress batch the server gave up on: the lines not answered get `results` (batch_failed)
        and the batch finalizes as failed, with `errors` saying why (one transaction, as expire)."""
        with self._transaction() as db:
            columns = {"outcome": "failed", "errors": errors}
            if not self._transition(db, batch_id, "finalizing", ("in_progress",), columns):
                return False
            _insert_results(db, batch_id, results)
            return True

    def done_lines(self, batch_id: str) -> set[int]:
        return {row["line"] for row in self._query("SELECT line FROM results WHERE batch_id = ?", batch_id)}

    def finalize(self, batch_id: str) -> BatchRecord:
        """Write the output file (lines answered 200) and the error file (the others), in input order, and
        move the batch to its outcome (blocking: the server calls this in a thread). When it fails (a full
        disk: StorageError) nothing of it is left behind and the batch is still finalizing, to try again."""
        batch = self.get_batch(batch_id)
        assert batch.outcome is not None and batch.status in ("finalizing", "cancelling"), batch.status
        written: dict[bool, FileRecord] = {}
        parts = {is_ok: self.files_dir / f"{uuid.uuid4().hex}.part" for is_ok in (True, False)}
        committed = False
        try:
            with self._io("writing a batch's output files"):
                with open(parts[True], "wb") as ok_out, open(parts[False], "wb") as error_out:
                    last = 0
                    while rows := self._query(
                        "SELECT line, is_ok, output FROM results WHERE batch_id = ? AND line > ? ORDER BY line "
                        "LIMIT ?",
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
                        name = f"{batch_id}_{'output' if is_ok else 'error'}.jsonl"
                        written[is_ok] = FileRecord(file_id, name, "batch_output", size, self.now())
                        part.rename(self.files_dir / file_id)
            output, errors = written.get(True), written.get(False)
            with self._transaction() as db:  # the files and the batch's new state together, or neither
                for record in written.values():
                    db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?)", _values(record))
                columns = {
                    "output_file_id": output.id if output else None,
                    "error_file_id": errors.id if errors else None,
                }
                if not self._transition(db, batch_id, batch.outcome, ("finalizing", "cancelling"), columns):
                    raise RuntimeError(f"batch {batch_id} left {batch.status} while it was finalized")  # rolled back
            committed = True
        finally:
            leftovers = list(parts.values()) + ([] if committed else [self.files_dir / r.id for r in written.values()])
            for path in leftovers:
                with contextlib.suppress(OSError):
                    path.unlink(missing_ok=True)
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
