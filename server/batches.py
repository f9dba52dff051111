"""The Batch API inside the server: the store (moe_serve.batch.store) opened when first used, or at start-up
when the data dir holds a database (to resume its batches); the worker (moe_serve.batch.jobs) on the event
loop, its lines answered like HTTP requests on the served models and kept below interactive traffic; and
what the /v1/files and /v1/batches routes do.

A data dir that cannot be used (not a directory, read-only, a corrupt database, a full disk) is a 503 (507
when full) naming it on these routes only: the server starts and the models serve regardless, and the store
is opened again at the next request, so that fixing the data dir needs no restart."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from moe_serve.api import batches as b
from moe_serve.api import protocol as p
from moe_serve.batch.core import PrefillWindow
from moe_serve.batch.jobs import COMPLETION_WINDOWS, BatchJobs, JobConfig
from moe_serve.batch.jsonl import BatchItem
from moe_serve.batch.store import DATABASE, BatchRecord, FileRecord, Store, storage_error
from moe_serve.engine.async_engine import AsyncEngine
from moe_serve.errors import UnavailableError, ValidationError
from moe_serve.server.lifecycle import Lifecycle
from moe_serve.server.serving import ServingContext
from moe_serve.server.uploads import receive_form

T = TypeVar("T")
logger = logging.getLogger("moe_serve.server")
UPLOAD_FIELDS = ("file", "purpose")
MAX_FORM_FIELDS = 16  # room to name an unknown field in the refusal (more are refused unnamed)
MAX_FILENAME = 255


class ServedModels:
    """The runner's LineModels in the server: a line's model is resolved as an HTTP request's (a `name:k<k>`
    suffix, the one served model when none is named), and prepared in the preparation threads."""

    def __init__(self, ctx: ServingContext, prefill: PrefillWindow) -> None:
        self.ctx = ctx
        self.limits = ctx.settings.limits
        self.prefill = prefill

    def resolve(self, request: p.ModelRequest, item: BatchItem) -> tuple[str, AsyncEngine, p.ModelRequest]:
        served, request = self.ctx.resolve(request)
        return served.name, served.engine, request

    async def prepare(self, fn: Callable[..., T], *args: Any) -> T:
        return await self.ctx.prepare(fn, *args)


class BatchService:
    def __init__(self, ctx: ServingContext, lifecycle: Lifecycle) -> None:
        self.data_dir = ctx.settings.batch_data_dir
        self.lifecycle = lifecycle
        self.config = JobConfig(
            max_in_flight=ctx.settings.batch_max_in_flight, max_in_flight_tokens=ctx.settings.batch_max_in_flight_tokens
        )
        config = self.config
        self.models = ServedModels(
            ctx, PrefillWindow(lambda: config.in_flight_tokens(busy=self.lifecycle.interactive > 0))
        )
        self.max_stored_bytes = ctx.settings.max_stored_bytes
        self.storage_errors = ctx.metrics.batch_storage_errors
        self._store: Store | None = None
        self._jobs: BatchJobs | None = None
        self._task: asyncio.Task | None = None

    def jobs(self) -> BatchJobs:
        """The worker (and its store), started on first use: a server that never sees a batch never
        touches its data dir. Raises UnavailableError when another server holds the data dir, StorageError
        when it cannot be used (tried again at the next call)."""
        if self._jobs is None:
            store = Store(self.data_dir, max_stored_bytes=self.max_stored_bytes)
            self._store = store
            self._jobs = BatchJobs(
                store,
                self.models,
                lambda: self.lifecycle.interactive > 0,
                self.config,
                on_storage_error=lambda stage: self.storage_errors.labels(stage).inc(),
            )
            self._task = asyncio.create_task(self._jobs.run(), name="batch-worker")
        return self._jobs

    @property
    def store(self) -> Store:
        return self.jobs().store

    async def start(self) -> None:
        """At start-up: resume the batches of an existing database."""
        if (self.data_dir / DATABASE).exists():
            try:
                self.jobs()
            except UnavailableError as exc:
                logger.warning("Batch API unavailable: %s", exc)

    async def stop(self) -> None:
        """Stop the worker (lines in flight are dropped, to run again after a restart). Idempotent."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._store is not None:
            self._store.close()
            self._store = None

    # ---- /v1/files ------------------------------------------------------------------------------

    async def upload(self, http: Request) -> b.FileObject:
        form = await receive_form(http, self.store, allowed=UPLOAD_FIELDS, max_fields=MAX_FORM_FIELDS)
        upload = form.upload
        try:
            purpose = form.fields.get("purpose")
            if purpose is None:
                raise ValidationError("purpose is required", parameter="purpose")
            if purpose != "batch":
                raise ValidationError(
                    f"purpose must be 'batch' (the only files this server reads), got {str(purpose)[:64]!r}",
                    parameter="purpose",
                )
            if upload is None:
                raise ValidationError("file is required (a file part of the multipart body)", parameter="file")
            filename = form.filename or "upload.jsonl"
            if len(filename) > MAX_FILENAME or not filename.isprintable():
                message = f"the file name must be at most {MAX_FILENAME} printable characters"
                raise ValidationError(message, parameter="file")
            record = await asyncio.get_running_loop().run_in_executor(None, upload.commit, filename, "batch")
        finally:
            if upload is not None:
                upload.abort()  # nothing, once committed
        return file_object(record)

    def list_files(self, purpose: str | None, limit: int, order: str, after: str | None) -> b.FileList:
        records, has_more = self.store.list_files(purpose=purpose, limit=limit, order=order, after=after)
        data = [file_object(r) for r in records]
        return b.FileList(data=data, first_id=_first(data), last_id=_last(data), has_more=has_more)

    def get_file(self, file_id: str) -> b.FileObject:
        return file_object(self.store.get_file(file_id))

    def file_content(self, file_id: str) -> StreamingResponse:
        path = self.store.file_path(file_id)
        try:
            source = open(path, "rb")  # noqa: SIM115  # opened now: a delete while it streams cannot cut it
            headers = {"Content-Length": str(os.fstat(source.fileno()).st_size)}
        except OSError as exc:
            raise storage_error(exc, self.data_dir, "reading a file") from exc
        return StreamingResponse(_chunks(source), media_type="application/octet-stream", headers=headers)

    def delete_file(self, file_id: str) -> b.FileDeleted:
        self.store.delete_file(file_id)
        return b.FileDeleted(id=file_id, deleted=True)

    # ---- /v1/batches ----------------------------------------------------------------------------

    def create_batch(self, request: b.CreateBatchRequest) -> b.Batch:
        request.refuse_unknown()
        jobs = self.jobs()
        file = jobs.store.get_file(request.input_file_id, parameter="input_file_id")
        if file.purpose != "batch":
            raise ValidationError(
                f"file {file.id} has purpose {file.purpose!r}; a batch reads a file uploaded with purpose 'batch'",
                parameter="input_file_id",
            )
        window = COMPLETION_WINDOWS[request.completion_window]
        record = jobs.store.add_batch(request.endpoint, file.id, request.completion_window, request.metadata, window)
        jobs.wake()
        return batch_object(record)

    def list_batches(self, limit: int, after: str | None) -> b.BatchList:
        records, has_more = self.store.list_batches(limit=limit, after=after)
        data = [batch_object(r) for r in records]
        return b.BatchList(data=data, first_id=_first(data), last_id=_last(data), has_more=has_more)

    def get_batch(self, batch_id: str) -> b.Batch:
        return batch_object(self.store.get_batch(batch_id))

    def cancel_batch(self, batch_id: str) -> b.Batch:
        return batch_object(self.jobs().cancel(batch_id))


