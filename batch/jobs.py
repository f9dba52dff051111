"""The Batch API's worker: each batch validated, its lines answered by the shared runner (batch.core) below
interactive traffic, and finalized into output and error files. Every step is in the store before the
next begins, so a server killed at any point resumes where it stopped: an answer is stored once, the
lines not answered yet run after the restart, and the output files are written once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

from moe_serve.batch.core import MAX_IN_FLIGHT_TOKENS, LineModels, answer, run_items
from moe_serve.batch.jsonl import BatchItem, LineResult, ParsedInput, read_inputs
from moe_serve.batch.store import BatchRecord, QuotaError, Store, is_storage_error
from moe_serve.errors import EngineStoppedError, ValidationError
from moe_serve.validation import check_int, check_number

logger = logging.getLogger("moe_serve.batch")
COMPLETION_WINDOWS = {"24h": 24 * 3600}  # OpenAI's one window
MAX_ERRORS = 100  # validation errors a failed batch lists (the first ones, by line)
EXPIRED_MESSAGE = "This request could not be executed before the completion window expired."
FAILED_MESSAGE = "The server gave up on this batch before this request was executed (see the batch's errors)."


@dataclass(frozen=True, slots=True)
class JobConfig:
    max_in_flight: int = 64  # lines in flight while no interactive request runs (the engine batches them)
    # ... and while one does: interactive requests go first, and the batch still moves.
    max_in_flight_busy: int = 1
    # The prompt tokens of the lines in flight (core.PrefillWindow) while no interactive request runs; an eighth
    # of it while one does (in_flight_tokens).
    max_in_flight_tokens: int = MAX_IN_FLIGHT_TOKENS
    max_requests: int = 50_000  # lines per batch, as OpenAI allows
    retry_delay: float = 1.0  # seconds before a failed step is tried again, doubled with each failure in a row ...
    max_retry_delay: float = 60.0  # ... up to this
    max_failures: int = 5  # unexpected errors in a row (not the data dir's) before a batch is given up

    def __post_init__(self) -> None:
        check_int("batch_max_in_flight", self.max_in_flight, 1)
        check_int("max_in_flight_busy", self.max_in_flight_busy, 1)
        check_int("batch_max_in_flight_tokens", self.max_in_flight_tokens, 1)
        check_int("max_requests", self.max_requests, 1)
        check_number("retry_delay", self.retry_delay, 0.0, 3600.0)
        check_number("max_retry_delay", self.max_retry_delay, self.retry_delay, 3600.0)
        check_int("max_failures", self.max_failures, 1)

    def in_flight_tokens(self, busy: bool) -> int:
        """The prompt tokens in flight: all of max_in_flight_tokens, or an eighth while interactive requests run."""
        return max(1, self.max_in_flight_tokens // 8) if busy else self.max_in_flight_tokens


class BatchJobs:
    """Runs the store's unfinished batches one at a time, oldest first; quick steps (validating,
    finalizing) of any batch go before the lines of the one in progress."""

    def __init__(
        self,
        store: Store,
        models: LineModels,
        is_busy: Callable[[], bool],
        config: JobConfig | None = None,
        on_storage_error: Callable[[str], None] = lambda stage: None,
    ) -> None:
        self.store = store
        self.models = models
        self.is_busy = is_busy
        self.config = config or JobConfig()
        self.on_storage_error = on_storage_error  # told the step (the batch's status) the data dir failed in
        self._wake = asyncio.Event()
        self._cancels: set[str] = set()
        self._failures: dict[str, int] = {}  # unexpected errors in a row, by batch
        self._in_a_row = 0  # failed steps in a row, any batch: the backoff
        self._unsaved: dict[str, dict[int, LineResult]] = {}  # answers the store refused, stored first next time

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
        except Exception as exc:
            self._in_a_row += 1
            delay = min(self.config.retry_delay * 2 ** (self._in_a_row - 1), self.config.max_retry_delay)
            if is_storage_error(exc) and not self._is_expired(batch):
                # The data dir failing says nothing about the batch: it waits where it is (for ever, until it
                # expires or is cancelled), and what was answered is kept.
                self.on_storage_error(batch.status)
                logger.warning("batch %s paused: %s; trying again in %.1f s", batch.id, exc, delay)
            else:  # a bug: tried again a few times, then the batch is given up (with what it has)
                failures = self._failures[batch.id] = self._failures.get(batch.id, 0) + 1
                logger.exception("batch %s: step %s failed (%d in a row)", batch.id, batch.status, failures)
                if failures >= self.config.max_failures:
                    try:
                        self._give_up(batch)
                    except Exception:  # the data dir failing too: given up at the next try
                        logger.exception("batch %s could not be given up yet", batch.id)
            await self._pause(delay)
        else:
            self._in_a_row = 0
            self._failures.pop(batch.id, None)
        return True

    async def _pause(self, seconds: float) -> None:
        """Wait before the next try; a cancel or a new batch ends the wait early."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), seconds)

    def _is_expired(self, batch: BatchRecord) -> bool:
        return batch.expires_at is not None and self.store.now() >= batch.expires_at

    def _give_up(self, batch: BatchRecord) -> None:
        """Stop trying a batch whose steps keep failing: an in-progress batch finalizes as failed, with its
        answers in the output file and the lines not answered in the error file; one not yet running (or
        whose finalizing itself fails) is failed as it is."""
        message = f"the server gave up on this batch after {self.config.max_failures} failed attempts"
        errors = {"object": "list", "data": [{"code": "server_error", "message": message, "param": None, "line": None}]}
        logger.error("batch %s given up: %s", batch.id, message)
        self._failures.pop(batch.id, None)
        if batch.status == "in_progress":
            with contextlib.suppress(Exception):
                self._store_unsaved(batch.id)
            self._unsaved.pop(batch.id, None)  # answers that cannot be stored are given up with the batch
            try:
                parsed = self._parse(batch)
            except Exception:
                parsed = ParsedInput()  # the input cannot be read: the answers alone
            done = self.store.done_lines(batch.id)
            lines = [
                _unanswered(item, "batch_failed", FAILED_MESSAGE) for item in parsed.items if item.line not in done
            ]
            if self.store.give_up(batch.id, lines, errors):
                self.wake()
                return
        self.store.transition(
            batch.id, "failed", expected=("validating", "in_progress", "finalizing", "cancelling"), errors=errors
        )

    async def _step(self, batch: BatchRecord) -> None:
        loop = asyncio.get_running_loop()
        if batch.status == "validating":
            self._validate(batch, await loop.run_in_executor(None, self._parse, batch))
        elif batch.status == "in_progress":
            await self._run(batch, await loop.run_in_executor(None, self._parse, batch))
        else:  # finalizing, cancelling
            try:
                self._store_unsaved(batch.id)
            except QuotaError:
                if batch.status != "cancelling":
                    raise
                # A cancelled batch ends with what is stored: answers over the quota go, so that a full quota
                # never holds a cancel (finalizing moves the stored answers into files, taking no more room).
                dropped = self._unsaved.pop(batch.id, {})
                logger.warning("batch %s cancelled: %d answers over the quota dropped", batch.id, len(dropped))
            await loop.run_in_executor(None, self.store.finalize, batch.id)
            self._cancels.discard(batch.id)

    def _store(self, batch_id: str, results: list[LineResult]) -> None:
        """Store answers; when the store fails they are kept (stored first at the next try) and it raises."""
        unsaved = self._unsaved.setdefault(batch_id, {})
        unsaved.update((r.item_line, r) for r in results)
        self.store.add_results(batch_id, list(unsaved.values()))
        del self._unsaved[batch_id]

    def _store_unsaved(self, batch_id: str) -> None:
        if self._unsaved.get(batch_id):
            self._store(batch_id, [])

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
        self._store_unsaved(batch.id)
        done = self.store.done_lines(batch.id)
        pending = [item for item in parsed.items if item.line not in done]
        is_expired = lambda: self._is_expired(batch)  # noqa: E731
        config = self.config
        finished = not is_expired() and await run_items(
            pending,
            lambda item: answer(self.models, item),
            lambda result: self._store(batch.id, [result]),
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
                _unanswered(item, "batch_expired", EXPIRED_MESSAGE) for item in parsed.items if item.line not in done
            ]
            self.store.expire(batch.id, expired)


def _unanswered(item: BatchItem, code: str, message: str) -> LineResult:
    """The error-file line of an item the batch ended without answering."""
    line = {
        "id": item.line_id,
        "custom_id": item.output_custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }
    return LineResult(line, item.line)
