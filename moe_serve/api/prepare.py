"""API request -> validated engine work, the same for HTTP and batch files. Everything a request asks
for is checked here, once, before anything runs; the engine trusts what this returns."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, Literal

from jinja2 import TemplateError

from moe_serve.api import protocol as p
from moe_serve.api.tools import ToolPlan
from moe_serve.api.tools import plan as tool_plan
from moe_serve.chat_template import TemplateEnvironment
from moe_serve.config import RequestLimits
from moe_serve.engine.async_engine import AsyncEngine, GenerationStream
from moe_serve.engine.inputs import GenerationRequest, InputProcessor
from moe_serve.errors import ValidationError
from moe_serve.moe_policy import KSpec
from moe_serve.outputs import RequestOutput, ScoreOutput
from moe_serve.sampling_params import SamplingParams


@dataclass(slots=True)
class GenerationJob:
    """A completion or chat request: one engine request per prompt, all with the same parameters."""

    requests: list[GenerationRequest]
    params: SamplingParams
    reported_k: int | None  # what responses report (None for a dense model or a `moe` policy)
    logprobs: int | None  # alternatives per token to return (None: no logprobs)
    echo: bool = False  # completions: the prompt precedes each choice's text (and its logprobs, scored)
    generate: bool = True  # False for echo with max_tokens 0: the prompt is only scored
    tools: ToolPlan | None = None  # chat with tools: how replies are constrained and read back

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def k(self) -> KSpec:
        """The k spec of every request of the job."""
        return self.requests[0].k

    async def gather(
        self, engine: AsyncEngine, streams: list[GenerationStream], background: bool = False
    ) -> tuple[list[RequestOutput] | None, list[ScoreOutput] | None]:
        """The job's results once complete: each admitted stream's final output (None when nothing was to
        be generated), and with echo and logprobs, the prompts' scores, computed alongside (background: as
        batch work, AsyncEngine.score)."""
        work: list[Awaitable[Any]] = [s.final() for s in streams]
        if self.echo and self.logprobs is not None:
            prompts = [r.prompt_token_ids for r in self.requests]
            work.append(engine.score(prompts, self.requests[0].k, True, self.logprobs, background))
        done = await asyncio.gather(*work)
        return (list(done[: len(streams)]) or None), (done[-1] if len(done) > len(streams) else None)


@dataclass(slots=True)
class PoolingJob:
    """A classify or score request: token ids of each input, all at one k spec."""

    kind: Literal["classify", "score"]
    token_ids: list[list[int]]
    k: KSpec  # what AsyncEngine.classify and .score take
    reported_k: int | None
    approximate: bool
    return_token_logprobs: bool = False

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.token_ids))


def admission_bound(
    inputs: InputProcessor, request: p.CompletionRequest | p.ClassifyRequest | p.ScoreRequest
) -> tuple[int, int]:
    """(sequences, a lower bound of their prompt tokens together) that a request will ask the engine for,
    read from its body without tokenizing: AsyncEngine.check_room refuses with these what the engine would
    refuse anyway, before the request is prepared. A text has at least one token per max_token_chars
    characters."""
    texts: list[str] | list[str | list[int]]
    if isinstance(request, p.CompletionRequest):
        texts = request.prompts()
        per_prompt = (request.n or 1) if request.max_tokens != 0 else 1  # max_tokens 0: the prompts are scored
    else:
        texts = [request.input] if isinstance(request.input, str) else list(request.input)
        per_prompt = 1
    chars = inputs.tokenizer.max_token_chars
    bos = int(inputs.config.add_bos_token)
    tokens = sum(len(x) if isinstance(x, list) else bos + -(-len(x) // chars) for x in texts)
    return len(texts) * per_prompt, tokens


def prepare_completion(inputs: InputProcessor, request: p.CompletionRequest, limits: RequestLimits) -> GenerationJob:
    inputs.require_task("causal_lm", "/v1/completions")
    params = request.to_sampling_params(limits.max_tokens_cap, request.logprobs)
    texts = request.prompts()
    if len(texts) > limits.max_prompts:
        raise ValidationError(
            f"prompt has {len(texts)} prompts; at most {limits.max_prompts} per request", parameter="prompt"
        )
    encoded = iter(inputs.encode_texts([x for x in texts if isinstance(x, str)], "prompt"))
    prompts = [next(encoded) if isinstance(x, str) else x for x in texts]
    limits.check_work([len(ids) for ids in prompts], "prompt")
    requests = [inputs.generation_request(ids, params) for ids in prompts]
    k = inputs.config.reported_k(requests[0].k)
    return GenerationJob(requests, params, k, request.logprobs, request.echo, request.max_tokens != 0)


def prepare_chat(inputs: InputProcessor, request: p.ChatCompletionRequest, limits: RequestLimits) -> GenerationJob:
    inputs.require_task("causal_lm", "/v1/chat/completions")
    params = request.to_sampling_params(limits.max_tokens_cap)  # refuses what is not implemented, before rendering
    tools = tool_plan(request, inputs.config.chat_template or "")
    calls = tools.structured_output() if tools is not None else None
    if tools is not None and calls is not None:
        if params.structured_output is not None:
            raise ValidationError(
                f"give either {params.structured_output.parameter} or tool_choice {tools.mode!r} (both constrain "
                "the reply)",
                parameter="tool_choice",
            )
        params = dataclasses.replace(params, structured_output=calls)
    rendered = render_chat(inputs, request.messages, tools.template_tools if tools is not None else None)
    prompt = inputs.tokenizer.encode_rendered(rendered)
    if request.stop is None and inputs.config.chat_stop:  # the model's default; a request's own stop replaces it
        params = dataclasses.replace(params, stop=list(inputs.config.chat_stop))
    if request.max_tokens is None:  # as OpenAI and vLLM: a reply may run to the end of the context (or the cap)
        params = dataclasses.replace(
            params, max_tokens=max(1, min(limits.max_tokens_cap, inputs.max_model_len - len(prompt)))
        )
    generation = inputs.generation_request(prompt, params)
    k = inputs.config.reported_k(generation.k)
    return GenerationJob([generation], params, k, params.logprobs, tools=tools)


def prepare_pooling(
    inputs: InputProcessor, request: p.ClassifyRequest | p.ScoreRequest, limits: RequestLimits
) -> PoolingJob:
    is_score = isinstance(request, p.ScoreRequest)
    inputs.require_task(
        "causal_lm" if is_score else "sequence_classification", "/v1/score" if is_score else "/v1/classify"
    )
    texts = [request.input] if isinstance(request.input, str) else request.input
    if not texts:
        raise ValidationError("input must not be empty", parameter="input")
    if len(texts) > limits.max_inputs:
        raise ValidationError(
            f"input has {len(texts)} items; at most {limits.max_inputs} per request", parameter="input"
        )
    k = inputs.resolve(request.experts_per_token, request.moe.to_policy() if request.moe is not None else None)
    token_ids = inputs.encode_texts(texts, "input")
    limits.check_work([len(ids) for ids in token_ids], "input")
    for index, ids in enumerate(token_ids):
        (inputs.check_score_input if is_score else inputs.check_classify_input)(ids, index)
    return PoolingJob(
        "score" if is_score else "classify",
        token_ids,
        k,
        inputs.config.reported_k(k),
        inputs.config.is_approximate(k),
        bool(getattr(request, "return_token_logprobs", False)),
    )


def tokenize(inputs: InputProcessor, request: p.TokenizeRequest) -> p.TokenizeResponse:
    """vLLM's /tokenize: the ids a completion (prompt) or a chat request (messages) would run on, except that a
    prompt's special-token strings are read as those tokens, as vLLM reads them: lm-evaluation-harness finds a
    model's BOS and EOS ids by tokenizing their strings here (a completion's prompt text keeps them literal, so
    a user's text cannot smuggle in a special token; token-id prompts carry them)."""
    request.refuse_unsupported()
    if request.messages is not None:
        ids = inputs.tokenizer.encode_rendered(render_chat(inputs, request.messages))
    else:
        assert request.prompt is not None  # the request's validator: exactly one of prompt and messages
        ids = inputs.encode_text(request.prompt, "prompt", special_tokens=True)
        if not request.add_special_tokens and inputs.config.add_bos_token:
            ids = ids[1:]
    strs = [inputs.tokenizer.id_to_token(t) for t in ids] if request.return_token_strs else None
    return p.TokenizeResponse(count=len(ids), max_model_len=inputs.max_model_len, tokens=ids, token_strs=strs)


