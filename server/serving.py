"""Request -> engine -> JSON or SSE, for every endpoint. Routes stay thin and call these functions."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from jinja2.sandbox import ImmutableSandboxedEnvironment

from moe_serve.artifact import Artifact
from moe_serve.engine.async_engine import AsyncEngine, RequestUpdate
from moe_serve.engine.sequence import Sequence
from moe_serve.errors import ValidationError
from moe_serve.llm import score_output
from moe_serve.sampling_params import SamplingParams
from moe_serve.tokenizer import Tokenizer
from server import protocol as p
from server.errors import ClientDisconnected, ModelNotFoundError
from server.metrics import Metrics
from server.settings import ServerSettings


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
            max_model_len=self.engine.engine.max_model_len,
        )


@dataclass(slots=True)
class ServingContext:
    models: dict[str, ServedModel]
    settings: ServerSettings
    metrics: Metrics

    def model(self, name: str | None) -> ServedModel:
        if name is None:
            if len(self.models) == 1:
                return next(iter(self.models.values()))
            raise ValidationError(f"model is required when several models are served ({', '.join(self.models)})", parameter="model")
        if name not in self.models:
            raise ModelNotFoundError(name, list(self.models))
        return self.models[name]


def _require_task(served: ServedModel, task: str, endpoint: str) -> None:
    if served.artifact.config.task != task:
        raise ValidationError(f"{endpoint} needs a {task} model; '{served.name}' is {served.artifact.config.task}", parameter="model")


def _prompt_ids(served: ServedModel, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        return served.engine.engine.encode_text(prompt, "prompt")
    return list(prompt)


@dataclass(slots=True)
class _Collected:
    texts: list[str]
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    top_logprobs: list[list[dict[int, float]]]
    finish_reasons: list[str | None]
    seqs: list[Sequence]


async def _collect(stream: AsyncIterator[RequestUpdate], n: int) -> _Collected:
    out = _Collected([""] * n, [[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)], [None] * n, [])
    async for update in stream:
        for u in update.updates:
            out.texts[u.index] += u.text_delta
            out.token_ids[u.index] += u.token_ids
            out.logprobs[u.index] += u.logprobs
            out.top_logprobs[u.index] += u.top_logprobs
            out.finish_reasons[u.index] = u.finish_reason or out.finish_reasons[u.index]
        if update.finished:
            out.seqs = update.sequences
    return out


def completion_logprobs(tokenizer: Tokenizer, token_ids: list[int], logprobs: list[float], tops: list[dict[int, float]], wanted: int | None) -> p.CompletionLogprobs | None:
    """OpenAI completions `logprobs` (None unless the request asked for them)."""
    if wanted is None:
        return None

    def alternatives(top: dict[int, float]) -> dict[str, float]:
        out: dict[str, float] = {}
        for token_id, value in top.items():
            text = tokenizer.decode([token_id])
            # Tokens that decode alike (partial UTF-8 bytes) keep their raw token string as the key.
            out[tokenizer.id_to_token(token_id) if text in out or "\ufffd" in text else text] = value
        return out

    return p.CompletionLogprobs(
        tokens=[tokenizer.decode([t]) for t in token_ids],
        token_logprobs=logprobs,
        top_logprobs=[alternatives(top) for top in tops] if wanted else None,
    )


def usage(prompt_tokens: int, completion_tokens: int, k: int | None, approximate: bool | None = None) -> p.Usage:
    return p.Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        experts_per_token=k,
        approximate=approximate,
    )


def _k(served: ServedModel, params: SamplingParams) -> int | None:
    k = served.engine.engine.resolve_experts_per_token(params.experts_per_token)
    return k if served.artifact.config.moe else None


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
    state = http.state
    served = ctx.model(request.model)
    _require_task(served, "causal_lm", "/v1/completions")
    params = request.to_sampling_params(ctx.settings.max_tokens_cap, request.logprobs)
    prompts = [_prompt_ids(served, prompt) for prompt in request.prompts()]
    for ids in prompts:  # everything is validated before anything runs
        served.engine.engine.check_request(ids, params)
    k = _k(served, params)
    _annotate(state, served.name, k, sum(map(len, prompts)))
    streams = [served.engine.generate(ids, params) for ids in prompts]
    if request.stream:
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        return StreamingResponse(_stream_completion(ctx, served, streams, params, k, include_usage, sum(map(len, prompts)), state), media_type="text/event-stream")
    results = await _unless_disconnected(http, asyncio.gather(*(_collect(s, params.n) for s in streams)))
    choices = []
    for prompt_index, result in enumerate(results):
        ctx.metrics.record_generation(served.name, "completions", result.seqs)
        for i in range(params.n):
            choices.append(p.CompletionChoice(
                index=prompt_index * params.n + i,
                text=result.texts[i],
                logprobs=completion_logprobs(served.artifact.tokenizer, result.token_ids[i], result.logprobs[i], result.top_logprobs[i], request.logprobs),
                finish_reason=result.finish_reasons[i],
            ))
    completion_tokens = sum(len(t) for r in results for t in r.token_ids)
    state.completion_tokens = completion_tokens
    return p.CompletionResponse(model=served.name, choices=choices, usage=usage(sum(map(len, prompts)), completion_tokens, k))


async def _stream_completion(ctx, served, streams, params, k, include_usage, prompt_tokens, state) -> AsyncIterator[str]:
    header = {"id": f"cmpl-{time.time_ns():x}", "object": "text_completion", "created": int(time.time()), "model": served.name}
    completion_tokens = 0
    try:
        async for prompt_index, update in _merged(streams):
            for u in update.updates:
                completion_tokens += len(u.token_ids)
                logprobs = completion_logprobs(served.artifact.tokenizer, u.token_ids, u.logprobs, u.top_logprobs, params.logprobs)
                choice = {"index": prompt_index * params.n + u.index, "text": u.text_delta,
                          "logprobs": logprobs.model_dump() if logprobs else None, "finish_reason": u.finish_reason}
                yield _sse({**header, "choices": [choice]})
            if update.finished:
                ctx.metrics.record_generation(served.name, "completions", update.sequences)
        if include_usage:
            yield _sse({**header, "choices": [], "usage": usage(prompt_tokens, completion_tokens, k).model_dump()})
    except Exception as exc:  # headers are gone: report in-band, then close the stream
        yield _sse({"error": {"message": str(exc) if isinstance(exc, ValidationError) else "internal server error", "type": "internal_error", "param": None, "code": 500}})
    state.completion_tokens = completion_tokens
    yield "data: [DONE]\n\n"


def render_chat(artifact: Artifact, messages: list[p.ChatMessage]) -> str:
    """The model's chat template (Jinja, sandboxed) applied to the messages, with a generation prompt."""
    config, tokenizer = artifact.config, artifact.tokenizer
    if not config.chat_template:
        raise ValidationError(f"model '{artifact.name}' has no chat template; use /v1/completions", parameter="messages")
    special = lambda token_id: tokenizer.id_to_token(token_id) if token_id is not None else ""  # noqa: E731
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return environment.from_string(config.chat_template).render(
        messages=[m.model_dump() for m in messages],
        add_generation_prompt=True,
        bos_token=special(config.bos_token_id),
        eos_token=special(config.eos_token_ids[0] if config.eos_token_ids else None),
    )


