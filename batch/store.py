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
# The answers the quota counts: each as the output line it becomes (its JSON and a newline); a finalized
# batch's answers are in its files, their text blanked here.
STORED_ANSWERS = "SELECT coalesce(sum(length(CAST(output AS BLOB)) + 1), 0) FROM results WHERE output != ''"
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
    """Storing more would take the data dir past --max-stored-bytes: an upload gets 507 naming the quota, a
    batch waits (its answers kept) until files are deleted."""

    def __init__(self, message: str, parameter: str | None = "file") -> None:
        super().__init__(message, is_full=True, parameter=parameter)


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
    def __init__(
        self, data_dir: Path, clock: Callable[[], float] = time.time, max_stored_bytes: int | None = None
    ) -> None:
        """Open (creating) the data dir. Raises UnavailableError when another server holds it, StorageError
        when it cannot be used (not a directory, read-only, a corrupt database); the lock is then released.
        max_stored_bytes: the quota (None: the disk's size) on every byte stored: files, answers, uploads
        being written; each is taken from it before it is written, so that concurrent writers cannot pass it."""
        self.data_dir = data_dir
        self.files_dir = data_dir / "files"
        self.clock = clock
        self.max_stored_bytes = max_stored_bytes
        self._used = 0  # what the quota counts (under _mutex)
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
        # Incremental auto-vacuum (set before the first table: a new database): the pages a finalized batch's
        # answers held go back to the disk, not only to SQLite's free list.
        self._db.execute("PRAGMA auto_vacuum=INCREMENTAL")
        # WAL: a committed result survives the process being killed, at no fsync per line.
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)
        self._mutex = threading.RLock()  # the event loop and the finalizing thread share the connection
        self._remove_orphans()
        (row,) = self._db.execute(f"SELECT coalesce(sum(bytes), 0) + ({STORED_ANSWERS}) AS n FROM files").fetchall()
        self._used = int(row["n"])

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
        """What --max-stored-bytes bounds: every stored file (uploads, batch outputs), the answers in the
        database of batches not finalized (each as the output line it becomes), uploads being written."""
        with self._mutex:
            return self._used

    def _take(self, size: int, what: str, *, parameter: str | None = "file", check: bool = True) -> None:
        """Count `size` bytes against the quota before they are written (QuotaError when they do not fit;
        `check` False: count them regardless, for what must be stored for a batch to end)."""
        with self._mutex:
            room = None if self.max_stored_bytes is None else self.max_stored_bytes - self._used
            if check and room is not None and size > room:
                raise QuotaError(
                    f"{what} would pass the data dir's quota, --max-stored-bytes {self.max_stored_bytes} bytes "
                    f"({max(room, 0)} bytes left); delete files to make room",
                    parameter,
                )
            self._used += size

    def _give_back(self, size: int) -> None:
        with self._mutex:
            self._used -= size

    # ---- files ----------------------------------------------------------------------------------

    def begin_upload(self) -> Upload:
        """An upload written into the data dir as its bytes arrive (Upload.write, then commit or abort)."""
        file_id = f"file-{uuid.uuid4().hex[:24]}"
        with self._io("storing an upload"):
            return Upload(self, file_id, open(self.files_dir / f"{file_id}.part", "wb"))  # noqa: SIM115

    def add_file(self, source: BinaryIO, filename: str, purpose: str) -> FileRecord:
        """Copy a file into the data dir (blocking): begin_upload, a write per MiB, commit. Nothing of it is
        left behind when it fails: QuotaError past the quota, StorageError when the data dir fails."""
        upload = self.begin_upload()
        try:
            while chunk := source.read(1 << 20):
                upload.write(chunk)
            return upload.commit(filename, purpose)
        finally:
            upload.abort()  # nothing, once committed

    def _commit_upload(self, upload: Upload, filename: str, purpose: str) -> FileRecord:
        with self._io("storing an upload"):
            upload.out.flush()
            os.fsync(upload.out.fileno())
            upload.out.close()
            path = self.files_dir / upload.file_id
            upload.part.rename(path)
            record = FileRecord(upload.file_id, filename, purpose, upload.size, self.now())
            try:
                with self._transaction() as db:
                    db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?)", _values(record))
            except BaseException:
                path.unlink(missing_ok=True)
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
        record = self.get_file(file_id)
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
        self._give_back(record.bytes)
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
        """Store answered lines; a line stored already keeps its first answer (a line is answered once).
        QuotaError when they do not fit the quota: the batch waits, its answers kept by the caller."""
        self._insert_results(batch_id, results, check=True)

    def _insert_results(
        self, batch_id: str, results: list[LineResult], *, check: bool = False, db: sqlite3.Connection | None = None
    ) -> None:
        """Insert answers (in `db`'s transaction, or in one of their own), counted against the quota."""
        rows = [(r.item_line, int(r.is_ok), r.prompt_tokens, r.completion_tokens, to_json(r.line)) for r in results]
        size = sum(len(row[-1].encode("utf-8")) + 1 for row in rows)  # + 1: the newline of its output line
        self._take(size, "the batch's answers", parameter=None, check=check)
        stored = 0
        try:
            with contextlib.ExitStack() as stack:
                target = db if db is not None else stack.enter_context(self._transaction())
                for row in rows:
                    if target.execute(
                        "INSERT OR IGNORE INTO results VALUES (?, ?, ?, ?, ?, ?)", (batch_id, *row)
                    ).rowcount:
                        stored += len(row[-1].encode("utf-8")) + 1
        except BaseException:
            self._give_back(size)
            raise
        self._give_back(size - stored)  # lines answered already keep their first answer

    def expire(self, batch_id: str, results: list[LineResult]) -> bool:
        """An in-progress batch past its window: the lines not answered get `results` (batch_expired), and
        the batch finalizes as expired; both in one transaction, so a kill cannot leave one without the other."""
        with self._transaction() as db:
            if not self._transition(db, batch_id, "finalizing", ("in_progress",), {"outcome": "expired"}):
                return False
            self._insert_results(batch_id, results, db=db)
            return True

    def give_up(self, batch_id: str, results: list[LineResult], errors: dict[str, Any]) -> bool:
        """An in-progress batch the server gave up on: the lines not answered get `results` (batch_failed)
        and the batch finalizes as failed, with `errors` saying why (one transaction, as expire)."""
        with self._transaction() as db:
            columns = {"outcome": "failed", "errors": errors}
            if not self._transition(db, batch_id, "finalizing", ("in_progress",), columns):
                return False
            self._insert_results(batch_id, results, db=db)
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
                # The answers are in the files now: their text leaves the database (the counts stay).
                (answers,) = db.execute(f"{STORED_ANSWERS} AND batch_id = ?", (batch_id,)).fetchone()
                db.execute("UPDATE results SET output = '' WHERE batch_id = ?", (batch_id,))
                columns = {
                    "output_file_id": output.id if output else None,
                    "error_file_id": errors.id if errors else None,
                }
                if not self._transition(db, batch_id, batch.outcome, ("finalizing", "cancelling"), columns):
                    raise RuntimeError(f"batch {batch_id} left {batch.status} while it was finalized")  # rolled back
            committed = True
            self._give_back(answers - sum(r.bytes for r in written.values()))  # 0: each answer became its line
            with contextlib.suppress(sqlite3.Error), self._mutex:
                self._connection().execute("PRAGMA incremental_vacuum")
        finally:
            leftovers = list(parts.values()) + ([] if committed else [self.files_dir / r.id for r in written.values()])
            for path in leftovers:
                with contextlib.suppress(OSError):
                    path.unlink(missing_ok=True)
        return self.get_batch(batch_id)


