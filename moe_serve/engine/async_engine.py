"""The serving loop: one engine thread per model steps the LLMEngine while asyncio callers submit
requests, stream their tokens, and cancel them. Classification and scoring requests that arrive
together are batched into one forward.

Thread model: only the engine thread touches the LLMEngine's state (requests reach it through a
locked inbox); results go back to each caller's asyncio queue with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from moe_serve.engine.llm_engine import LLMEngine
from moe_serve.engine.pooling import class_probabilities, token_logprobs
from moe_serve.engine.sequence import Sequence
from moe_serve.errors import MoEServeError
from moe_serve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineOverloadedError(MoEServeError):
    """Too many requests are waiting; retry after `retry_after` seconds (HTTP 429)."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineStoppedError(MoEServeError):
    """The engine is shutting down and takes no new requests (HTTP 503)."""


@dataclass(slots=True)
class SequenceUpdate:
    """What one completion gained in a step: a text delta and the new tokens (streaming unit)."""

    index: int
    text_delta: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    finish_reason: str | None


@dataclass(slots=True)
class RequestUpdate:
    request_id: str
    updates: list[SequenceUpdate]
    finished: bool
    sequences: list[Sequence] = field(default_factory=list)  # for usage and timing once finished


@dataclass(slots=True)
class _Stream:
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    seqs: list[Sequence]
    sent_chars: list[int]
    sent_tokens: list[int]
    reported_finish: list[bool]


