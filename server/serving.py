"""HTTP request -> prepared job -> engine -> JSON or SSE. Validation and response bodies come from
moe_serve.api (shared with batch); what is HTTP's own lives here: the served models, streaming,
client disconnects and what the access log and metrics record."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from moe_serve.api import protocol as p
from moe_serve.api import responses
from moe_serve.api.errors import api_error
from moe_serve.api.prepare import GenerationJob, prepare_chat, prepare_completion, prepare_pooling
from moe_serve.artifact import Artifact
from moe_serve.engine.async_engine import AsyncEngine, GenerationStream, RequestUpdate
from moe_serve.errors import ClientDisconnectedError, ModelNotFoundError, ValidationError
from moe_serve.server.metrics import Metrics
from moe_serve.server.settings import ServerSettings

T = TypeVar("T")


@dataclass(slots=True)
class ServedModel:
    name: str
    artifact: Artifact
    engine: AsyncEngine
    created: int

    def card(self) -> p.ModelCard:
        config = self.artifact.config
        moe = config.moe
        return p.ModelCard(
            id=self.name,
            created=self.created,
            task=config.task,
            num_experts=moe.num_experts if moe else None,
            experts_per_token={"default": moe.default_k, "min": moe.min_k, "max": moe.max_k} if moe else None,
            router=moe.router.kind if moe else None,
            max_model_len=self.engine.inputs.max_model_len,
        )


@dataclass(slots=True)
class ServingContext:
    models: dict[str, ServedModel]
    settings: ServerSettings
    metrics: Metrics
    executor: Executor  # tokenizing and template rendering: off the event loop

    async def prepare(self, fn: Callable[..., T], *args: Any) -> T:
        """Run request preparation in the preparation threads, so the event loop never waits on it."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def model(self, name: str | None) -> ServedModel:
        if name is None:
            if len(self.models) == 1:
                return next(iter(self.models.values()))
            raise ValidationError(
                f"model is required when several models are served ({', '.join(self.models)})", parameter="model"
            )
        if name not in self.models:
            raise ModelNotFoundError(name, list(self.models))
        return self.models[name]


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