async def chat_completions(ctx: ServingContext, request: p.ChatCompletionRequest, http: Request) -> Any:
    state = http.state
    served = ctx.model(request.model)
    _require_task(served, "causal_lm", "/v1/chat/completions")
    prompt = served.artifact.tokenizer.encode(render_chat(served.artifact, request.messages))
    params = request.to_sampling_params(ctx.settings.max_tokens_cap)
    served.engine.engine.check_request(prompt, params)
    k = _k(served, params)
    _annotate(state, served.name, k, len(prompt))
    stream = served.engine.generate(prompt, params)
    if request.stream:
        return StreamingResponse(_stream_chat(ctx, served, stream, len(prompt), k, request, state), media_type="text/event-stream")
    result = await _unless_disconnected(http, _collect(stream, params.n))
    ctx.metrics.record_generation(served.name, "chat", result.seqs)
    completion_tokens = sum(map(len, result.token_ids))
    state.completion_tokens = completion_tokens
    choices = [p.ChatChoice(index=i, message=p.ChatMessageOut(content=result.texts[i]), finish_reason=result.finish_reasons[i]) for i in range(params.n)]
    return p.ChatCompletionResponse(model=served.name, choices=choices, usage=usage(len(prompt), completion_tokens, k))


async def _stream_chat(ctx, served, stream, prompt_tokens, k, request, state) -> AsyncIterator[str]:
    header = {"id": f"chatcmpl-{time.time_ns():x}", "object": "chat.completion.chunk", "created": int(time.time()), "model": served.name}
    completion_tokens = 0
    yield _sse({**header, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None} for i in range(request.n)]})
    try:
        async for update in stream:
            for u in update.updates:
                completion_tokens += len(u.token_ids)
                yield _sse({**header, "choices": [{"index": u.index, "delta": {"content": u.text_delta}, "finish_reason": u.finish_reason}]})
            if update.finished:
                ctx.metrics.record_generation(served.name, "chat", update.sequences)
        if request.stream_options and request.stream_options.include_usage:
            yield _sse({**header, "choices": [], "usage": usage(prompt_tokens, completion_tokens, k).model_dump()})
    except Exception:
        yield _sse({"error": {"message": "internal server error", "type": "internal_error", "param": None, "code": 500}})
    state.completion_tokens = completion_tokens
    yield "data: [DONE]\n\n"