def detokenize(inputs: InputProcessor, request: p.DetokenizeRequest) -> p.DetokenizeResponse:
    ids = inputs.check_token_ids(request.tokens, "tokens") if request.tokens else []
    return p.DetokenizeResponse(prompt=inputs.tokenizer.decode(ids))


def render_chat(
    inputs: InputProcessor, messages: list[p.ChatMessage], tools: list[dict[str, Any]] | None = None
) -> str:
    """The model's chat template (Jinja, sandboxed) applied to the messages (and the request's tools, as
    transformers' apply_chat_template passes them: None when there are none), with a generation prompt. The
    output, and every value the template builds without emitting it, is capped at what the model's context
    could ever hold, and the render's steps and time are bounded (moe_serve.chat_template): a template that
    multiplies its input or loops without end is stopped as it renders, and a template that fails is the
    request's problem (400 naming `messages`)."""
    config, tokenizer = inputs.config, inputs.tokenizer
    if not config.chat_template:
        raise ValidationError(f"model '{inputs.name}' has no chat template; use /v1/completions", parameter="messages")

    def special(token_id: int | None) -> str:
        return tokenizer.id_to_token(token_id) if token_id is not None else ""

    cap = inputs.max_text_chars
    environment = TemplateEnvironment(cap)  # bounds the render's steps, time and every value it builds
    try:
        parts, size = [], 0
        for part in environment.render_parts(
            config.chat_template,
            messages=[m.for_template() for m in messages],
            tools=tools,
            add_generation_prompt=True,
            bos_token=special(config.bos_token_id),
            eos_token=special(config.eos_token_ids[0] if config.eos_token_ids else None),
        ):
            size += len(part)
            if size > cap:
                raise ValidationError(
                    f"the chat template renders these messages to more than {cap} characters, more than the "
                    f"model's context of {inputs.max_model_len} tokens could hold",
                    parameter="messages",
                )
            parts.append(part)
    except TemplateError as exc:
        raise ValidationError(f"the chat template cannot render these messages: {exc}", parameter="messages") from None
    return "".join(parts)
