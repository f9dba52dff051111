"""The one batch runner behind `moe-serve batch` and the HTTP Batch API: each item answered exactly as over
HTTP (moe_serve.api) on the serving engine (AsyncEngine), a bounded number of items in flight, and each
answer handed to a sink the moment it is ready (appended to a file by the command, stored in SQLite by
the server), so that what a kill interrupts is only what was in flight."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, Protocol, TypeVar

import pydantic

from moe_serve.api import protocol as p
from moe_serve.api import responses
from moe_serve.api.errors import ApiError, api_error
from moe_serve.api.prepare import prepare_chat, prepare_completion, prepare_pooling
from moe_serve.batch.jsonl import BatchItem, LineResult, response_line
from moe_serve.config import RequestLimits
from moe_serve.engine.async_engine import AsyncEngine
from moe_serve.errors import EngineOverloadedError, EngineStoppedError, MoEServeError, ValidationError

T = TypeVar("T")
LineRequest = p.CompletionRequest | p.ChatCompletionRequest | p.ClassifyRequest | p.ScoreRequest
REQUEST_MODELS: dict[str, type[LineRequest]] = {
    "/v1/completions": p.CompletionRequest,
    "/v1/chat/completions": p.ChatCompletionRequest,
    "/v1/classify": p.ClassifyRequest,
    "/v1/score": p.ScoreRequest,
}
logger = logging.getLogger("moe_serve.batch")
OVERLOAD_PAUSE = 0.2  # seconds an item refused by a full engine queue waits before it is tried again
# Prompt tokens a batch keeps in the engine at once (PrefillWindow): a few steps' worth (the engine's default
# step budget is 2,048 tokens), so the engine stays busy while lines are answered and stored.
MAX_IN_FLIGHT_TOKENS = 16_384


class PrefillWindow:
    """The prompt tokens a batch keeps in the engine at once, on top of its line count: a line, once
    prepared (its tokens known), waits until they fit beside those in flight (a line larger than the
    window runs alone). A line count alone let 64 lines of 4,000 tokens put 256,000 tokens of prefill in
    the engine's queue. `limit()` is read again whenever a line finishes, so a server can narrow it while
    interactive requests run."""

    def __init__(self, limit: Callable[[], int] = lambda: MAX_IN_FLIGHT_TOKENS) -> None:
        self.limit = limit
        self.in_flight = 0
        # Made in the running event loop, and again in a later one (`moe-serve batch` runs each chunk of a file
        # in an event loop of its own; every hold of the last one has ended by then).
        self._changed: tuple[asyncio.AbstractEventLoop, asyncio.Condition] | None = None

    @contextlib.asynccontextmanager
    async def hold(self, tokens: int) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        if self._changed is None or self._changed[0] is not loop:
            self._changed = (loop, asyncio.Condition())
        changed = self._changed[1]
        async with changed:
            await changed.wait_for(lambda: self.in_flight == 0 or self.in_flight + tokens <= self.limit())
            self.in_flight += tokens
        try:
            yield
        finally:
            async with changed:
                self.in_flight -= tokens
                changed.notify_all()


class LineModels(Protocol):
    """Where a line's model comes from: the command's engine pool, or the server's served models."""

    limits: RequestLimits
    prefill: PrefillWindow  # the prompt tokens its lines keep in the engine at once

    def resolve(self, request: p.ModelRequest, item: BatchItem) -> tuple[str, AsyncEngine, p.ModelRequest]:
        """The model a line runs on (its name in responses, its engine) and the request as it serves it (a
        `name:k<k>` model fixes experts_per_token in a copy); raises LineError or MoEServeError."""
        ...

    async def prepare(self, fn: Callable[..., T], *args: Any) -> T:
        """Run request preparation (tokenizing, templates): the server keeps it off its event loop."""
        ...


class LineError(Exception):
    """A line refused with this exact error (a model the run may not load, a model that fails to load)."""

    def __init__(self, error: ApiError) -> None:
        super().__init__(error.message)
        self.error = error