def file_object(record: FileRecord) -> b.FileObject:
    return b.FileObject(
        id=record.id,
        bytes=record.bytes,
        created_at=record.created_at,
        filename=record.filename,
        purpose=record.purpose,  # type: ignore[arg-type]  # the store holds only batch and batch_output
    )


def batch_object(record: BatchRecord) -> b.Batch:
    times = {name: getattr(record, name) for name in b.Batch.model_fields if name.endswith("_at")}
    return b.Batch(
        id=record.id,
        endpoint=record.endpoint,
        errors=b.BatchErrors.model_validate(record.errors) if record.errors else None,
        input_file_id=record.input_file_id,
        completion_window=record.completion_window,
        status=record.status,  # type: ignore[arg-type]  # the store's statuses are the API's
        output_file_id=record.output_file_id,
        error_file_id=record.error_file_id,
        request_counts=b.RequestCounts(total=record.total, completed=record.completed, failed=record.failed),
        metadata=record.metadata,
        usage=b.BatchUsage(
            input_tokens=record.prompt_tokens,
            output_tokens=record.completion_tokens,
            total_tokens=record.prompt_tokens + record.completion_tokens,
        ),
        **times,
    )


def _chunks(source: BinaryIO) -> Iterator[bytes]:
    with source:
        while chunk := source.read(1 << 16):
            yield chunk


def _first(data: list[Any]) -> str | None:
    return data[0].id if data else None


def _last(data: list[Any]) -> str | None:
    return data[-1].id if data else None