# ---- /v1/classify and /v1/score -----------------------------------------------------------------


def _pooling_inputs(served: ServedModel, inputs: str | list[str], k: int | None) -> tuple[list[list[int]], int, int | None]:
    texts = [inputs] if isinstance(inputs, str) else inputs
    if not texts:
        raise ValidationError("input must not be empty", parameter="input")
    resolved = served.engine.engine.resolve_experts_per_token(k)
    ids = [served.engine.engine.encode_text(t, "input") for t in texts]
    return ids, resolved, resolved if served.artifact.config.moe else None


async def classify(ctx: ServingContext, request: p.ClassifyRequest, http: Request) -> p.ClassifyResponse:
    state = http.state
    served = ctx.model(request.model)
    _require_task(served, "sequence_classification", "/v1/classify")
    ids, k, reported = _pooling_inputs(served, request.input, request.experts_per_token)
    _annotate(state, served.name, reported, sum(map(len, ids)))
    start = time.monotonic()
    probs = await served.engine.classify(ids, [k] * len(ids))
    ctx.metrics.record_pooling(served.name, "classify", reported, time.monotonic() - start, sum(map(len, ids)))
    labels = served.artifact.config.classifier.labels  # type: ignore[union-attr]  # task checked above
    moe = served.artifact.config.moe
    data = [p.Classification(index=i, label=labels[max(range(len(row)), key=row.__getitem__)], probs=dict(zip(labels, row))) for i, row in enumerate(probs)]
    approximate = bool(moe and moe.is_approximate(k))
    return p.ClassifyResponse(model=served.name, data=data, usage=usage(sum(map(len, ids)), 0, reported, approximate))


async def score(ctx: ServingContext, request: p.ScoreRequest, http: Request) -> p.ScoreResponse:
    state = http.state
    served = ctx.model(request.model)
    _require_task(served, "causal_lm", "/v1/score")
    ids, k, reported = _pooling_inputs(served, request.input, request.experts_per_token)
    short = [i for i, row in enumerate(ids) if len(row) < 2]
    if short:
        raise ValidationError(f"input[{short[0]}] must have at least 2 tokens to be scored", parameter="input")
    _annotate(state, served.name, reported, sum(map(len, ids)))
    start = time.monotonic()
    per_token = await served.engine.score(ids, [k] * len(ids))
    ctx.metrics.record_pooling(served.name, "score", reported, time.monotonic() - start, sum(map(len, ids)))
    data = []
    for i, (row, values) in enumerate(zip(ids, per_token)):
        out = score_output(served.artifact.tokenizer, row, values, reported, request.return_token_logprobs)
        data.append(p.Score(index=i, total_logprob=out.total_logprob, num_tokens=out.num_tokens, num_bytes=out.num_bytes,
                            bits_per_byte=out.bits_per_byte, token_logprobs=out.token_logprobs))
    return p.ScoreResponse(model=served.name, data=data, usage=usage(sum(map(len, ids)), 0, reported))


async def _unless_disconnected(http: Request, work: Any) -> Any:
    """Await `work`; if the client goes away first, cancel it (its streams then abort in the engine)."""
    task = asyncio.ensure_future(work)
    while not task.done():
        await asyncio.wait({task}, timeout=0.25)
        if not task.done() and await http.is_disconnected():
            task.cancel()
            raise ClientDisconnected
    return task.result()


def _annotate(state: Any, model: str, k: int | None, prompt_tokens: int) -> None:
    """What the access log and request counter need to know about the request."""
    state.model, state.k, state.prompt_tokens = model, k, prompt_tokens