async def _merged(streams: list[AsyncIterator[RequestUpdate]]) -> AsyncIterator[tuple[int, RequestUpdate]]:
    """Interleave several request streams as their updates arrive; cancelling the consumer cancels all
    (each stream's cleanup then aborts its request in the engine)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestUpdate]) -> None:
        try:
            async for update in stream:
                await queue.put((index, update))
        except BaseException as exc:  # noqa: BLE001  # handed to the consumer
            await queue.put((index, exc))
        finally:
            await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# ---- /v1/completions and /v1/chat/completions ---------------------------------------------------


async def completions(ctx: ServingContext, request: p.CompletionRequest, http: Request) -> Any:
    served = ctx.model(request.model)
    job = await ctx.prepare(prepare_completion, served.engine.inputs, request, ctx.settings.limits)
    _annotate(http.state, served.name, job.reported_k, job.prompt_tokens)
    streams = served.engine.submit(job.requests)  # admitted (or refused: 429, 503) before a response starts
    if request.stream:
        tokenizer = served.artifact.tokenizer
        choice = lambda i, u: responses.completion_chunk_choice(tokenizer, job, i, u)  # noqa: E731
        return _event_stream(ctx, served, job, streams, "completions", request.stream_options, http.state, choice)
    results = await _unless_disconnected(http, asyncio.gather(*(s.final() for s in streams)))
    for result in results:
        prompt_tokens = len(result.prompt_token_ids)
        ctx.metrics.record_generation(served.name, "completions", job.reported_k, prompt_tokens, result.metrics)
    http.state.completion_tokens = sum(r.num_generated_tokens for r in results)
    return responses.completion_response(served.name, job, results, served.artifact.tokenizer)


async def chat_completions(ctx: ServingContext, request: p.ChatCompletionRequest, http: Request) -> Any:
    served = ctx.model(request.model)
    job = await ctx.prepare(prepare_chat, served.engine.inputs, request, ctx.settings.limits)
    _annotate(http.state, served.name, job.reported_k, job.prompt_tokens)
    streams = served.engine.submit(job.requests)  # admitted (or refused: 429, 503) before a response starts
    if request.stream:
        choice = lambda _, u: responses.chat_chunk_choice(u)  # noqa: E731
        first = responses.chat_role_choices(job.params.n)
        return _event_stream(ctx, served, job, streams, "chat", request.stream_options, http.state, choice, first)
    result = await _unless_disconnected(http, streams[0].final())
    ctx.metrics.record_generation(served.name, "chat", job.reported_k, job.prompt_tokens, result.metrics)
    http.state.completion_tokens = result.num_generated_tokens
    return responses.chat_response(served.name, job, result)


def _event_stream(
    ctx: ServingContext,
    served: ServedModel,
    job: GenerationJob,
    streams: list[GenerationStream],
    endpoint: str,
    options: p.StreamOptions | None,
    state: Any,
    choice: Any,
    first: list | None = None,
) -> StreamingResponse:
    """SSE for a generation job: a chunk per completion update (choice(prompt index, update) builds its
    choice), usage when asked, errors in-band once the response has started, then [DONE]."""
    kind = "text_completion" if endpoint == "completions" else "chat.completion.chunk"
    header = responses.chunk_header(served.name, kind)

    async def events() -> AsyncIterator[str]:
        if first:
            yield _sse({**header, "choices": first})
        completion_tokens = 0
        try:
            async for prompt_index, update in _merged(streams):
                for u in update.updates:
                    completion_tokens += len(u.token_ids)
                    yield _sse({**header, "choices": [choice(prompt_index, u)]})
                if update.finished:
                    prompt_tokens = len(job.requests[prompt_index].prompt_token_ids)
                    ctx.metrics.record_generation(served.name, endpoint, job.reported_k, prompt_tokens, update.metrics)
            if options and options.include_usage:
                usage = responses.usage(job.prompt_tokens, completion_tokens, job.reported_k)
                yield _sse({**header, "choices": [], "usage": usage.model_dump()})
        except Exception as exc:  # headers are gone: report in-band, then close the stream
            yield _sse(api_error(exc).body())
        finally:
            for stream in streams:
                stream.abort()  # whatever ended the stream (a client gone, an error), the work stops
        state.completion_tokens = completion_tokens
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


# ---- /v1/classify and /v1/score -----------------------------------------------------------------


async def classify(ctx: ServingContext, request: p.ClassifyRequest, http: Request) -> p.ClassifyResponse:
    served = ctx.model(request.model)
    job = await ctx.prepare(prepare_pooling, served.engine.inputs, request, ctx.settings.limits)
    _annotate(http.state, served.name, job.reported_k, job.prompt_tokens)
    start = time.monotonic()
    results = await _unless_disconnected(http, served.engine.classify(job.token_ids, job.k))
    ctx.metrics.record_pooling(served.name, "classify", job.reported_k, time.monotonic() - start, job.prompt_tokens)
    return responses.classify_response(served.name, job, results)


async def score(ctx: ServingContext, request: p.ScoreRequest, http: Request) -> p.ScoreResponse:
    served = ctx.model(request.model)
    job = await ctx.prepare(prepare_pooling, served.engine.inputs, request, ctx.settings.limits)
    _annotate(http.state, served.name, job.reported_k, job.prompt_tokens)
    start = time.monotonic()
    results = await _unless_disconnected(http, served.engine.score(job.token_ids, job.k, job.return_token_logprobs))
    ctx.metrics.record_pooling(served.name, "score", job.reported_k, time.monotonic() - start, job.prompt_tokens)
    return responses.score_response(served.name, job, results)


async def _unless_disconnected(http: Request, work: Any) -> Any:
    """Await `work`; if the client goes away first, cancel it (its streams then abort in the engine)."""
    task = asyncio.ensure_future(work)
    while not task.done():
        await asyncio.wait({task}, timeout=0.25)
        if not task.done() and await http.is_disconnected():
            task.cancel()
            await asyncio.wait({task})  # let the cancellation land, then mark its outcome seen (asyncio logs
            if not task.cancelled():  # a gather's unretrieved CancelledError as an ERROR otherwise)
                task.exception()
            raise ClientDisconnectedError("client closed the request")
    return task.result()


def _annotate(state: Any, model: str, k: int | None, prompt_tokens: int) -> None:
    """What the access log and request counter need to know about the request."""
    state.model, state.k, state.prompt_tokens = model, k, prompt_tokens
