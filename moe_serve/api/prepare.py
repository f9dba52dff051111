"""API request -> validated engine work, the same for HTTP and batch files. Everything a request asks
for is checked here, once, before anything runs; the engine trusts what this returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from moe_serve.api import protocol as p
from moe_serve.config import RequestLimits
from moe_serve.engine.inputs import GenerationRequest, InputProcessor
from moe_serve.errors import ValidationError
from moe_serve.sampling_params import SamplingParams


@dataclass(slots=True)
class GenerationJob:
    """A completion or chat request: one engine request per prompt, all with the same parameters."""

    requests: list[GenerationRequest]
    params: SamplingParams
    reported_k: int | None  # what responses report (None for a dense model)
    logprobs: int | None  # completions: alternatives per token to return (None: no logprobs)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)


@dataclass(slots=True)
class PoolingJob:
    """A classify or score request: token ids of each input, all at one k."""

    kind: Literal["classify", "score"]
    token_ids: list[list[int]]
    k: int
    reported_k: int | None
    approximate: bool
    return_token_logprobs: bool = False

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.token_ids))


def prepare_completion(inputs: InputProcessor, request: p.CompletionRequest, limits: RequestLimits) -> GenerationJob:
    inputs.require_task("causal_lm", "/v1/completions")
    params = request.to_sampling_params(limits.max_tokens_cap, request.logprobs)
    texts = request.prompts()
    if len(texts) > limits.max_prompts:
        raise ValidationError(
            f"prompt has {len(texts)} prompts; at most {limits.max_prompts} per request", parameter="prompt"
        )
    prompts = [inputs.encode_text(x, "prompt") if isinstance(x, str) else x for x in texts]
    requests = [inputs.generation_request(ids, params) for ids in prompts]
    return GenerationJob(requests, params, inputs.config.reported_k(requests[0].k), request.logprobs)


def prepare_chat(inputs: InputProcessor, request: p.ChatCompletionRequest, limits: RequestLimits) -> GenerationJob:
    inputs.require_task("causal_lm", "/v1/chat/completions")
    prompt = inputs.tokenizer.encode_rendered(render_chat(inputs, request.messages))
    params = request.to_sampling_params(limits.max_tokens_cap)
    generation = inputs.generation_request(prompt, params)
    return GenerationJob([generation], params, inputs.config.reported_k(generation.k), None)


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
    k = inputs.resolve_k(request.experts_per_token)
    token_ids = [inputs.encode_text(text, "input") for text in texts]
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


def render_chat(inputs: InputProcessor, messages: list[p.ChatMessage]) -> str:
    """The model's chat template (Jinja, sandboxed) applied to the messages, with a generation prompt. The
    output is capped at what the model's context could ever hold: a template that multiplies its input is
    stopped as it renders, and a template that fails is the request's problem (400 naming `messages`)."""
    config, tokenizer = inputs.config, inputs.tokenizer
    if not config.chat_template:
        raise ValidationError(f"model '{inputs.name}' has no chat template; use /v1/completions", parameter="messages")

    def special(token_id: int | None) -> str:
        return tokenizer.id_to_token(token_id) if token_id is not None else ""

    cap = inputs.max_text_chars
    environment = _TemplateEnvironment(cap)
    try:
        template = environment.from_string(config.chat_template)
        parts, size = [], 0
        for part in template.generate(
            messages=[m.model_dump() for m in messages],
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


class _TemplateEnvironment(ImmutableSandboxedEnvironment):
    """A sandbox in which `*` and `**` cannot build a string or list longer than the render cap at once."""

    intercepted_binops = frozenset(["*", "**"])

    def __init__(self, cap: int) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True)
        self.cap = cap

    def call_binop(self, context, operator: str, left, right):  # noqa: ANN001  # jinja's signature
        if operator == "*" and isinstance(left, str | list | tuple) and isinstance(right, int):
            if len(left) * right > self.cap:
                raise TemplateError(f"the template repeats a value {right} times, past the render cap")
        if operator == "*" and isinstance(right, str | list | tuple) and isinstance(left, int):
            return self.call_binop(context, operator, right, left)
        if operator == "**" and isinstance(right, int) and abs(right) > 1024:
            raise TemplateError("the template raises a number to a power above 1024")
        return super().call_binop(context, operator, left, right)
