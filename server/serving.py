"""HTTP request -> prepared job -> engine -> JSON or SSE. Validation and response bodies come from
moe_serve.api (shared with batch); what is HTTP's own lives here: the served models, streaming,
client disconnects and what the access log and metrics record."""

from __future__ import annotations

import asyncio
import collections
import copy
import hashlib
import json
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from moe_serve.api import protocol as p
from moe_serve.api import responses
from moe_serve.api.errors import api_error
from moe_serve.api.prepare import GenerationJob, admission_bound, prepare_chat, prepare_completion, prepare_pooling
from moe_serve.api.prepare import detokenize as prepare_detokenize
from moe_serve.api.prepare import tokenize as prepare_tokenize
from moe_serve.engine.async_engine import AsyncEngine, GenerationStream, RequestUpdate, SequenceUpdate
from moe_serve.engine.runner import LoadedModel
from moe_serve.errors import ClientDisconnectedError, ModelNotFoundError, ValidationError
from moe_serve.moe_policy import KSpec
from moe_serve.outputs import ExpertCounts
from moe_serve.server.metrics import Metrics
from moe_serve.server.settings import ServerSettings

T = TypeVar("T")
K_SUFFIX = ":k"  # "shakespeare-smoe:k1": the model at k = 1


@dataclass(slots=True)
class ServedModel:
    name: str  # what responses, /v1/models and metrics report
    artifact: LoadedModel
    engine: AsyncEngine
    created: int
    aliases: tuple[str, ...] = ()  # more names a request may give (--served-model-name NAME ALIAS ...)

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    def reported(self, asked: str | None) -> str:
        """The model a response names: as asked (a `name:k<k>` variant is echoed, not its base), but an
        alias as the model's first name, as vLLM reports its first --served-model-name."""
        if asked is None:
            return self.name
        for alias in self.aliases:
            if asked == alias:
                return self.name
            if asked.startswith(alias + K_SUFFIX):
                return self.name + asked[len(alias) :]
        return asked

    def card(self, k: int | None = None) -> p.ModelCard:
        """The model's card; with k, the card of its `name:k<k>` variant (that k fixed)."""
        config = self.artifact.config
        moe = config.moe
        ks = {"default": k, "min": k, "max": k} if k else None
        if moe and not k:
            ks = {"default": moe.default_k, "min": moe.min_k, "max": moe.max_k}
        return p.ModelCard(
            id=f"{self.name}{K_SUFFIX}{k}" if k else self.name,
            created=self.created,
            parent=self.name if k else None,
            task=config.task,
            num_experts=moe.num_experts if moe else None,
            experts_per_token=ks,
            router=moe.router.kind if moe else None,
            max_model_len=self.engine.inputs.max_model_len,
        )

    tokenizer_key: tuple[str, bool, int | None] = field(init=False)  # equal for models that tokenize alike

    def __post_init__(self) -> None:
        config = self.artifact.config
        digest = hashlib.sha256(self.artifact.tokenizer.hf.to_str().encode()).hexdigest()
        self.tokenizer_key = (digest, config.add_bos_token, config.bos_token_id)

    def cards(self) -> list[p.ModelCard]:
        """The model, then a variant per k it allows: `name:k1` ... for clients that cannot send extra fields."""
        moe = self.artifact.config.moe
        return [self.card()] + ([self.card(k) for k in range(moe.min_k, moe.max_k + 1)] if moe else [])