def _values(record: Any) -> tuple:
    return tuple(getattr(record, f.name) for f in fields(record))


def _marks(values: tuple) -> str:
    return ", ".join("?" * len(values))


def _json(value: Any) -> str | None:
    return json.dumps(value) if value is not None else None


class Upload:
    """A file being written into the data dir (files/<id>.part) as its bytes arrive: each chunk is taken from
    the quota before it is written; commit() makes it a stored file, abort() (idempotent; nothing once
    committed) removes it and gives its bytes back."""

    def __init__(self, store: Store, file_id: str, out: BinaryIO) -> None:
        self.store = store
        self.file_id = file_id
        self.part = store.files_dir / f"{file_id}.part"
        self.out = out
        self.size = 0
        self._state = "open"

    def write(self, chunk: bytes) -> None:
        self.store._take(len(chunk), "the upload")
        self.size += len(chunk)
        with self.store._io("storing an upload"):
            self.out.write(chunk)

    def commit(self, filename: str, purpose: str) -> FileRecord:
        record = self.store._commit_upload(self, filename, purpose)
        self._state = "committed"
        return record

    def abort(self) -> None:
        if self._state != "open":
            return
        self._state = "aborted"
        with contextlib.suppress(OSError):
            self.out.close()
        with contextlib.suppress(OSError):
            self.part.unlink(missing_ok=True)
        self.store._give_back(self.size)