async def answer(models: LineModels, item: BatchItem) -> LineResult:
    """One item's result: the response body as HTTP would give it, or its error envelope. A full engine
    queue (EngineOverloadedError) and a stopping engine (EngineStoppedError) are raised instead: they say
    nothing about the line, which is to run later. An unexpected failure of the line's own (a bug) is that
    line's error, a 500 as HTTP would answer it, logged: it never stops the other lines."""
    body = dict(item.body)
    if item.k is not None:
        body["experts_per_token"] = item.k
    try:
        request = REQUEST_MODELS[item.url].model_validate(body)
        if getattr(request, "stream", False):
            raise ValidationError("stream is not supported in a batch: a line's answer is one body", parameter="stream")
        name, engine, request = models.resolve(request, item)
        return await _run(models, name, engine, item, request)
    except (EngineOverloadedError, EngineStoppedError):
        raise
    except LineError as exc:
        return error_result(item, exc.error)
    except (MoEServeError, pydantic.ValidationError) as exc:
        return error_result(item, api_error(exc))
    except Exception as exc:
        logger.exception("batch line %d (%s) failed", item.line, item.line_id)
        return error_result(item, api_error(exc, request_id=item.line_id))


async def _run(
    models: LineModels, name: str, engine: AsyncEngine, item: BatchItem, request: pydantic.BaseModel
) -> LineResult:
    inputs, limits = engine.inputs, models.limits
    # A line is batch work: behind interactive requests in the engine (background), whatever endpoint it names.
    if isinstance(request, p.CompletionRequest | p.ChatCompletionRequest):
        is_chat = isinstance(request, p.ChatCompletionRequest)
        job = await models.prepare(prepare_chat if is_chat else prepare_completion, inputs, request, limits)
        async with models.prefill.hold(job.prompt_tokens):
            streams = engine.submit(job.requests, background=True) if job.generate else []
            results, scores = await job.gather(engine, streams, background=True)
        body: p.ChatCompletionResponse | p.CompletionResponse
        if is_chat:
            assert results is not None, "a chat request always generates"
            body = responses.chat_response(name, job, results[0], inputs.tokenizer, item.line_id)
        else:
            body = responses.completion_response(name, job, results, inputs.tokenizer, item.line_id, scores)
        completion_tokens = sum(r.num_generated_tokens for r in results or [])
        return LineResult(response_line(item, 200, body.model_dump()), item.line, job.prompt_tokens, completion_tokens)
    pooled = await models.prepare(prepare_pooling, inputs, request, limits)
    data: p.ClassifyResponse | p.ScoreResponse
    async with models.prefill.hold(pooled.prompt_tokens):
        if pooled.kind == "classify":
            classified = await engine.classify(pooled.token_ids, pooled.k, background=True)
            data = responses.classify_response(name, pooled, classified)
        else:
            scored = await engine.score(pooled.token_ids, pooled.k, pooled.return_token_logprobs, background=True)
            data = responses.score_response(name, pooled, scored)
    return LineResult(response_line(item, 200, data.model_dump()), item.line, pooled.prompt_tokens)


def error_result(item: BatchItem, error: ApiError) -> LineResult:
    return LineResult(response_line(item, error.status, error.body()), item.line)


async def run_items(
    items: Iterable[BatchItem],
    answer_one: Callable[[BatchItem], Awaitable[LineResult]],
    sink: Callable[[LineResult], None],
    window: Callable[[], int],
    should_stop: Callable[[], bool] = lambda: False,
    tick: float = 0.1,
) -> bool:
    """Answer items with at most `window()` in flight (read again as items finish, and every `tick`
    seconds, so a server can narrow it while interactive requests run), handing each result to `sink` as
    it completes. Returns False when `should_stop()` ended the run early: what was in flight is cancelled
    (its engine work aborted) and never reaches the sink. A sink's exception, or EngineStoppedError,
    ends the run the same way and propagates."""
    queue = deque(items)
    running: dict[asyncio.Future, BatchItem] = {}
    try:
        while queue or running:
            if should_stop():
                return False
            while queue and len(running) < max(1, window()):
                item = queue.popleft()
                running[asyncio.ensure_future(answer_one(item))] = item
            done, _ = await asyncio.wait(running, timeout=tick, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda t: (running[t].line, running[t].k or 0)):
                item = running.pop(task)
                try:
                    result = task.result()
                except EngineOverloadedError:  # the engine's queue is full (interactive traffic): wait a turn
                    queue.appendleft(item)
                    await asyncio.sleep(OVERLOAD_PAUSE)
                    continue
                sink(result)
        return True
    finally:
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
