"""The Batch API's worker: each batch validated, its lines answered by the shared runner (batch.core) below
interactive traffic, and finalized into output and error files. Every step is in the store before the
next begins, so a server killed at any point resumes where it stopped: an answer is stored once, the
lines not answered yet run after the restart, and the output files are written once."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from moe_serve.batch.core import LineModels, answer, run_items
from moe_serve.batch.jsonl import LineResult, ParsedInput, read_inputs
from moe_serve.batch.store import BatchRecord, Store
from moe_serve.errors import EngineStoppedError, ValidationError
from moe_serve.validation import check_int

logger = logging.getLogger("moe_serve.batch")
COMPLETION_WINDOWS = {"24h": 24 * 3600}  # OpenAI's one window
MAX_ERRORS = 100  # validation errors a failed batch lists (the first ones, by line)
EXPIRED_MESSAGE = "This request could not be executed before the completion window expired."


@dataclass(frozen=True, slots=True)
class JobConfig:
    max_in_flight: int = 64  # lines in flight while no interactive request runs (the engine batches them)
    # ... and while one does: interactive requests go first, and the batch still moves.
    max_in_flight_busy: int = 1
    max_requests: int = 50_000  # lines per batch, as OpenAI allows

    def __post_init__(self) -> None:
        check_int("batch_max_in_flight", self.max_in_flight, 1)
        check_int("max_in_flight_busy", self.max_in_flight_busy, 1)
        check_int("max_requests", self.max_requests, 1)


class BatchJobs:
    """Runs the store's unfinished batches one at a time, oldest first; quick steps (validating,
    finalizing) of any batch go before the lines of the one in progress."""

    def __init__(
        self, store: Store, models: LineModels, is_busy: Callable[[], bool], config: JobConfig | None = None
    ) -> None:
        self.store = store
        self.models = models
        self.is_busy = is_busy
        self.config = config or JobConfig()
        self._wake = asyncio.Event()
        self._cancels: set[str] = set()

    def wake(self) -> None:
        """A batch was created or cancelled: look again."""
        self._wake.set()

    def cancel(self, batch_id: str) -> BatchRecord:
        """Stop a batch: lines in flight are dropped, it finalizes as cancelled with the answers it has."""
        batch = self.store.get_batch(batch_id)
        if batch.status not in ("cancelling", "cancelled"):
            changed = self.store.transition(
                batch_id, "cancelling", expected=("validating", "in_progress"), outcome="cancelled"
            )
            if not changed:
                raise ValidationError(
                    f"batch {batch_id} is {self.store.get_batch(batch_id).status}: only a validating or in_progress "
                    "batch can be cancelled",
                    parameter="batch_id",
                )
            self._cancels.add(batch_id)
            self.wake()
        return self.store.get_batch(batch_id)

    async def run(self) -> None:
        """Forever (until cancelled, or the engines stop): one step of one batch at a time."""
        try:
            while True:
                self._wake.clear()
                if not await self.step():
                    await self._wake.wait()
        except EngineStoppedError:  # the server stops: what is not stored runs after the restart
            return

    async def step(self) -> bool:
        """Advance one batch by one step (validate, run its lines, finalize); False when none is unfinished."""
        batches = self.store.unfinished_batches()
        if not batches:
            return False
        batch = next((b for b in batches if b.status != "in_progress"), batches[0])
        try:
            await self._step(batch)
        except EngineStoppedError:
            raise
        except Exception:  # a bug must not leave the batch stuck, nor retry it for ever
            logger.exception("batch %s failed", batch.id)
            error = {"code": "server_error", "message": "the server failed to run this batch", "param": None}
            self.store.transition(
                batch.id, "failed", expected=("validating", "in_progress", "finalizing", "cancelling"),
                errors={"object": "list", "data": [{**error, "line": None}]},
            )  # fmt: skip
        return True

    async def _step(self, batch: BatchRecord) -> None:
        loop = asyncio.get_running_loop()
        if batch.status == "validating":
            self._validate(batch, await loop.run_in_executor(None, self._parse, batch))
        elif batch.status == "in_progress":
            await self._run(batch, await loop.run_in_executor(None, self._parse, batch))
        else:  # finalizing, cancelling
            await loop.run_in_executor(None, self.store.finalize, batch.id)
            self._cancels.discard(batch.id)

    def _parse(self, batch: BatchRecord) -> ParsedInput:
        # Line ids are salted with the batch id: a custom_id reused in another batch gets other ids.
        return read_inputs(self.store.file_path(batch.input_file_id), urls=(batch.endpoint,), scope=batch.id)

    def _validate(self, batch: BatchRecord, parsed: ParsedInput) -> None:
        errors = [problem.to_error() for problem in parsed.problems[:MAX_ERRORS]]
        if not parsed.items and not parsed.problems:
            errors = [{"code": "empty_file", "message": "the input file has no request lines", "param": None}]
        elif len(parsed.items) + len(parsed.problems) > self.config.max_requests:
            message = f"the input file has more than {self.config.max_requests} lines"
            errors = [{"code": "too_many_requests", "message": message, "param": None}]
        if errors:
            failed = {"object": "list", "data": [{"line": None, **e} for e in errors]}
            self.store.transition(batch.id, "failed", expected=("validating",), errors=failed)
        else:
            self.store.transition(batch.id, "in_progress", expected=("validating",), total=len(parsed.items))

    async def _run(self, batch: BatchRecord, parsed: ParsedInput) -> None:
        done = self.store.done_lines(batch.id)
        pending = [item for item in parsed.items if item.line not in done]
        is_expired = lambda: batch.expires_at is not None and self.store.now() >= batch.expires_at  # noqa: E731
        config = self.config
        finished = not is_expired() and await run_items(
            pending,
            lambda item: answer(self.models, item),
            lambda result: self.store.add_results(batch.id, [result]),
            window=lambda: config.max_in_flight_busy if self.is_busy() else config.max_in_flight,
            should_stop=lambda: batch.id in self._cancels or is_expired(),
        )
        if batch.id in self._cancels:
            return  # the next step finalizes it (cancelling)
        if finished:
            self.store.transition(batch.id, "finalizing", expected=("in_progress",), outcome="completed")
        elif is_expired():
            done = self.store.done_lines(batch.id)
            expired = [
                LineResult(
                    {
                        "id": item.line_id,
                        "custom_id": item.output_custom_id,
                        "response": None,
                        "error": {"code": "batch_expired", "message": EXPIRED_MESSAGE},
                    },
                    item.line,
                )
                for item in parsed.items
                if item.line not in done
            ]
            self.store.expire(batch.id, expired)