@dataclass(slots=True)
class _PoolingJob:
    kind: str  # classify | score
    token_ids: list[list[int]]
    ks: list[int]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting: int = 256, on_step: Callable[[AsyncEngine], None] | None = None) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.on_step = on_step  # metrics hook, called on the engine thread after every step
        self._lock = threading.Condition()
        self._inbox: list[tuple[str, list[int], SamplingParams, _Stream]] = []
        self._aborts: list[str] = []
        self._jobs: list[_PoolingJob] = []
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._stopping = False
        self._exit = False
        self._thread = threading.Thread(target=self._run, name=f"engine-{engine.artifact.name}", daemon=True)
        self._thread.start()

    # ---- state seen by the server ---------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.engine.running)

    @property
    def num_waiting(self) -> int:
        return len(self.engine.waiting) + len(self._inbox)

    @property
    def num_requests(self) -> int:
        """Requests not finished yet (streams and pooling jobs)."""
        return len(self._streams) + len(self._inbox) + len(self._jobs)

    def new_request_id(self) -> str:
        return f"{self.engine.artifact.name}-{next(self._ids)}"

    # ---- generation -----------------------------------------------------------------------------

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None) -> AsyncIterator[RequestUpdate]:
        """Stream a request's updates; leaving the iteration early (client gone) aborts it at once."""
        self.engine.check_request(prompt_token_ids, params)  # validation errors surface before streaming
        request_id = request_id or self.new_request_id()
        stream = _Stream(asyncio.Queue(), asyncio.get_running_loop(), [], [0] * params.n, [0] * params.n, [False] * params.n)
        with self._lock:
            self._admit_check()
            self._inbox.append((request_id, prompt_token_ids, params, stream))
            self._streams[request_id] = stream
            self._lock.notify()
        finished = False
        try:
            while True:
                update = await stream.queue.get()
                if isinstance(update, BaseException):
                    raise update
                yield update
                if update.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)
            self._lock.notify()

    # ---- classification and scoring -------------------------------------------------------------

    async def classify(self, token_ids: list[list[int]], ks: list[int]) -> list[list[float]]:
        return await self._pool("classify", token_ids, ks)

    async def score(self, token_ids: list[list[int]], ks: list[int]) -> list[list[float]]:
        return await self._pool("score", token_ids, ks)

    async def _pool(self, kind: str, token_ids: list[list[int]], ks: list[int]) -> Any:
        loop = asyncio.get_running_loop()
        job = _PoolingJob(kind, token_ids, ks, loop.create_future(), loop)
        with self._lock:
            self._admit_check()
            self._jobs.append(job)
            self._lock.notify()
        return await job.future

    # ---- lifecycle ------------------------------------------------------------------------------

    def _admit_check(self) -> None:
        if self._stopping:
            raise EngineStoppedError("the server is shutting down")
        if self.num_waiting + len(self._jobs) >= self.max_waiting:
            raise EngineOverloadedError(f"{self.num_waiting + len(self._jobs)} requests are waiting (limit {self.max_waiting})")

    async def drain(self, timeout: float = 30.0) -> None:
        """Refuse new requests and wait until those in flight are done."""
        with self._lock:
            self._stopping = True
        deadline = time.monotonic() + timeout
        while self.num_requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def shutdown(self) -> None:
        with self._lock:
            self._stopping = True
            self._exit = True
            self._lock.notify()
        self._thread.join(timeout=10)

    # ---- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                while not (self._inbox or self._aborts or self._jobs or self.engine.has_unfinished() or self._exit):
                    self._lock.wait()
                if self._exit:
                    return
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, []
                jobs, self._jobs = self._jobs, []
            for request_id in aborts:
                self.engine.abort(request_id)
                self._streams.pop(request_id, None)
            for request_id, prompt, params, stream in inbox:
                try:
                    stream.seqs = self.engine.add_request(request_id, prompt, params)
                except Exception as exc:  # validated already; anything else still reaches the caller
                    self._streams.pop(request_id, None)
                    stream.loop.call_soon_threadsafe(stream.queue.put_nowait, exc)
            if jobs:
                self._run_pooling(jobs)
            if self.engine.has_unfinished():
                try:
                    stepped = self.engine.step()
                except Exception as exc:
                    logger.exception("engine step failed; failing the running requests")
                    self._fail_all(exc)
                    continue
                self._publish(stepped)
                if self.on_step is not None:
                    self.on_step(self)

    def _run_pooling(self, jobs: list[_PoolingJob]) -> None:
        """All classify jobs in one batched call, all score jobs in another."""
        for kind in ("classify", "score"):
            batch = [j for j in jobs if j.kind == kind]
            if not batch:
                continue
            token_ids = [ids for j in batch for ids in j.token_ids]
            ks = [k for j in batch for k in j.ks]
            fn = class_probabilities if kind == "classify" else token_logprobs
            try:
                results = fn(self.engine.runner, token_ids, ks, self.engine.config.max_num_seqs)
            except Exception as exc:
                logger.exception("%s batch failed", kind)
                for j in batch:
                    j.loop.call_soon_threadsafe(_set_exception, j.future, exc)
                continue
            start = 0
            for j in batch:
                part = results[start : start + len(j.token_ids)]
                start += len(j.token_ids)
                j.loop.call_soon_threadsafe(_set_result, j.future, part)
        if self.on_step is not None:
            self.on_step(self)

    def _publish(self, stepped: list[Sequence]) -> None:
        touched = {s.request_id for s in stepped}
        for request_id in touched:
            stream = self._streams.get(request_id)
            if stream is None:
                continue
            updates = []
            for index, seq in enumerate(stream.seqs):
                update = self._delta(stream, index, seq)
                if update is not None:
                    updates.append(update)
            finished = all(s.is_finished for s in stream.seqs)
            if finished:
                self._streams.pop(request_id, None)
            if updates or finished:
                message = RequestUpdate(request_id, updates, finished, stream.seqs if finished else [])
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, message)

    @staticmethod
    def _delta(stream: _Stream, index: int, seq: Sequence) -> SequenceUpdate | None:
        if stream.reported_finish[index]:
            return None
        text = seq.text
        if not seq.is_finished:
            # Hold back what a stop string or an unfinished UTF-8 character may still change.
            hold = max((len(s) - 1 for s in seq.params.stop), default=0)
            safe = len(text) - hold
            while safe > 0 and text[safe - 1] == "\ufffd":
                safe -= 1
            text = text[: max(safe, stream.sent_chars[index])]
        start = stream.sent_tokens[index]
        delta = text[stream.sent_chars[index] :]
        if not delta and start == len(seq.output_token_ids) and not seq.is_finished:
            return None
        stream.sent_chars[index] = len(text)
        stream.sent_tokens[index] = len(seq.output_token_ids)
        stream.reported_finish[index] = seq.is_finished
        return SequenceUpdate(
            index=index,
            text_delta=delta,
            token_ids=seq.output_token_ids[start:],
            logprobs=seq.output_logprobs[start:],
            top_logprobs=seq.top_logprobs[start:],
            finish_reason=seq.finish_reason if seq.is_finished else None,
        )

    def _fail_all(self, exc: BaseException) -> None:
        for request_id, stream in list(self._streams.items()):
            self.engine.abort(request_id)
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, exc)
        self._streams.clear()


def _set_result(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
