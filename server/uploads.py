"""A POST /v1/files body parsed as it arrives (python-multipart's push parser, as Starlette's form parser
uses it): the form's small fields kept in memory, the file part written straight into the data dir
(Store.begin_upload), each chunk taken from the quota before it is written. Nothing is spooled to the system
temp dir, so no limit is checked only after a whole upload has been stored somewhere else."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from fastapi import Request
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header

from moe_serve.batch.store import Store, Upload
from moe_serve.errors import ValidationError

MAX_FIELD_BYTES = 4096  # a form field (purpose): more is not a field this endpoint reads


@dataclass
class ReceivedForm:
    fields: dict[str, str] = field(default_factory=dict)
    upload: Upload | None = None  # the file part, written (not committed)
    filename: str | None = None


class _Part:
    def __init__(self) -> None:
        self.headers: dict[bytes, bytes] = {}
        self.name = ""
        self.is_file = False
        self.data = bytearray()


class _FormReader:
    """python-multipart's callbacks: fields into `form`, the file part's data into `pending` (written by the
    caller, off the event loop, between chunks)."""

    def __init__(self, store: Store, allowed: tuple[str, ...], max_fields: int) -> None:
        self.store = store
        self.allowed = allowed
        self.max_fields = max_fields
        self.form = ReceivedForm()
        self.part = _Part()
        self.header = b""
        self.value = b""
        self.fields = 0
        self.pending: list[bytes] = []

    def on_part_begin(self) -> None:
        self.part = _Part()

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self.header += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self.value += data[start:end]

    def on_header_end(self) -> None:
        self.part.headers[self.header.lower()] = self.value
        self.header = self.value = b""

    def on_headers_finished(self) -> None:
        part = self.part
        _, disposition = parse_options_header(part.headers.get(b"content-disposition", b""))
        if b"name" not in disposition:
            raise ValidationError('a form part has no name (its Content-Disposition needs name="...")')
        part.name = disposition[b"name"].decode("utf-8", "replace")
        self.fields += 1
        if self.fields > self.max_fields:
            raise ValidationError(f"the form has more than {self.max_fields} fields")
        base = part.name.partition("[")[0]
        if base not in self.allowed:
            raise ValidationError(f"{base} is not implemented by this server; leave it out", parameter=base)
        part.is_file = b"filename" in disposition
        if part.is_file:
            if self.form.upload is not None:
                raise ValidationError("one file per upload", parameter="file")
            self.form.filename = disposition[b"filename"].decode("utf-8", "replace")
            self.form.upload = self.store.begin_upload()

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        part = self.part
        if part.is_file:
            self.pending.append(data[start:end])
        else:
            part.data += data[start:end]
            if len(part.data) > MAX_FIELD_BYTES:
                raise ValidationError(f"{part.name} is longer than {MAX_FIELD_BYTES} bytes", parameter=part.name)

    def on_part_end(self) -> None:
        if not self.part.is_file:
            self.form.fields[self.part.name] = self.part.data.decode("utf-8", "replace")


async def receive_form(http: Request, store: Store, *, allowed: tuple[str, ...], max_fields: int) -> ReceivedForm:
    """Read the multipart body of `http`, refusing by name (ValidationError) a field not in `allowed` (its
    base name: the SDK sends objects as `expires_after[anchor]`) or more than one file, as soon as the part's
    headers arrive. On any failure the file written so far is removed."""
    content_type, options = parse_options_header(http.headers.get("content-type", ""))
    if content_type != b"multipart/form-data" or b"boundary" not in options:
        raise ValidationError("the body must be multipart/form-data with a boundary (a file upload)", parameter="file")
    reader = _FormReader(store, allowed, max_fields)
    form, pending = reader.form, reader.pending
    callbacks = {
        name: getattr(reader, name)
        for name in (
            "on_part_begin", "on_part_data", "on_part_end", "on_header_field", "on_header_value", "on_header_end",
            "on_headers_finished",
        )
    }  # fmt: skip
    parser = MultipartParser(options[b"boundary"], callbacks)  # type: ignore[arg-type]
    loop = asyncio.get_running_loop()
    try:
        try:
            async for chunk in http.stream():
                parser.write(chunk)
                await _flush(form, pending, loop)
            parser.finalize()
            await _flush(form, pending, loop)
        except FormParserError as exc:
            raise ValidationError(f"the multipart body is malformed: {exc}", parameter="file") from None
    except BaseException:
        if form.upload is not None:
            form.upload.abort()
        raise
    return form


async def _flush(form: ReceivedForm, pending: list[bytes], loop: asyncio.AbstractEventLoop) -> None:
    """Write the file data parsed so far (the disk, off the event loop)."""
    if pending and form.upload is not None:
        data = b"".join(pending)
        pending.clear()
        await loop.run_in_executor(None, form.upload.write, data)