@dataclass(slots=True)
class ServingContext:
    models: dict[str, ServedModel]
    settings: ServerSettings
    metrics: Metrics
    executor: Executor  # tokenizing and template rendering: off the event loop
    # Every name a request may give a model by, its name and its aliases (the models are fixed at start).
    names: dict[str, ServedModel] = field(init=False)

    def __post_init__(self) -> None:
        self.names = {name: served for served in self.models.values() for name in served.names}

    async def prepare(self, fn: Callable[..., T], *args: Any) -> T:
        """Run request preparation in the preparation threads, so the event loop never waits on it."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def respond(self, build: Callable[..., Any], *args: Any) -> JSONResponse:
        """A response body built and rendered to JSON in the preparation threads: a large one (a long prompt's
        echo with its logprobs, 16 inputs' token logprobs) must not hold the event loop, and with it /health
        and every other request. The same JSON that FastAPI renders for the route's response model."""

        def render() -> JSONResponse:
            return JSONResponse(build(*args).model_dump(mode="json", by_alias=True))

        return await self.prepare(render)

    def model(self, name: str | None) -> ServedModel:
        """The served model a request names (a `:k<k>` suffix allowed; `resolve` applies it)."""
        names = self.names
        name = split_k_suffix(name, names)[0]
        if name is None:
            if len(self.models) == 1:
                return next(iter(self.models.values()))
            raise ValidationError(
                f"model is required when several models are served ({', '.join(self.models)})", parameter="model"
            )
        if name not in names:
            raise ModelNotFoundError(name, list(names))
        return names[name]

    def tokenizer_model(self, name: str | None) -> ServedModel:
        """The model whose tokenizer /tokenize, /detokenize and /tokenizer_info use: the named one, or any
        when all served models tokenize alike (vLLM's endpoints take no model; lm-evaluation-harness sends
        none)."""
        if name is not None or len(self.models) == 1:
            return self.model(name)
        first, *others = self.models.values()
        if all(m.tokenizer_key == first.tokenizer_key for m in others):
            return first
        raise ValidationError("model is required: the served models do not share one tokenizer", parameter="model")

    def resolve(self, request: p.ModelRequest) -> tuple[ServedModel, p.ModelRequest]:
        """The model of an API request, and the request as that model serves it: a `name:k<k>` name fixes
        experts_per_token (a copy of the request with it set; a different experts_per_token in the same
        request is a 400). The request itself is never changed."""
        name, k = split_k_suffix(request.model, self.names)
        served = self.model(name)
        if k is None:
            return served, request
        if request.experts_per_token not in (None, k):
            raise ValidationError(
                f"model '{request.model}' fixes experts_per_token to {k}, but the request asks for "
                f"{request.experts_per_token}",
                parameter="experts_per_token",
            )
        fixed = copy.copy(request)  # a copy of its own fields (pydantic's __copy__): the request is unchanged
        fixed.experts_per_token = k
        return served, fixed


def split_k_suffix(name: str | None, served: Mapping[str, ServedModel]) -> tuple[str | None, int | None]:
    """ "smoe:k2" -> ("smoe", 2) when "smoe" is served (`served`: by every name; a served name that itself
    ends so wins)."""
    if name is None or name in served or K_SUFFIX not in name:
        return name, None
    base, _, k = name.rpartition(K_SUFFIX)
    if base in served and k.isascii() and k.isdigit() and len(k) <= 6:
        return base, int(k)
    return name, None


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


async def _merged(streams: Sequence[AsyncIterator[RequestUpdate]]) -> AsyncIterator[tuple[int, RequestUpdate]]:
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
    served, request = ctx.resolve(request)
    served.engine.check_room(*admission_bound(served.engine.inputs, request))  # a 429 before tokenizing
    job = await ctx.prepare(prepare_completion, served.engine.inputs, request, ctx.settings.limits)
    _annotate(http.state, served.name, k_label(job.reported_k, job.k), job.prompt_tokens)
    # Admitted (or refused: 429, 503) before a response starts.
    streams = served.engine.submit(job.requests) if job.generate else []
    ctx.metrics.count_tokens(served.name, k_label(job.reported_k, job.k), streams)  # as they are generated
    if request.stream:
        tokenizer = served.artifact.tokenizer
        sent: collections.Counter[tuple[int, int]] = collections.Counter()

        def choice(prompt_index: int, update: SequenceUpdate) -> p.CompletionChunkChoice:
            key = (prompt_index, update.index)
            chunk = responses.completion_chunk_choice(tokenizer, job, prompt_index, update, sent[key])
            sent[key] += len(update.text_delta)
            return chunk

        options = request.stream_options
        return _event_stream(ctx, served, job, streams, "completions", options, http.state, choice, model=request.model)
    results, prompt_scores = await _unless_disconnected(http, job.gather(served.engine, streams))
    label = k_label(job.reported_k, job.k)
    for result in results or []:
        prompt_tokens = len(result.prompt_token_ids)
        ctx.metrics.record_generation(served.name, "completions", label, prompt_tokens, result.metrics)
        ctx.metrics.record_experts(served.name, job.k, result.experts)
    http.state.completion_tokens = sum(r.num_generated_tokens for r in results or [])
    tokenizer = served.artifact.tokenizer
    model = served.reported(request.model)
    # Off the event loop: with echo and logprobs, thousands of tokens and their alternatives to decode.
    return await ctx.respond(responses.completion_response, model, job, results, tokenizer, None, prompt_scores)


async def chat_completions(ctx: ServingContext, request: p.ChatCompletionRequest, http: Request) -> Any:
    served, request = ctx.resolve(request)
    job = await ctx.prepare(prepare_chat, served.engine.inputs, request, ctx.settings.limits)
    _annotate(http.state, served.name, k_label(job.reported_k, job.k), job.prompt_tokens)
    streams = served.engine.submit(job.requests)  # admitted (or refused: 429, 503) before a response starts
    ctx.metrics.count_tokens(served.name, k_label(job.reported_k, job.k), streams)  # as they are generated
    if request.stream:
        chat_stream = responses.ChatChoiceStream(served.artifact.tokenizer, job)
        choice = lambda _, u: chat_stream.choice(u)  # noqa: E731
        first = responses.chat_role_choices(job.params.n)
        options = request.stream_options
        return _event_stream(ctx, served, job, streams, "chat", options, http.state, choice, first, request.model)
    result = await _unless_disconnected(http, streams[0].final())
    ctx.metrics.record_generation(
        served.name, "chat", k_label(job.reported_k, job.k), job.prompt_tokens, result.metrics
    )
    ctx.metrics.record_experts(served.name, job.k, result.experts)
    http.state.completion_tokens = result.num_generated_tokens
    return responses.chat_response(served.reported(request.model), job, result, served.artifact.tokenizer)


def _event_stream(
    ctx: ServingContext,
    served: ServedModel,
    job: GenerationJob,
    streams: list[GenerationStream],
    endpoint: str,
    options: p.StreamOptions | None,
    state: Any,
    choice: Callable[[int, SequenceUpdate], p.CompletionChunkChoice | p.ChatChunkChoice | None],
    first: list[p.ChatChunkChoice] | None = None,
    model: str | None = None,
) -> StreamingResponse:
    """SSE for a generation job: a chunk per completion update (choice(prompt index, update) builds its
    choice, or None when it holds it back), usage when asked, errors in-band once the response has started,
    then [DONE]."""
    kind: Literal["text_completion", "chat.completion.chunk"] = (
        "text_completion" if endpoint == "completions" else "chat.completion.chunk"
    )
    header = responses.StreamHeader.new(served.reported(model), kind)

    async def events() -> AsyncIterator[str]:
        if first:
            yield _sse(header.chunk(first).wire())
        completion_tokens, experts, label = 0, ExpertCounts(), k_label(job.reported_k, job.k)
        cached = 0  # prompt tokens the prefix cache served
        try:
            async for prompt_index, update in _merged(streams):
                for u in update.updates:
                    completion_tokens += len(u.token_ids)
                    built = choice(prompt_index, u)
                    if built is not None:  # None: held back (text that may be a tool call)
                        yield _sse(header.chunk([built]).wire())
                if update.finished:
                    prompt_tokens = len(job.requests[prompt_index].prompt_token_ids)
                    ctx.metrics.record_generation(served.name, endpoint, label, prompt_tokens, update.metrics)
                    ctx.metrics.record_experts(served.name, job.k, update.experts)
                    experts = ExpertCounts.total([experts, update.experts])
                    cached += update.metrics.cached_tokens if update.metrics is not None else 0
            if options and options.include_usage:
                usage = responses.usage(
                    job.prompt_tokens,
                    completion_tokens,
                    job.reported_k,
                    spec=job.k,
                    experts=experts,
                    cached_tokens=cached,
                )
                yield _sse(header.chunk([], usage).wire())
        except Exception as exc:  # headers are gone: report in-band, then close the stream
            yield _sse(api_error(exc).body())
        finally:
            for stream in streams:
                stream.abort()  # whatever ended the stream (a client gone, an error), the work stops
        state.completion_tokens = completion_tokens
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


# ---- /v1/classify and /v1/score -----------------------------------------------------------------


async def classify(ctx: ServingContext, request: p.ClassifyRequest, http: Request) -> Any:
    served, request = ctx.resolve(request)
    served.engine.check_room(*admission_bound(served.engine.inputs, request))  # a 429 before tokenizing
    job = await ctx.prepare(prepare_pooling, served.engine.inputs, request, ctx.settings.limits)
    label = k_label(job.reported_k, job.k)
    _annotate(http.state, served.name, label, job.prompt_tokens)
    start = time.monotonic()
    results = await _unless_disconnected(http, served.engine.classify(job.token_ids, job.k))
    ctx.metrics.record_pooling(served.name, "classify", label, time.monotonic() - start, job.prompt_tokens)
    ctx.metrics.record_experts(served.name, job.k, ExpertCounts.total(r.experts for r in results))
    return await ctx.respond(responses.classify_response, served.reported(request.model), job, results)


async def score(ctx: ServingContext, request: p.ScoreRequest, http: Request) -> Any:
    served, request = ctx.resolve(request)
    served.engine.check_room(*admission_bound(served.engine.inputs, request))  # a 429 before tokenizing
    job = await ctx.prepare(prepare_pooling, served.engine.inputs, request, ctx.settings.limits)
    label = k_label(job.reported_k, job.k)
    _annotate(http.state, served.name, label, job.prompt_tokens)
    start = time.monotonic()
    results = await _unless_disconnected(http, served.engine.score(job.token_ids, job.k, job.return_token_logprobs))
    ctx.metrics.record_pooling(served.name, "score", label, time.monotonic() - start, job.prompt_tokens)
    ctx.metrics.record_experts(served.name, job.k, ExpertCounts.total(r.experts for r in results))
    return await ctx.respond(responses.score_response, served.reported(request.model), job, results)


# ---- vLLM's tokenizer endpoints ----------------------------------------------------------------------


async def tokenize(ctx: ServingContext, request: p.TokenizeRequest) -> p.TokenizeResponse:
    return await ctx.prepare(prepare_tokenize, ctx.tokenizer_model(request.model).engine.inputs, request)


async def detokenize(ctx: ServingContext, request: p.DetokenizeRequest) -> p.DetokenizeResponse:
    return await ctx.prepare(prepare_detokenize, ctx.tokenizer_model(request.model).engine.inputs, request)


def tokenizer_info(ctx: ServingContext, model: str | None) -> p.TokenizerInfo:
    served = ctx.tokenizer_model(model)
    inputs, config = served.engine.inputs, served.artifact.config
    token = lambda i: inputs.tokenizer.id_to_token(i) if i is not None else None  # noqa: E731
    return p.TokenizerInfo(
        model=served.name,
        tokenizer_class="PreTrainedTokenizerFast",  # tokenizer.json, what `tokenizers` and transformers load
        vocab_size=inputs.tokenizer.vocab_size,
        bos_token=token(config.bos_token_id),
        eos_token=token(config.eos_token_ids[0] if config.eos_token_ids else None),
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_ids[0] if config.eos_token_ids else None,
        add_bos_token=config.add_bos_token,
        model_max_length=inputs.max_model_len,
        chat_template=config.chat_template,
        chat_stop=list(config.chat_stop),
    )


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


def k_label(reported_k: int | None, spec: KSpec) -> int | str | None:
    """The k that metrics and the access log show: the fixed k, "top_p" under a `moe` policy, "auto" for
    experts_per_token "auto", None for a dense model."""
    return spec.label if spec.k_varies else reported_k


def _annotate(state: Any, model: str, k: int | str | None, prompt_tokens: int) -> None:
    """What the access log and request counter need to know about the request."""
    state.model, state.k, state.prompt_tokens = model, k, prompt_tokens
